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
from tests.conftest import REPO
from tests.fixtures.gpu_standins import install_apex
from workflow.data.synthetic_shards import write_synthetic_shards
from tests.test_pretrain import config_of, packed_data, settings  # noqa: F401  (the packed_data fixture)
from workflow.slurm.cluster_check import (AGREEMENT, FAST_PATHS, check, disagreement, fast_paths, report,
                                          report_fast_paths, unpacked)
from workflow.train.models import kit
from workflow.train.models.kit import flash_varlen as FLASH_VARLEN
from workflow.train.distributed import DistEnv
from workflow.train.models.bert import BertConfig
from workflow.train.models.family import family
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
BERT = family("bert")
CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)


@pytest.fixture
def gpu_paths_on_cpu(monkeypatch):
    """The paths a GPU rank takes, on CPU: apex's FusedLAMB (the stand-in) and packed rows unpadded."""
    monkeypatch.setattr(kit, "VARLEN_DEVICE_TYPES", ("cuda", "cpu"))
    return install_apex(monkeypatch)


def test_every_fast_path_agrees_with_its_reference_and_each_rank_says_what_it_uses(packed_batch, tmp_path,
                                                                                  gpu_paths_on_cpu, capsys):
    result = fast_paths(CONFIG, packed_batch, CPU, "bf16", True, tmp_path / "scratch", BERT)
    assert (result["optimizer"], result["attention"], result["precision"]) == ("apex.FusedLAMB", "math", "bf16")
    # BERT's 16-bit kernel (CONFIG has no dropout to check); not ModernBERT's, the other optimizers' or the paths the
    # config turns on (below)
    assert set(result["paths"]) == {"flash_varlen", "unpadded attention", "precision", "apex FusedLAMB", "checkpoint",
                                     "rng restore"}
    assert result["paths"]["unpadded attention"] <= 1e-5 and result["paths"]["apex FusedLAMB"] == 0.0
    assert 0 < result["paths"]["precision"] <= 2e-2  # bf16 rounds; its tolerance holds
    assert result["paths"]["checkpoint"] == result["paths"]["rng restore"] == 0.0
    assert result["syncs"] is None  # measured by CUDA's sync debug mode only
    assert disagreement([result]) is None
    report_fast_paths([result])
    assert re.match(r"rank   0: optimizer apex.FusedLAMB, attention math, precision bf16; against the references: "
                    r"flash_varlen \S+, unpadded attention \S+, precision \S+, apex FusedLAMB 0.0e\+00, "
                    r"checkpoint 0.0e\+00, rng restore 0.0e\+00\n$", capsys.readouterr().err)


def test_a_plain_cpu_rank_checks_only_the_paths_it_takes(packed_batch, tmp_path):
    result = fast_paths(CONFIG, packed_batch, CPU, "fp32", True, tmp_path / "scratch", BERT)
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
    error = disagreement([fast_paths(CONFIG, packed_batch, CPU, "fp32", True, tmp_path / "scratch", BERT)])
    assert re.match(r"rank 0: apex FusedLAMB differs from one torch LAMB step from the same gradients \(relative to "
                    r"the update\) by \S+ \(relative; at most 0.001\) on this cluster; set pretrain.lamb.fused: false "
                    r"until it is fixed$", str(error))


