"""The data half at 8,192 tokens a sequence (ModernBERT's phase 2): real documents, some longer than a row, encoded
as the recipe does (documents, dynamic per_token masks at 30%, 16 to a row) pack into rows whose sequences are their
unpacked instances token for token; the loader masks 30% of their text and nothing else; and the batch's host
indices give the varlen kernel each sequence, its positions running to its length. And a phase at 1,024 then one at
2,048 with a new global theta trains on that text."""
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.fixtures.real_shaped_text import tokenized_sample
from tests.test_encode import assert_packed_equal_unpacked, read_all
from tests.test_full_rows import assert_tight
from workflow.data.encode import EncodeSettings, Vocab, encode_shard
from workflow.data.masking_rule import derived_max_predictions
from workflow.data.pack import PackSettings
from workflow.data.tokenize import load_tokenized, tokenize_shard
from workflow.data.tokenizer import vocab_tokens
from workflow.data.vocab import special_token_ids, train_bpe
from workflow.train.models.family import family
from workflow.train.masking import LoadTimeMasker
from workflow.train.pretraining_data import make_batch

LENGTH = 8192
BOOKS = Path(__file__).resolve().parents[1] / "sample" / "books"


@pytest.fixture(scope="module")
def encoded(tmp_path_factory):
    """(unpacked, packed) arrays of the sample's articles and books at 8,192 tokens, and their files and vocab."""
    root = tmp_path_factory.mktemp("long_context")
    tokenized_sample(root / "wikipedia", vocab_size=500)  # its formatted articles: wikipedia/wikipedia.txt
    books = ["\n".join(s for s in re.split(r"(?<=[.!?])\s+", " ".join(book.read_text().split())) if s)
             for book in sorted(BOOKS.glob("*.txt"))]
    text = root / "shard.txt"
    articles = (root / "wikipedia" / "wikipedia.txt").read_text().rstrip("\n")
    text.write_text(articles + "\n\n" + "\n\n".join(books) + "\n")
    train_bpe([text], root / "tokenizer.json", 2000)
    tokenize_shard(text, root / "tokenizer.json", root / "shard.npz")
    settings = EncodeSettings(max_seq_length=LENGTH, masked_lm_prob=0.3, masking="dynamic", objective="documents",
                              masking_rule="per_token",
                              max_predictions_per_seq=derived_max_predictions(LENGTH, "per_token", (0.3,)))
    paths = root / "unpacked.hdf5", root / "packed.hdf5"
    encode_shard(root / "shard.npz", root / "tokenizer.json", paths[0], settings, 5, "training", 0)
    encode_shard(root / "shard.npz", root / "tokenizer.json", paths[1], settings, 5, "training", 0, "gzip",
                 PackSettings(16))
    (unpacked, _), (packed, _) = read_all(paths[0]), read_all(paths[1])
    return unpacked, packed, paths, root


def test_long_documents_pack_at_8192_as_their_unpacked_instances(encoded):
    unpacked, packed, _, root = encoded
    _, _, documents = load_tokenized(root / "shard.npz")
    lengths = unpacked["input_mask"].sum(axis=1)
    assert lengths.max() > LENGTH - 64 and len(lengths) > len(documents) - 1  # a book runs on into a second sequence
    assert packed["input_ids"].shape[1] == LENGTH and (packed["sequence_lengths"] > 0).sum(axis=1).max() > 3
    vocab = Vocab.read(root / "tokenizer.json")
    specials = {vocab.cls, vocab.sep, vocab.mask, *special_token_ids(vocab_tokens(root / "tokenizer.json")).values()}
    assert_packed_equal_unpacked(packed, unpacked, specials, vocab)


