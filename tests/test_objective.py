"""encode.objective: full_sentences (RoBERTa's FULL-SENTENCES rows, no NSP) with dynamic masking: the rows, the
bytes against the default recipe, training without NSP, an exact resume (bitwise on one rank, within 1e-5 from 2
ranks to 1), the export without the NSP head, and a refused resume when the masking or the objective changes."""
import json
import re

import h5py
import numpy as np
import pytest
import torch

from tests.fixtures.real_shaped_text import tokenized_sample
from tests.test_pretrain import _free_port, _rank_worker, command, replace, settings
from workflow.cli import run
from workflow.data.encode import EncodeSettings, Vocab, encode_shard, plan_full_sentences
from workflow.data.pack import PackSettings
from workflow.data.tokenize import load_tokenized
from workflow.train.models.bert import BertConfig, load_pretrained
from workflow.train.pretrain import main, pretrain

FULL = dict(masking="dynamic", objective="full_sentences")


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    root = tmp_path_factory.mktemp("objective")
    return root, *tokenized_sample(root, vocab_size=500)


def test_full_sentence_rows_hold_every_token_once_in_order_crossing_at_most_one_document_boundary(sample):
    _, _, tokenized = sample
    ids, sentences, documents = load_tokenized(tokenized)
    settings = EncodeSettings(max_seq_length=128, objective="full_sentences")
    plan = plan_full_sentences(sentences, documents, settings, np.random.default_rng(0))
    a_start, a_end, b_start, b_end, label = plan.T
    assert not label.any()
    assert ((a_end - a_start) + (b_end - b_start) <= 125).all() and (a_end > a_start).all()
    order = np.argsort(a_start)
    pieces = np.stack([a_start, a_end, b_start, b_end], 1)[order]
    # Consecutive in the token stream: A then B (when any) then the next row's A; the whole shard once.
    ends = np.where(pieces[:, 3] > pieces[:, 2], pieces[:, 3], pieces[:, 1])
    assert pieces[0, 0] == 0 and ends[-1] == len(ids) and np.array_equal(pieces[1:, 0], ends[:-1])
    has_b = pieces[:, 3] > pieces[:, 2]
    assert np.array_equal(pieces[has_b, 2], pieces[has_b, 1])
    token_of_document = sentences[documents]
    # A ends at a sentence boundary unless a sentence is longer than a row (it goes on in the next row); a B is
    # whole sentences from a document's start; A stays in one document.
    at_boundary = np.isin(pieces[:, 1], sentences)
    assert at_boundary.mean() > 0.9 and (pieces[~at_boundary, 1] - pieces[~at_boundary, 0] == 125).all()
    assert np.isin(pieces[has_b, 2], token_of_document).all() and np.isin(pieces[has_b, 3], sentences).all()
    document_of = np.searchsorted(token_of_document, pieces[:, :2] - [0, 1], side="right")
    assert (document_of[:, 0] == document_of[:, 1]).all()
    assert has_b.sum() > 20  # 31 of the sample's 41 article ends are crossed


def test_full_sentence_instances_are_one_segment_with_sep_between_documents(sample, tmp_path):
    _, vocab_path, tokenized = sample
    vocab = Vocab.read(vocab_path)
    path = tmp_path / "full.hdf5"
    encode_shard(tokenized, vocab_path, path, EncodeSettings(max_seq_length=128, max_predictions_per_seq=20, **FULL),
                 seed=1, split="training", shard_index=0)
    with h5py.File(path, "r") as handle:
        ids, mask, segments = handle["input_ids"][()], handle["input_mask"][()], handle["segment_ids"][()]
        assert handle.attrs["objective"] == "full_sentences" and handle.attrs["dupe_factor"] == 1  # ignored: 5
        assert not handle["next_sentence_labels"][()].any() and not segments.any()
    n = mask.sum(axis=1)
    assert (ids[:, 0] == vocab.cls).all() and (ids[np.arange(len(ids)), n - 1] == vocab.sep).all()
    separators = ((ids == vocab.sep) & (mask > 0)).sum(axis=1)
    assert set(np.unique(separators)) == {1, 2} and (separators == 2).sum() > 20


def test_dynamic_full_sentences_write_at_most_a_quarter_of_the_default_recipes_bytes(sample, tmp_path):
    _, vocab, tokenized = sample
    sizes = {}
    for name, recipe in (("default", {}), ("full", FULL)):
        path = tmp_path / f"{name}.hdf5"
        encode_shard(tokenized, vocab, path, EncodeSettings(**recipe), seed=1, split="training", shard_index=0,
                     packing=PackSettings())
        sizes[name] = path.stat().st_size
    assert sizes["full"] <= sizes["default"] / 4, sizes


