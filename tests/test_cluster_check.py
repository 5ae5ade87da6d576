"""cluster_check's own pieces, without a cluster: packed rows read back as the same instances unpacked (the
reference its packed-vs-unpacked loss check relies on), every fast path against its reference (on CPU: apex's
FusedLAMB stand-in, packed rows forced onto the unpadded path), and a disagreement stops it with one error line
naming the key that turns the path off.
(The whole check on 2 nodes: tests/test_slurm.py.)"""
import re
import sys

import numpy as np
import pytest
import torch

from tests.test_pack import encoded, read  # noqa: F401  (the fixture: encoded shards of generated text)
from workflow.cli import UserError
from workflow.data.hdf5 import read_encoded
from workflow.data.pack import pack_shard
from tests.fixtures.gpu_standins import install_apex
from workflow.data.synthetic_shards import write_synthetic_shards
from tests.test_pretrain import config_of, packed_data, settings  # noqa: F401  (the packed_data fixture)
from workflow.slurm.cluster_check import (AGREEMENT, FAST_PATHS, check, disagreement, fast_paths, report,
                                          report_fast_paths, unpacked)
from workflow.train import model as model_module
from workflow.train.distributed import DistEnv
from workflow.train.model import BertConfig
from workflow.train.pretraining_data import PretrainingSequences, list_shards, make_batch


@pytest.mark.parametrize("length", [128, 512])
def test_packed_rows_unpack_to_the_rows_of_the_same_instances(encoded, tmp_path, length):  # noqa: F811
    original, _ = read_encoded(encoded[length])
    pack_shard(encoded[length], tmp_path / "packed.hdf5", 3)
    packed, _ = read(tmp_path / "packed.hdf5")
    batch = make_batch(packed, np.arange(len(packed["input_ids"])))
    got = unpacked(batch)
    instances = batch["instance_index"][batch["next_sentence_labels"] >= 0]
    assert len(instances) == len(original["input_ids"]) > len(packed["input_ids"])
    expected = make_batch(original, instances.numpy())
    # prediction slots: the packed rows' width W may differ from the encoded P; the slots past both are empty
    width = min(got["masked_lm_positions"].shape[1], expected["masked_lm_positions"].shape[1])
    for key, value in expected.items():
        if key.startswith("masked_lm"):
            empty = -1 if key == "masked_lm_labels" else 0
            assert (got[key][:, width:] == empty).all() and (value[:, width:] == empty).all(), key
            got[key], value = got[key][:, :width], value[:, :width]
        assert torch.equal(got[key], value), key


def test_packed_and_unpacked_losses_that_disagree_stop_the_check_naming_the_way_out(capsys):
    rank = {"rank": 0, "host": "node1", "gpu": None, "cuda_visible_devices": "0,1", "device": "cpu", "cores": [0]}
    result = {"ranks": [rank], "world_size": 1, "allreduce_mb": 8, "allreduce_bus_gbps": None, "preset": "tiny",
              "seq_length": 128, "precision": "fp32", "optimizer": "torch.Lamb", "sequences_per_second": 10.0,
              "steps": 4, "checkpoint_bytes": 10**7, "checkpoint_write_s": 0.1,
              "packed_vs_unpacked": [{"packed": True, "relative_difference": 3e-3}]}
    with pytest.raises(UserError, match="differ by 3.00e-03 .*encode.packing.enabled: false"):
        report(result)
    assert "relative difference up to 3.00e-03 (must be <= 0.0001)" in capsys.readouterr().err
    report({**result, "packed_vs_unpacked": [{"packed": True, "relative_difference": 2e-6}]})


# ---------------------------------------------------------------- every fast path against its reference, on CPU


@pytest.fixture
def packed_batch(tmp_path):
    write_synthetic_shards(tmp_path / "data", n_training_shards=1, sequences_per_shard=24, seed=4, short_seq_prob=0.7,
                           max_sequences_per_pack=3)
    reader = PretrainingSequences(list_shards(tmp_path / "data", "training"), seed=3)
    try:
        return reader.read(0, 16)
    finally:
        reader.close()


CONFIG = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                    max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)


@pytest.fixture
def gpu_paths_on_cpu(monkeypatch):
    """The paths a GPU rank takes, on CPU: apex's FusedLAMB (the stand-in) and packed rows unpadded."""
    monkeypatch.setattr(model_module, "VARLEN_DEVICE_TYPES", ("cuda", "cpu"))
    return install_apex(monkeypatch)