def test_load_time_masks_of_packed_rows_at_8192_mask_30_percent_of_the_text_only(encoded):
    _, packed, paths, root = encoded
    vocab = Vocab.read(root / "tokenizer.json")
    masked = LoadTimeMasker.of_shard(str(paths[1]), 7)(packed, 0, 0, np.arange(len(packed["input_ids"])))
    rows, columns = np.nonzero(masked["masked_lm_positions"] > 0)
    positions = masked["masked_lm_positions"][rows, columns]
    restored = masked["input_ids"].copy()
    restored[rows, positions] = masked["masked_lm_ids"][rows, columns]
    np.testing.assert_array_equal(restored, packed["input_ids"])  # the rest of every row as written
    assert not np.isin(packed["input_ids"][rows, positions], [0, vocab.cls, vocab.sep, vocab.mask]).any()
    text = int(packed["input_mask"].astype(bool).sum()) - 2 * int((packed["sequence_lengths"] > 0).sum())
    assert abs(len(rows) / text - 0.3) < 4 * np.sqrt(0.3 * 0.7 / text)  # per_token at 30%, binomial bounds


def test_host_indices_give_each_sequence_with_positions_up_to_its_length(encoded):
    _, packed, paths, _ = encoded
    masked = LoadTimeMasker.of_shard(str(paths[1]), 7)(packed, 0, 0, np.arange(len(packed["input_ids"])))
    batch = family("modernbert").host_indices(make_batch(masked, slice(None)))
    lengths = packed["sequence_lengths"][packed["sequence_lengths"] > 0]  # row-major: the varlen order
    rows, slots = batch["cls_positions"].shape
    offsets = batch["cu_seqlens"]
    starts, sizes = offsets[:-1], torch.diff(offsets)
    assert_tight(offsets, rows * (slots + 1)) and batch["max_seqlen"] == LENGTH  # the row length: static
    real = (sizes > 0) & (batch["attention_mask"].flatten()[starts.clamp(max=rows * LENGTH - 1)] > 0)
    np.testing.assert_array_equal(sizes[real].numpy(), lengths)  # the rest: padding runs, then empty sequences
    assert lengths.max() > LENGTH - 64 and int(batch["position_ids"].max()) == lengths.max() - 1


def test_a_phase_at_1024_then_one_at_2048_with_a_new_global_theta_trains_on_the_sample(encoded, tmp_path):
    """Context extension as the recipe does it, at the sample's size: phase 2 starts from phase 1's export and
    StableAdamW state, on rows twice as long, with the global layers' theta raised."""
    from tests.test_pretrain import settings
    from workflow.train.pretrain import pretrain

    _, _, _, root = encoded
    summaries = []
    for phase, length, steps, batch, theta in (("phase1", 1024, 3, 4, None), ("phase2", 2048, 2, 2, 320000.0)):
        data = tmp_path / f"hdf5_seq{length}"
        encode = EncodeSettings(max_seq_length=length, masked_lm_prob=0.3, masking="dynamic", objective="documents",
                                masking_rule="per_token",
                                max_predictions_per_seq=derived_max_predictions(length, "per_token", (0.3,)))
        for split in ("training", "test"):
            encode_shard(root / "shard.npz", root / "tokenizer.json", data / split / "shard_0.hdf5", encode, 5, split,
                         0, "none", PackSettings(16))
        previous = tmp_path / "phase1"
        s = settings(tmp_path, tmp_path / phase, phase=phase, data_dir=str(data), vocab=str(root / "tokenizer.json"),
                     bert_config=None, family="modernbert", preset="modernbert-tiny",
                     architecture={"num_hidden_layers": 3, "max_position_embeddings": 2048, "global_rope_theta": 1e4},
                     optimizer="stable_adamw", weight_decay=1e-5, beta2=0.98, max_grad_norm=None,
                     learning_rate=1e-3, warmup_proportion=0.0, total_steps=steps, global_batch_size=batch,
                     micro_batch_size=batch // 2, eval_max_sequences=8, log_every=1,
                     **({} if theta is None else {"global_rope_theta": theta}),
                     out_optimizer=str(tmp_path / phase / "optimizer_state.pt"),
                     init_from=str(previous / "model") if phase == "phase2" else None,
                     init_optimizer=str(previous / "optimizer_state.pt") if phase == "phase2" else None)
        summaries.append(pretrain(s))
    assert [(s["seq_length"], s["steps"]) for s in summaries] == [(1024, 3), (2048, 2)]
    assert [s["model"]["global_rope_theta"] for s in summaries] == [1e4, 320000.0]
    assert all(np.isfinite(s["test_mlm_loss"]) for s in summaries)