def test_the_configured_optimizers_fused_step_is_checked_against_its_unfused_one(packed_batch, tmp_path, monkeypatch):
    """StableAdamW's fused path (Triton on a GPU, foreach on CPU) against torch-optimi's for-loop step on the same
    gradients; one that disagrees stops the check naming pretrain.stable_adamw.fused."""
    import optimi

    result = fast_paths(CONFIG, packed_batch, CPU, "fp32", True, tmp_path / "scratch", BERT, optimizer_kind="stable_adamw")
    assert result["optimizer"] == "optimi.StableAdamW (foreach, decouple_lr)"
    assert 0 <= result["paths"]["fused StableAdamW"] <= 1e-5 and disagreement([result]) is None
    assert "fused StableAdamW" not in fast_paths(CONFIG, packed_batch, CPU, "fp32", False, tmp_path / "s2", BERT,
                                                 optimizer_kind="stable_adamw")["paths"]  # nothing fused to check
    step = optimi.StableAdamW.step

    def off(self, closure=None):  # the foreach path's eps 1000x too large, as a miscompiled kernel might
        for group in self.param_groups:
            group["eps"] = 1e-3 if group.get("foreach") else group["eps"]
        return step(self, closure)

    monkeypatch.setattr(optimi.StableAdamW, "step", off)
    error = disagreement([fast_paths(CONFIG, packed_batch, CPU, "fp32", True, tmp_path / "s3", BERT,
                                     optimizer_kind="stable_adamw")])
    assert re.match(r"rank 0: fused StableAdamW differs from one for-loop StableAdamW step of torch-optimi from the "
                    r"same gradients \(relative to the update\) by \S+ \(relative; at most 0.001\) on this cluster; "
                    r"set pretrain.stable_adamw.fused: false until it is fixed$", str(error))


def test_unpadded_attention_that_disagrees_with_the_masked_rows_stops_the_check_naming_the_key(
        packed_batch, tmp_path, gpu_paths_on_cpu, monkeypatch):
    attention = kit.VarlenAttention.__call__
    monkeypatch.setattr(kit.VarlenAttention, "__call__", lambda *a: attention(*a).flip(0))  # tokens swapped
    error = disagreement([fast_paths(CONFIG, packed_batch, CPU, "fp32", True, tmp_path / "scratch", BERT)])
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
    # Step 1 has no log line or checkpoint: nothing waits for the device; step 2 reads its log window once.
    assert result["host_syncs"] == {"between_steps": 1, "between_per_step": 0.0, "boundary_steps": 1,
                                    "boundary_per_step": 1.0}
    assert (result["matmul_math"], result["mfu"]) == ("fp32", None)  # no datasheet peak for a CPU
    report(result)
    assert ("MFU unknown (no datasheet peak for this device; matmuls in fp32); host syncs per optimizer step: 0 "
            "between log lines and checkpoints (1 step), 1 at them (1 step)") in capsys.readouterr().err.splitlines()