@pytest.fixture(scope="module")
def full_sentence_data(sample):
    """A data directory of the sample in the dynamic full-sentences recipe, and one in the default recipe."""
    root, vocab, tokenized = sample
    directories = {}
    for name, recipe in (("full", FULL), ("default", {})):
        directory = root / name / "hdf5"
        for split in ("training", "test"):
            (directory / split).mkdir(parents=True)
            encode_shard(tokenized, vocab, directory / split / "shard_0.hdf5",
                         EncodeSettings(max_seq_length=64, max_predictions_per_seq=10, **recipe), seed=1, split=split,
                         shard_index=0, packing=PackSettings())
        (directory / "vocab.txt").write_bytes(vocab.read_bytes())
        directories[name] = directory.parent
    return directories


def tiny_settings(data, out, dropout=0.1, **overrides):
    config = out.parent / f"{out.name}_tiny_bert_config.json"
    BertConfig(vocab_size=504, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
               max_position_embeddings=64, hidden_dropout_prob=dropout,
               attention_probs_dropout_prob=dropout).to_json(config)
    values = dict(total_steps=8, global_batch_size=16, micro_batch_size=8, checkpoint_every=100, log_every=1,
                  eval_max_sequences=32, bert_config=str(config), deterministic=True)
    return settings(data, out, **{**values, **overrides})


def test_full_sentences_train_without_nsp_resume_exactly_and_export_a_masked_lm(full_sentence_data, tmp_path):
    data = full_sentence_data["full"]
    straight = tiny_settings(data, tmp_path / "straight")
    summary = pretrain(straight)
    assert (summary["masking"], summary["objective"], summary["next_sentence_prediction"]) == (
        "dynamic", "full_sentences", False)
    metrics = [json.loads(line) for line in open(straight.out_metrics)]
    # No NSP figure where the objective has none (not 0, not the untrained head's guesses); the loss is MLM's alone.
    assert all(not {"nsp_loss", "nsp_accuracy"} & set(m) and m["loss"] == m["mlm_loss"] for m in metrics)
    assert metrics[-1]["mlm_loss"] < metrics[0]["mlm_loss"]
    assert not {"test_nsp_accuracy", "test_nsp_loss"} & set(summary) and summary["test_sequences"] == 32
    stopped = tiny_settings(data, tmp_path / "stopped", max_steps=3)
    pretrain(stopped)
    resumed_summary = pretrain(replace(stopped, max_steps=None))
    # The held-out set's masks are fixed: the same weights score the same.
    assert resumed_summary["test_mlm_accuracy"] == summary["test_mlm_accuracy"] and summary["test_predictions"] > 0
    _, expected = load_pretrained(straight.out_model)
    _, resumed = load_pretrained(stopped.out_model)
    assert expected.keys() == resumed.keys() and all(torch.equal(expected[k], resumed[k]) for k in expected)
    assert not any(k.startswith("cls.seq_relationship") for k in expected)
    config = json.loads((tmp_path / "straight" / "model" / "config.json").read_text())
    assert config["architectures"] == ["BertForMaskedLM"]
    from transformers import BertForMaskedLM

    model, info = BertForMaskedLM.from_pretrained(straight.out_model, output_loading_info=True)
    assert not info["missing_keys"]


def test_a_change_of_masking_or_objective_refuses_to_resume_in_one_line(full_sentence_data, tmp_path, capsys):
    s = tiny_settings(full_sentence_data["default"], tmp_path / "out", max_steps=1)
    pretrain(s)
    other = replace(s, data_dir=str(full_sentence_data["full"] / "hdf5"), max_steps=2)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run(main, command(other)[3:])
    assert exit_info.value.code == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and re.match(
        rf"error: {re.escape(s.run_dir)}: its checkpoints belong to a run with other settings \(encode\.masking "
        r"static -> dynamic; encode\.objective nsp -> full_sentences; ", error[0]), error


def test_a_dynamic_run_checkpointed_on_2_ranks_continues_on_1_like_an_uninterrupted_run(full_sentence_data, tmp_path):
    data = full_sentence_data["full"]
    common = dict(deterministic=False, dropout=0.0)  # dropout masks depend on the rank layout
    straight = tiny_settings(data, tmp_path / "straight", micro_batch_size=4, **common)
    pretrain(straight)
    elastic = tmp_path / "elastic"
    torch.multiprocessing.spawn(_rank_worker, nprocs=2, args=(2, _free_port(), tiny_settings(
        data, elastic, micro_batch_size=4, max_steps=3, **common)))
    pretrain(tiny_settings(data, elastic, micro_batch_size=8, **common))
    _, expected = load_pretrained(straight.out_model)
    _, got = load_pretrained(elastic / "model")
    for name in expected:  # the same masks on 2 ranks as on 1: equal up to fp32 reduction order
        assert torch.allclose(got[name], expected[name], atol=1e-5, rtol=1e-4), name