def test_every_fast_path_agrees_with_its_reference_and_each_rank_says_what_it_uses(packed_batch, tmp_path,
                                                                                  gpu_paths_on_cpu, capsys):
    result = fast_paths(CONFIG, packed_batch, CPU, "bf16", True, tmp_path / "scratch")
    assert (result["optimizer"], result["attention"], result["precision"]) == ("apex.FusedLAMB", "math", "bf16")
    assert set(result["paths"]) == set(FAST_PATHS)
    assert result["paths"]["unpadded attention"] <= 1e-5 and result["paths"]["apex FusedLAMB"] == 0.0
    assert 0 < result["paths"]["precision"] <= 2e-2  # bf16 rounds; its tolerance holds
    assert result["paths"]["checkpoint"] == result["paths"]["rng restore"] == 0.0
    assert result["syncs"] is None  # measured by CUDA's sync debug mode only
    assert disagreement([result]) is None
    report_fast_paths([result])
    assert re.match(r"rank   0: optimizer apex.FusedLAMB, attention math, precision bf16; against the references: "
                    r"unpadded attention \S+, precision \S+, apex FusedLAMB 0.0e\+00, checkpoint 0.0e\+00, "
                    r"rng restore 0.0e\+00\n$", capsys.readouterr().err)


def test_a_plain_cpu_rank_checks_only_the_paths_it_takes(packed_batch, tmp_path):
    result = fast_paths(CONFIG, packed_batch, CPU, "fp32", True, tmp_path / "scratch")
    assert (result["optimizer"], result["attention"]) == ("torch.Lamb", "rows (SDPA with a mask)")
    assert set(result["paths"]) == {"unpadded attention", "checkpoint", "rng restore"}


def test_a_fusedlamb_that_disagrees_with_the_torch_lamb_stops_the_check_naming_the_key(packed_batch, tmp_path,
                                                                                      gpu_paths_on_cpu, monkeypatch):
    class Off(gpu_paths_on_cpu):
        def step(self, closure=None):  # eps 1000x too large, as a miscompiled kernel might
            for group in self.param_groups:
                group["eps"] = 1e-3
            return super().step(closure)

    monkeypatch.setattr(sys.modules["apex.optimizers"], "FusedLAMB", Off)
    error = disagreement([fast_paths(CONFIG, packed_batch, CPU, "fp32", True, tmp_path / "scratch")])
    assert re.match(r"rank 0: apex FusedLAMB differs from one torch LAMB step from the same gradients \(relative to "
                    r"the update\) by \S+ \(relative; at most 0.001\) on this cluster; set pretrain.lamb.fused: false "
                    r"until it is fixed$", str(error))


def test_unpadded_attention_that_disagrees_with_the_masked_rows_stops_the_check_naming_the_key(
        packed_batch, tmp_path, gpu_paths_on_cpu, monkeypatch):
    attention = model_module.VarlenAttention.__call__
    monkeypatch.setattr(model_module.VarlenAttention, "__call__", lambda *a: attention(*a).flip(0))  # tokens swapped
    error = disagreement([fast_paths(CONFIG, packed_batch, CPU, "fp32", True, tmp_path / "scratch")])
    assert re.match(r"rank 0: unpadded attention differs from the same packed rows with a block-diagonal mask \(fp32 "
                    r"logits\) by \S+ \(relative; at most 0.0001\) on this cluster; set encode.packing.enabled: false "
                    r"until it is fixed$", str(error))


def test_a_checkpoint_that_does_not_round_trip_names_no_key_but_what_is_at_stake():
    error = disagreement([{"rank": 3, "paths": {"checkpoint": float("inf")}}])
    assert str(error) == ("rank 3: checkpoint differs from the weights and optimizer state saved by inf (relative; at "
                          "most 0) on this cluster; training cannot resume exactly here; check the device and the run "
                          "directory's filesystem")


def test_the_whole_check_runs_on_one_cpu_process_with_its_fast_paths_in_the_result(packed_data, tmp_path,  # noqa: F811
                                                                                    capsys):
    s = settings(packed_data, tmp_path / "out", eval_max_sequences=16, micro_batch_size=4)
    result = check(config_of(s), s.data_dir, s.vocab, tmp_path / "scratch", steps=2, allreduce_mb=1, threads=1)
    assert [(r["rank"], r["optimizer"], r["precision"]) for r in result["fast_paths"]] == [(0, "torch.Lamb", "fp32")]
    assert set(result["fast_paths"][0]["paths"]) == {"unpadded attention", "checkpoint", "rng restore"}
    assert result["steps"] == 2 and result["packed_vs_unpacked"][0]["relative_difference"] <= AGREEMENT
    assert re.search(r"^rank   0: optimizer torch.Lamb, attention rows \(SDPA with a mask\), precision fp32; ",
                     capsys.readouterr().err, re.M)
    assert not (tmp_path / "scratch").exists()
