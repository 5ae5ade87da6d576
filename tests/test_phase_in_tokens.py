"""A phase given in row tokens (global_batch_tokens, total_tokens: rows x max_seq_length, ModernBERT's count) becomes
sequences and steps by the data's rows a sequence, read from manifest.json or, without one, the shards alike; and
such a phase trains on packed rows of as many sequences as fit."""

import pytest

from tests.test_full_rows import recipe_settings, short_documents
from tests.test_pretrain import config_of, replace, settings
from workflow.data.encode import encode_shard
from workflow.data.hdf5_dir import build_hdf5_dir
from workflow.data.pack import AUTO, PackSettings
from workflow.data.synthetic_shards import write_synthetic_shards
from workflow.train.pretrain import TrainSettings, phase_in_sequences, pretrain
from workflow.train.pretraining_data import list_shards, row_tokens_per_sequence


def test_row_tokens_per_sequence_from_the_manifest_equal_those_from_the_shards(tmp_path):
    vocab, tokenized = short_documents(tmp_path, 600, 20)
    for split, index in (("training", 0), ("training", 1), ("test", 0)):
        (tmp_path / "encoded" / split).mkdir(parents=True, exist_ok=True)
        encode_shard(tokenized, vocab, tmp_path / "encoded" / split / f"shard_{index}.hdf5", recipe_settings(128),
                     5, split, index, "none", PackSettings(AUTO))
    manifest = build_hdf5_dir(tmp_path / "encoded", {"training": 2, "test": 1}, tmp_path / "hdf5")
    rows = sum(shard["n_rows"] for shard in manifest["shards"] if shard["path"].startswith("training/"))
    from_manifest = row_tokens_per_sequence(tmp_path / "hdf5")
    assert from_manifest == 128 * rows / manifest["n_instances"]["training"] < 128 / 4  # rows of ~5 documents
    (tmp_path / "hdf5" / "manifest.json").unlink()
    assert row_tokens_per_sequence(tmp_path / "hdf5") == from_manifest


def test_a_phase_in_row_tokens_trains_its_steps_of_sequences_on_rows_of_as_many_as_fit(tmp_path):
    data = tmp_path / "data"
    write_synthetic_shards(data, seq_length=32, n_training_shards=1, sequences_per_shard=200, seed=4,
                           max_sequences_per_pack=AUTO, short_seq_prob=1.0)
    shards = list_shards(data, "training")
    per_sequence = 32 * shards[0].rows / shards[0].n
    s = settings(tmp_path, tmp_path / "p1", data_dir=str(data), vocab=str(data / "vocab.txt"), max_steps=None)
    config = config_of(s)
    config["pretrain"]["phase1"].update(global_batch_size=None, global_batch_tokens=16 * 32, total_steps=None,
                                        total_tokens=5 * 16 * 32)
    paths = {key: getattr(s, key) for key in ("data_dir", "vocab", "run_dir", "out_model", "out_metrics",
                                               "out_summary")}
    converted = TrainSettings.from_config(config, "phase1", **paths)
    assert converted.phase.global_batch_size == round(16 * 32 / per_sequence) > 16  # rows of 32 hold several
    assert converted.phase.total_steps == 5
    summary = pretrain(replace(s, global_batch_size=converted.phase.global_batch_size,
                               total_steps=converted.phase.total_steps, eval_max_sequences=16))
    assert summary["steps"] == 5 and summary["global_batch_size"] == converted.phase.global_batch_size


@pytest.mark.parametrize("tokens", [1, 10**12])
def test_any_token_count_gives_at_least_one_sequence_and_one_step(tmp_path, tokens):
    data = tmp_path / "data"
    write_synthetic_shards(data, seq_length=32, n_training_shards=1, sequences_per_shard=20, seed=4)
    s = settings(tmp_path, tmp_path / "p1", data_dir=str(data))
    phase = {**config_of(s)["pretrain"]["phase1"], "global_batch_size": None, "global_batch_tokens": tokens,
             "total_steps": None, "total_tokens": tokens}
    converted = phase_in_sequences(phase, "pretrain.phase1", str(data))
    assert converted["global_batch_size"] == max(1, round(tokens / 32)) and converted["total_steps"] >= 1