def test_mfu_is_measured_against_the_peak_of_the_math_the_matmuls_ran_in(monkeypatch):
    from workflow.slurm.cluster_check import utilization
    from workflow.train import accelerator

    monkeypatch.setattr(accelerator, "device_name", lambda device: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(accelerator, "tf32_native", lambda device: True)
    env = DistEnv(rank=0, world_size=2, local_rank=0, device=torch.device("cuda", 0), backend="nccl")
    summary = {"precision": "fp32", "seq_per_s": 200.0, "train_flops_per_sequence": 78e9}
    assert utilization(summary, env) == {"matmul_math": "tf32", "peak_tflops": 156.0,
                                         "mfu": pytest.approx(100 * 78e9 / 156e12)}
    bf16 = utilization({**summary, "precision": "bf16"}, env)
    assert (bf16["matmul_math"], bf16["peak_tflops"]) == ("bf16", 312.0)


def test_with_synthetic_data_the_check_runs_before_the_data_half_on_data_of_the_configured_layout(workflow_copy):
    # `cluster_check.data: synthetic`: no download, extract or encode of the corpus; the check trains on random ids
    # encoded by the encode stage's code in the layout the config's encode section asks, and reruns them only for
    # a change of that layout.
    import json
    import subprocess

    from tests.conftest import snakemake_env

    (workflow_copy / "check.yaml").write_text("cluster_check: {data: synthetic}\n")
    (workflow_copy / "cadence.yaml").write_text("pretrain: {log_every: 7}\n")
    (workflow_copy / "masking.yaml").write_text("encode: {masked_lm_prob: 0.3}\n")

    def snakemake(*extra, configfiles=()):
        return subprocess.run(["snakemake", "--cores", "2", "cluster_check", *extra, "--configfile",
                               "sample/config.yaml", "check.yaml", *configfiles], cwd=workflow_copy,
                              env=snakemake_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)

    ran = snakemake()
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert sorted(re.findall(r"Finished jobid: \d+ \(Rule: (\w+)\)", ran.stderr)) == [
        "cluster_check", "cluster_check_synthetic_data"]
    assert sorted(p.name for p in (workflow_copy / "data").iterdir()) == ["cluster_check_synthetic"]
    result = json.loads((workflow_copy / "results" / "cluster_check.json").read_text())
    assert result["steps"] == 20 and result["seq_length"] == 128 and result["preset"] == "tiny"
    assert result["packed_vs_unpacked"][0]["packed"]
    assert result["packed_vs_unpacked"][0]["relative_difference"] <= AGREEMENT
    manifest = json.loads((workflow_copy / "data" / "cluster_check_synthetic" / "hdf5" / "manifest.json").read_text())
    assert manifest["format"] == "packed" and manifest["n_instances"]["training"] >= 40_000
    settings_ = manifest["settings"]
    assert {k: settings_[k] for k in ("max_seq_length", "max_predictions_per_seq", "dupe_factor", "packing",
                                      "max_sequences_per_pack")} == {
        "max_seq_length": 128, "max_predictions_per_seq": 20, "dupe_factor": 5, "packing": "gapfill",
        "max_sequences_per_pack": 3}
    vocab = (workflow_copy / "data" / "cluster_check_synthetic" / "vocab.txt").read_text().splitlines()
    assert len(vocab) == 2000 and vocab[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    # A training key does not touch the synthetic data; an encode key makes other data.
    assert "Nothing to be done" in snakemake("-n", configfiles=["cadence.yaml"]).stdout
    planned = snakemake("-n", configfiles=["masking.yaml"]).stdout
    assert "cluster_check_synthetic_data" in planned, planned[-2000:]


@pytest.mark.parametrize("layout", [dict(masking="dynamic", objective="full_sentences", packing=False),
                                    dict(masking="static", objective="nsp", packing=True)])
def test_synthetic_check_data_take_the_encode_sections_layout_and_a_given_vocab_file(tmp_path, layout):
    import yaml

    from workflow.data.synthetic_shards import write_check_data

    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config["encode"].update(masking=layout["masking"], objective=layout["objective"], whole_word_masking=True)
    config["encode"]["packing"]["enabled"] = layout["packing"]
    given = tmp_path / "given_vocab.txt"
    given.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"t{i}" for i in range(300)),
                                *(f"##s{i}" for i in range(100))]) + "\n")
    config["vocab"]["file"] = str(given)
    manifest = write_check_data(config, tmp_path / "hdf5", tmp_path / "vocab.txt", training_instances=2000,
                                test_instances=500)
    assert (tmp_path / "vocab.txt").read_bytes() == given.read_bytes()
    assert manifest["format"] == ("packed" if layout["packing"] else "unpacked")
    expected = {"masking": "dynamic", "objective": "full_sentences"} if layout["masking"] == "dynamic" else {}
    assert {k: manifest["settings"].get(k) for k in ("masking", "objective")} == {
        "masking": expected.get("masking"), "objective": expected.get("objective")}
    assert manifest["settings"]["whole_word_masking"] is True
    shards = list_shards(tmp_path / "hdf5", "training")
    assert len(shards) == 4 and {s.dynamic for s in shards} == {layout["masking"] == "dynamic"}
    batch = PretrainingSequences(shards, seed=1).read(0, 8)
    assert int(batch["input_ids"].max()) < 405


def test_synthetic_check_data_name_a_vocab_they_cannot_make_or_read(tmp_path):
    import yaml

    from workflow.data.synthetic_shards import write_check_data

    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config["vocab"]["size"] = 6
    with pytest.raises(UserError, match=r"^vocab.size 6: must exceed the 5 special tokens by at least 3$"):
        write_check_data(config, tmp_path / "hdf5", tmp_path / "vocab.txt")
    config["vocab"]["file"] = str(tmp_path / "missing.txt")
    with pytest.raises(UserError, match=r"^\S+/missing.txt: vocab file not found$"):
        write_check_data(config, tmp_path / "hdf5", tmp_path / "vocab.txt")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing half-written


