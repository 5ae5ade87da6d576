"""encode.objective: documents (RoBERTa's DOC-SENTENCES): each instance one document's contiguous sentences, packed,
and no token attending into another instance in either family's model (rows with block-diagonal masks, unpadded
varlen); trained like full_sentences, without NSP."""
import json

import h5py
import numpy as np
import pytest
import torch

from tests.fixtures.real_shaped_text import tokenized_sample
from workflow.cli import UserError
from workflow.data.encode import EncodeSettings, Vocab, encode_shard, plan_full_sentences
from workflow.data.pack import PackSettings
from workflow.data.tokenize import load_tokenized
from workflow.train.models import kit
from workflow.train.models import modernbert
from workflow.train.models.family import family
from workflow.train.models.bert import BertConfig, BertForPreTraining
from workflow.train.models.modernbert import ModernBertConfig, ModernBertForMaskedLM
from workflow.train.pretraining_data import PretrainingSequences, list_shards

DOCUMENTS = dict(max_seq_length=128, max_predictions_per_seq=20, masking="dynamic", objective="documents")


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    root = tmp_path_factory.mktemp("documents")
    return root, *tokenized_sample(root, vocab_size=500)


def test_document_rows_hold_every_token_once_in_order_each_within_one_document(sample):
    _, _, tokenized = sample
    ids, sentences, documents = load_tokenized(tokenized)
    plan = plan_full_sentences(sentences, documents, EncodeSettings(max_seq_length=128, objective="documents"),
                               np.random.default_rng(0), cross_documents=False)
    a_start, a_end, b_start, b_end, label = plan.T
    assert not label.any() and (b_end == b_start).all()  # no B, no NSP label
    assert (a_end - a_start <= 125).all() and (a_end > a_start).all()
    order = np.argsort(a_start)
    assert a_start[order][0] == 0 and a_end[order][-1] == len(ids) and np.array_equal(a_start[order][1:],
                                                                                       a_end[order][:-1])
    token_of_document = sentences[documents]
    document_of = np.searchsorted(token_of_document, np.stack([a_start, a_end - 1], 1), side="right")
    assert (document_of[:, 0] == document_of[:, 1]).all()  # never two documents in one instance
    # A row ends at a sentence boundary (a document's end when it is short), or after 125 tokens of a long sentence.
    at_boundary = np.isin(a_end, sentences)
    assert at_boundary.mean() > 0.9 and (a_end[~at_boundary] - a_start[~at_boundary] == 125).all()
    # Filled greedily: a row ending inside its document could not take the next sentence.
    inside = at_boundary & ~np.isin(a_end, token_of_document)
    next_end = sentences[np.searchsorted(sentences, a_end[inside]) + 1]
    assert inside.sum() > 50 and (next_end - a_start[inside] > 125).all()
    assert np.isin(a_end, token_of_document).sum() == len(documents) - 1  # every document ends a row
    full = plan_full_sentences(sentences, documents, EncodeSettings(max_seq_length=128, objective="full_sentences"),
                               np.random.default_rng(0))
    assert len(plan) > len(full)  # full_sentences fills a row's end with the next document


def test_document_instances_are_one_segment_without_nsp_labels_written_once(sample, tmp_path):
    _, vocab_path, tokenized = sample
    vocab = Vocab.read(vocab_path)
    encode_shard(tokenized, vocab_path, tmp_path / "d.hdf5", EncodeSettings(**DOCUMENTS), 1, "training", 0)
    with h5py.File(tmp_path / "d.hdf5", "r") as handle:
        assert handle.attrs["objective"] == "documents" and handle.attrs["dupe_factor"] == 1  # ignored: 5
        ids, mask = handle["input_ids"][()], handle["input_mask"][()]
        assert not handle["next_sentence_labels"][()].any() and not handle["segment_ids"][()].any()
    n = mask.sum(axis=1)
    assert (ids[:, 0] == vocab.cls).all() and (ids[np.arange(len(ids)), n - 1] == vocab.sep).all()
    assert (((ids == vocab.sep) & (mask > 0)).sum(axis=1) == 1).all()


@pytest.fixture(scope="module")
def packed_documents(sample):
    """Packed rows of the sample's documents (dynamic masks) that hold two or three instances."""
    root, vocab_path, tokenized = sample
    path = root / "packed" / "training" / "shard_0.hdf5"
    encode_shard(tokenized, vocab_path, path, EncodeSettings(**DOCUMENTS), 1, "training", 0, "none",
                 PackSettings())
    sequences = PretrainingSequences(list_shards(path.parent.parent, "training"), seed=3)
    batch = sequences.read(0, sequences.epoch_length)
    several = torch.nonzero(batch["attention_mask"].max(dim=1).values >= 2).squeeze(1)[:24]  # rows of 2 or 3
    assert len(several) == 24
    return {name: values[several] for name, values in batch.items()}, Vocab.read(vocab_path).size