def test_a_modernbert_rank_checks_its_16_bit_unpadded_attention_against_dense_masks(packed_batch, tmp_path,
                                                                                    monkeypatch):
    """ModernBERT unpads every batch on a GPU in 16-bit (flash kernels): on CPU through the varlen op's reference, its
    path is held against the dense-mask rows in the same precision, and a wrong window stops the check."""
    from workflow.train.models.flash_varlen import flash_varlen
    from workflow.train.models import modernbert
    from workflow.train.models.family import family
    from workflow.train.models.modernbert import ModernBertConfig

    monkeypatch.setattr(kit, "VARLEN_DEVICE_TYPES", ("cuda", "cpu"))
    config = ModernBertConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                              num_attention_heads=2, local_attention=8, max_position_embeddings=64, pad_token_id=0,
                              cls_token_id=2, sep_token_id=3, bos_token_id=2, eos_token_id=3)
    result = fast_paths(config, packed_batch, CPU, "bf16", True, tmp_path / "scratch", family("modernbert"))
    assert set(result["paths"]) == {"unpadded attention (16-bit)", "precision", "checkpoint", "rng restore"}
    assert 0 < result["paths"]["unpadded attention (16-bit)"] <= FAST_PATHS["unpadded attention (16-bit)"][1]
    assert disagreement([result]) is None
    assert set(fast_paths(config, packed_batch, CPU, "fp32", True, tmp_path / "s2", family("modernbert"))["paths"]) \
        == {"checkpoint", "rng restore"}  # fp32 runs rows: nothing unpadded to check

    def no_window(q, k, v, offsets, max_seqlen, dropout_p=0.0, window=None):
        return flash_varlen(q, k, v, offsets, max_seqlen, dropout_p)

    monkeypatch.setattr(modernbert, "flash_varlen", no_window)
    error = disagreement([fast_paths(config, packed_batch, CPU, "bf16", True, tmp_path / "s3", family("modernbert"))])
    assert str(error).startswith("rank 0: unpadded attention (16-bit) differs from the same rows with dense masks")
    assert "set pretrain.precision: fp32 until it is fixed" in str(error)


def test_modernberts_per_layer_probe_runs_through_the_flash_varlen_custom_op_with_each_layer_types_window(
        packed_batch):
    from torch.utils._python_dispatch import TorchDispatchMode

    from workflow.slurm.cluster_check import windowed_attention_difference
    from workflow.train.models.family import family
    from workflow.train.models.modernbert import ModernBertConfig

    config = ModernBertConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                              num_attention_heads=2, local_attention=8, max_position_embeddings=64, pad_token_id=0,
                              cls_token_id=2, sep_token_id=3, bos_token_id=2, eos_token_id=3)
    model = family("modernbert").pretraining_model(config).eval()
    windows = []

    class CustomOps(TorchDispatchMode):  # the snakebert ops dispatched, with their (window_left, window_right)
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "snakebert":
                windows.append((func.name(), args[6], args[7]))
            return func(*args, **(kwargs or {}))

    with CustomOps():
        difference = windowed_attention_difference(model, family("modernbert").host_indices(packed_batch),
                                                   CPU.device, "bf16")
    assert 0 < difference <= FAST_PATHS["unpadded attention (16-bit)"][1]
    assert windows == [("snakebert::flash_varlen_forward", -1, -1),
                       ("snakebert::flash_varlen_forward", config.sliding_window, config.sliding_window)]


# ---------------------------------------------------------------- each kernel the job runs, and each path it turns on


DROPOUT_CONFIG = BertConfig(**{**CONFIG.__dict__, "attention_probs_dropout_prob": 0.1})


def flash_varlen_paths(result: dict) -> dict:
    return {path: value for path, value in result["paths"].items() if path.startswith("flash_varlen")}


def other_mask(q, k, v, offsets, max_seqlen, dropout_p=0.0):
    """The forward's output, the gradient of another draw: a backward that drops other entries than its forward."""
    drawn = FLASH_VARLEN(q, k, v, offsets, max_seqlen, dropout_p)
    return FLASH_VARLEN(q, k, v, offsets, max_seqlen, dropout_p).detach() + drawn - drawn.detach()


@pytest.mark.parametrize("broken, path", [
    (lambda q, k, v, offsets, max_seqlen, dropout_p=0.0: FLASH_VARLEN(q, k, v, offsets, max_seqlen, dropout_p).flip(0),
     "flash_varlen"),                                                  # tokens swapped
    (other_mask, "flash_varlen dropout mask"),
    (lambda q, k, v, offsets, max_seqlen, dropout_p=0.0: FLASH_VARLEN(q, k, v, offsets, max_seqlen, 0.0),
     "flash_varlen dropout rate"),                                      # dropout ignored
], ids=["output", "dropout mask", "dropout rate"])
def test_berts_flash_varlen_is_checked_against_nested_sdpa_and_its_dropout_and_a_wrong_one_names_the_key(
        packed_batch, tmp_path, monkeypatch, broken, path):
    """16-bit packed BERT trains through flash_varlen (on CPU its exact reference): its outputs and gradients against
    nested SDPA at p = 0, its backward's dropout mask (<dv, v> = <g, out>) and its kept fraction at the model's p."""
    monkeypatch.setattr(kit, "VARLEN_DEVICE_TYPES", ("cuda", "cpu"))
    result = fast_paths(DROPOUT_CONFIG, packed_batch, CPU, "bf16", False, tmp_path / "scratch", BERT)
    checked = flash_varlen_paths(result)
    assert set(checked) == {"flash_varlen", "flash_varlen dropout mask", "flash_varlen dropout rate"}
    assert checked["flash_varlen"] <= 1e-2 and checked["flash_varlen dropout mask"] <= 5e-3  # bf16 rounding
    assert checked["flash_varlen dropout rate"] <= FAST_PATHS["flash_varlen dropout rate"][1]
    assert disagreement([result]) is None
    monkeypatch.setattr(kit, "flash_varlen", broken)
    error = disagreement([fast_paths(DROPOUT_CONFIG, packed_batch, CPU, "bf16", False, tmp_path / "s2", BERT)])
    assert str(error).startswith(f"rank 0: {path} differs from {FAST_PATHS[path][0]} by ")
    assert str(error).endswith("set pretrain.precision: fp32 until it is fixed")
    assert "flash_varlen" not in fast_paths(DROPOUT_CONFIG, packed_batch, CPU, "fp32", False, tmp_path / "s3", BERT)[
        "paths"]  # fp32 trains with nested SDPA: no flash kernel to check


def test_a_compiled_step_is_checked_against_eager_and_a_miscompiled_one_names_pretrain_compile(
        packed_batch, tmp_path, monkeypatch):
    result = fast_paths(CONFIG, packed_batch, CPU, "fp32", False, tmp_path / "scratch", BERT, compile_mode="default")
    assert 0 <= result["paths"]["compiled step"] <= FAST_PATHS["compiled step"][1]["fp32"]
    assert disagreement([result]) is None
    compile_ = torch.compile

    def miscompiling(model, **options):  # a backend whose graphs return 1% too much
        def backend(graph, example_inputs):
            def run(*args):
                return type(out := graph(*args))(
                    o * 1.01 if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in out)
            return run
        return compile_(model, backend=backend, dynamic=False)

    monkeypatch.setattr(torch, "compile", miscompiling)
    torch._dynamo.reset()
    error = disagreement([fast_paths(CONFIG, packed_batch, CPU, "fp32", False, tmp_path / "s2", BERT,
                                     compile_mode="default")])
    assert re.match(r"rank 0: compiled step differs from the eager step's loss and gradients in the same precision by "
                    r"\S+ \(relative; at most 0.001\) on this cluster; set pretrain.compile: false until it is fixed$",
                    str(error))