def models(vocab_size: int):
    torch.manual_seed(0)
    bert = BertForPreTraining(BertConfig.preset("tiny", vocab_size=vocab_size)).eval()
    modern = ModernBertForMaskedLM(ModernBertConfig.preset("modernbert-tiny", vocab_size=vocab_size,
                                                           pad_token_id=0, local_attention=32)).eval()
    return {"bert": bert, "modernbert": modern}


def logits_of(model, batch) -> torch.Tensor:
    """[B, L, V]: the MLM logits at every position of the packed rows."""
    rows, length = batch["input_ids"].shape
    every = torch.arange(length).expand(rows, length)
    with torch.no_grad():
        logits, _ = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"], every,
                          batch["position_ids"], batch["cls_positions"])
    return logits.reshape(rows, length, -1)


@pytest.mark.parametrize("path", ["rows", "unpadded"])
@pytest.mark.parametrize("name", ["bert", "modernbert"])
def test_no_token_of_a_packed_row_attends_into_another_instance(packed_documents, name, path, monkeypatch):
    """New tokens in every row's last instance change its own logits and none of the other instances'."""
    if path == "unpadded":  # the CUDA path on CPU: varlen (the varlen op's CPU reference)
        monkeypatch.setattr(kit, "VARLEN_DEVICE_TYPES", ("cuda", "cpu"))
        monkeypatch.setattr(modernbert, "VARLEN_DTYPES", (torch.float16, torch.bfloat16, torch.float32))
    batch, vocab_size = packed_documents
    model = models(vocab_size)[name]
    sequence = batch["attention_mask"]
    last = sequence.max(dim=1, keepdim=True).values
    changed = dict(batch)
    in_last = (sequence == last) & (batch["position_ids"] > 0)  # its [CLS] stays
    changed["input_ids"] = torch.where(in_last, torch.randint(5, vocab_size, sequence.shape), batch["input_ids"])
    before, after = logits_of(model, batch), logits_of(model, changed)
    others = (sequence > 0) & (sequence < last)
    assert others.sum() > 500 and in_last.sum() > 200
    assert (before[others] - after[others]).abs().max() < 1e-5
    assert (before[in_last] - after[in_last]).abs().amax(dim=1).min() > 1e-3  # the instance itself sees them


def test_both_families_train_documents_without_next_sentence_prediction():
    family("bert").check_objective("documents")
    family("modernbert").check_objective("documents")
    with pytest.raises(UserError, match=r"^encode\.objective nsp: model\.family modernbert has no next-sentence "
                                        r"head; encode the data with encode\.objective: full_sentences or documents$"):
        family("modernbert").check_objective("nsp")


def test_documents_with_per_token_masks_train_without_nsp_resume_exactly_and_score_at_15_percent(sample, tmp_path):
    from tests.test_objective import tiny_settings
    from tests.test_pretrain import replace
    from workflow.train.models.bert import load_pretrained
    from workflow.train.pretrain import pretrain

    root, vocab, tokenized = sample
    directory = tmp_path / "hdf5"
    settings = EncodeSettings(**{**DOCUMENTS, "max_seq_length": 64, "max_predictions_per_seq": 48},
                              masked_lm_prob=0.3, masking_rule="per_token")
    for split in ("training", "test"):
        (directory / split).mkdir(parents=True)
        encode_shard(tokenized, vocab, directory / split / "shard_0.hdf5", settings, 1, split, 0, "none",
                     PackSettings())
    (directory / "vocab.txt").write_bytes(vocab.read_bytes())
    straight = tiny_settings(tmp_path, tmp_path / "straight", eval_max_sequences=None)
    summary = pretrain(straight)
    assert (summary["objective"], summary["next_sentence_prediction"]) == ("documents", False)
    metrics = [json.loads(line) for line in open(straight.out_metrics)]
    assert all(not {"nsp_loss", "nsp_accuracy"} & set(m) and m["loss"] == m["mlm_loss"] for m in metrics)
    # The held-out set: every test sequence, masked at 15% of its text tokens (2 of each sequence's are specials).
    test = list_shards(directory, "test")
    tokens = sum(int(h5py.File(s.path, "r")["sequence_lengths"][()].sum()) for s in test) - 2 * sum(s.n for s in test)
    assert abs(summary["test_predictions"] - 0.15 * tokens) < 6 * (0.15 * 0.85 * tokens) ** 0.5
    assert summary["test_sequences"] == sum(s.n for s in test) and "test_nsp_accuracy" not in summary
    stopped = tiny_settings(tmp_path, tmp_path / "stopped", eval_max_sequences=None, max_steps=3)
    pretrain(stopped)
    resumed = pretrain(replace(stopped, max_steps=None))
    assert resumed["test_mlm_accuracy"] == summary["test_mlm_accuracy"]
    _, expected = load_pretrained(straight.out_model)
    _, after_resume = load_pretrained(stopped.out_model)
    assert all(torch.equal(expected[k], after_resume[k]) for k in expected)