def test_the_fused_loss_is_checked_on_the_models_own_head_and_a_wrong_one_names_pretrain_fused_loss(
        packed_batch, tmp_path, monkeypatch):
    """Off CUDA the trainer runs the logits path: nothing fused, the check says why. With liger's kernel stood in
    (the reference's arithmetic), it is held against the logits path in loss and gradients."""
    from workflow.train.models import fused_loss

    result = fast_paths(CONFIG, packed_batch, CPU, "bf16", False, tmp_path / "scratch", BERT, fused_mlm_loss=True)
    assert "fused loss" not in result["paths"] and result["skipped"] == {
        "fused loss": fused_loss.fused_mlm_loss_reason(CPU.device)}
    monkeypatch.setattr(fused_loss, "fused_mlm_loss_reason", lambda device: None)
    monkeypatch.setattr(fused_loss, "_liger_summed_loss", fused_loss._reference_summed_loss)
    result = fast_paths(CONFIG, packed_batch, CPU, "bf16", False, tmp_path / "s2", BERT, fused_mlm_loss=True)
    assert result["paths"]["fused loss"] == 0.0 and result["skipped"] == {} and disagreement([result]) is None

    def off(hidden, weight, bias, labels):  # the bias left out, as a kernel given the wrong arguments might
        return fused_loss._reference_summed_loss(hidden, weight, torch.zeros_like(bias) + 1.0, labels)

    monkeypatch.setattr(fused_loss, "_liger_summed_loss", off)
    error = disagreement([fast_paths(CONFIG, packed_batch, CPU, "bf16", False, tmp_path / "s3", BERT, fused_mlm_loss=True)])
    assert str(error).startswith("rank 0: fused loss differs from the logits path's MLM loss and gradients on the "
                                 "model's own head by ")
    assert str(error).endswith("(relative; at most 0.05) on this cluster; set pretrain.fused_loss: false until it "
                               "is fixed")


def test_float8_is_checked_against_the_loss_without_it_where_it_runs_and_skipped_with_its_reason_elsewhere(
        packed_batch, tmp_path, monkeypatch):
    from workflow.slurm import cluster_check
    from workflow.train.float8 import float8_error

    result = fast_paths(CONFIG, packed_batch, CPU, "bf16", False, tmp_path / "scratch", BERT, float8=True)
    assert "float8" not in result["paths"] and result["skipped"] == {"float8": float8_error(CPU.device)}
    monkeypatch.setattr(cluster_check, "float8_error", lambda device: None)
    monkeypatch.setattr(cluster_check, "convert_to_float8", lambda model: model)  # torchao's, as exact as can be
    result = fast_paths(CONFIG, packed_batch, CPU, "bf16", False, tmp_path / "s2", BERT, float8=True)
    assert result["paths"]["float8"] == 0.0 and disagreement([result]) is None

    def overflowing(model):  # every linear's output inf: scales that overflow
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(lambda module, inputs, output: output * float("inf"))
        return model

    monkeypatch.setattr(cluster_check, "convert_to_float8", overflowing)
    error = disagreement([fast_paths(CONFIG, packed_batch, CPU, "bf16", False, tmp_path / "s3", BERT, float8=True)])
    assert re.match(r"rank 0: float8 differs from the same step's loss without float8 by nan \(relative; at most 0.05\) on this "
                    r"cluster; set pretrain.float8: false until it is fixed$", str(error))


def test_the_last_line_lists_every_path_checked_and_each_one_not_checked_with_why(packed_batch, tmp_path,
                                                                                 monkeypatch):
    from workflow.slurm.cluster_check import passed
    from workflow.train.float8 import float8_error

    monkeypatch.setattr(kit, "VARLEN_DEVICE_TYPES", ("cuda", "cpu"))
    fast = fast_paths(DROPOUT_CONFIG, packed_batch, CPU, "bf16", False, tmp_path / "scratch", BERT, float8=True)
    result = {"world_size": 2, "fast_paths": [fast], "steps": 2, "precision": "bf16", "optimizer": "torch.Lamb",
              "packed_vs_unpacked": [{"packed": True}]}
    assert passed(result) == (
        "cluster_check: passed on 2 ranks (flash_varlen, flash_varlen dropout mask, flash_varlen dropout rate, "
        "unpadded attention, precision, checkpoint, rng restore against their references, attention math; float8 not "
        f"checked ({float8_error(CPU.device)}); 2 steps of the trainer in bf16 with torch.Lamb and packed vs unpacked "
        "loss)")


# ---------------------------------------------------------------- its last line, and full fp32 where it compares


def check_argv(s, tmp_path) -> list[str]:
    import json

    return ["--config", json.dumps(config_of(s)), "--data-dir", s.data_dir, "--vocab", s.vocab, "--run-dir",
            str(tmp_path / "scratch"), "--output", str(tmp_path / "check.json"), "--steps", "2", "--allreduce-mb", "1",
            "--threads", "1"]


def test_the_check_ends_with_one_line_saying_it_passed_on_how_many_ranks_and_what(packed_data, tmp_path,  # noqa: F811
                                                                                  capsys):
    from workflow.slurm.cluster_check import main

    s = settings(packed_data, tmp_path / "out", eval_max_sequences=16, micro_batch_size=4)
    main(check_argv(s, tmp_path))
    assert capsys.readouterr().err.splitlines()[-1] == (
        "cluster_check: passed on 1 rank (unpadded attention, checkpoint, rng restore against their references, "
        "attention rows (SDPA with a mask); fused loss not checked (liger-kernel's fused linear cross-entropy runs on "
        "CUDA only (the model is on cpu)); 2 steps of the trainer in fp32 with torch.Lamb and packed vs unpacked "
        "loss)")  # pretrain.fused_loss is on by default: the trainer takes the logits path here, and says why


def test_a_failed_check_ends_with_one_error_line_naming_the_key_that_turns_the_path_off(
        packed_data, tmp_path, gpu_paths_on_cpu, monkeypatch, capsys):  # noqa: F811
    from workflow.cli import run
    from workflow.slurm import cluster_check

    s = settings(packed_data, tmp_path / "out", eval_max_sequences=16, micro_batch_size=4)
    attention = kit.VarlenAttention.__call__
    monkeypatch.setattr(kit.VarlenAttention, "__call__", lambda *a: attention(*a).flip(0))  # tokens swapped
    with pytest.raises(SystemExit):
        run(cluster_check.main, check_argv(s, tmp_path))
    assert re.match(r"error: cluster_check: rank 0: unpadded attention differs from the same packed rows with a "
                    r"block-diagonal mask \(fp32 logits\) by \S+ \(relative; at most 0.0001\) on this cluster; set "
                    r"encode.packing.enabled: false until it is fixed$", capsys.readouterr().err.splitlines()[-1])

    def lost(env, megabytes):  # a collective that crashes: its traceback, then the one line
        raise RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error\nLast error: ...")

    monkeypatch.setattr(cluster_check, "allreduce_bus_gbps", lost)
    with pytest.raises(SystemExit):
        run(cluster_check.main, check_argv(s, tmp_path))
    err = capsys.readouterr().err
    assert "Traceback" in err and err.splitlines()[-1] == (
        "error: cluster_check: RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error (the "
        "traceback above says where)")


def test_fp32_comparisons_run_without_tf32_and_the_settings_before_are_restored(packed_data, tmp_path,  # noqa: F811
                                                                                 monkeypatch):
    """The trainer in fp32 leaves TF32 on (sm80+): 1e-3 rounding against the 1e-4 packed/unpacked agreement. On CPU
    the flags are torch's own; what each comparison ran under is recorded by a stand-in around it."""
    from workflow.slurm import cluster_check

    def flags():
        return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                torch.get_float32_matmul_precision())

    seen = []

    def recording(function):
        def run(*args, **kwargs):
            seen.append((function.__name__, flags()))
            return function(*args, **kwargs)
        return run

    for name in ("fast_paths", "packed_unpacked_losses"):
        monkeypatch.setattr(cluster_check, name, recording(getattr(cluster_check, name)))
    before = flags()
    s = settings(packed_data, tmp_path / "out", eval_max_sequences=16, micro_batch_size=4)
    try:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = True, True  # as the trainer sets them
        torch.set_float32_matmul_precision("high")
        check(config_of(s), s.data_dir, s.vocab, tmp_path / "scratch", steps=2, allreduce_mb=1, threads=1)
        full = (False, False, "highest")
        assert seen == [("fast_paths", full), ("packed_unpacked_losses", full)]
        assert flags() == (True, True, "high")
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[:2]
        torch.set_float32_matmul_precision(before[2])
