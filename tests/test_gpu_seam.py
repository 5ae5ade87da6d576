"""The CUDA-only branches of training (workflow/train/accelerator.py and what calls it), run on CPU against stand-ins
that keep the real APIs (tests/fixtures/gpu_standins.py): apex FusedLAMB through the real engine and across phases,
RNG state restored onto fewer visible GPUs, an empty micro-batch on the unpadded path, no host sync in a packed
forward, and the smaller GPU settings."""
import logging
import os
from pathlib import Path

import h5py
import pytest
import torch
from safetensors.torch import load_file

from tests.fixtures.gpu_standins import FusedLAMB, VisibleDevices, install_apex
from workflow.data.synthetic_shards import write_synthetic_shards
from tests.test_pretrain import bert_config, data, settings  # noqa: F401  (the data fixture)
from workflow.cli import UserError
from workflow.train import accelerator, engine
from workflow.train import checkpoint as ckpt
from workflow.train.models import kit
from workflow.train.distributed import DistEnv
from workflow.train.optim.lamb import Lamb, make_optimizer, param_groups
from workflow.train.models.bert import BertConfig, BertForPreTraining
from workflow.train.models.kit import host_indices
from workflow.train.pretrain import PretrainingTask, check_token_ids, pretrain
from workflow.train.pretraining_data import PretrainingSequences, list_shards


def weights(out: Path) -> dict:
    return load_file(str(out / "model" / "model.safetensors"))


def phase(data, out, **overrides) -> dict:  # noqa: F811
    """A short phase through the real engine (2 micro-batches a step), its summary."""
    values = dict(total_steps=6, log_every=3, checkpoint_every=3, eval_max_sequences=16,
                  out_optimizer=str(out / "optimizer_state.pt"))
    return pretrain(settings(data, out, **{**values, **overrides}))


# ---------------------------------------------------------------- apex FusedLAMB


def test_the_fusedlamb_standin_refuses_what_apex_refuses():
    optimizer = FusedLAMB([torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(TypeError):
        optimizer.zero_grad(set_to_none=True)  # the engine's old call: apex's zero_grad takes no argument
    assert "step" not in optimizer.param_groups[0] and not hasattr(optimizer, "last_grad_norm")


def test_the_engine_trains_with_fusedlamb_to_the_weights_of_the_torch_lamb(data, tmp_path, monkeypatch):  # noqa: F811
    reference = phase(data, tmp_path / "torch", fused=False)
    install_apex(monkeypatch)
    fused = phase(data, tmp_path / "fused")
    assert (reference["optimizer"], fused["optimizer"]) == ("torch.Lamb", "apex.FusedLAMB")
    expected, got = weights(tmp_path / "torch"), weights(tmp_path / "fused")
    assert len(expected) > 10 and all(torch.equal(got[name], expected[name]) for name in expected)
    state = torch.load(tmp_path / "fused" / "optimizer_state.pt", weights_only=True)["state"]
    assert {key for entry in state.values() for key in entry} == {"exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("phase1_fused, phase2_fused", [(True, False), (False, True)])
def test_phase1_moments_carry_into_phase2_across_fusedlamb_and_the_torch_lamb(data, tmp_path, monkeypatch,  # noqa: F811
                                                                              phase1_fused, phase2_fused):
    def phases(name, fused1, fused2):
        (tmp_path / name).mkdir()
        phase(data, tmp_path / name / "phase1", fused=fused1)
        return phase(data, tmp_path / name / "phase2", phase="phase2", fused=fused2, bert_config=None,
                     init_from=str(tmp_path / name / "phase1" / "model"),
                     init_optimizer=str(tmp_path / name / "phase1" / "optimizer_state.pt"))

    install_apex(monkeypatch)
    reference = phases("torch", False, False)
    mixed = phases("mixed", phase1_fused, phase2_fused)
    assert (reference["optimizer"], mixed["optimizer"]) == ("torch.Lamb", "apex.FusedLAMB" if phase2_fused
                                                            else "torch.Lamb")
    expected, got = weights(tmp_path / "torch" / "phase2"), weights(tmp_path / "mixed" / "phase2")
    assert len(expected) > 10 and all(torch.equal(got[name], expected[name]) for name in expected)


def test_apex_without_its_cuda_extensions_falls_back_to_the_torch_lamb_saying_why(monkeypatch, caplog):
    install_apex(monkeypatch, cuda_extensions=False)
    with caplog.at_level(logging.INFO, logger="workflow.train.optim.lamb"):
        optimizer, name = make_optimizer(torch.nn.Linear(2, 2), lr=1e-3)
    assert isinstance(optimizer, Lamb) and name == "torch.Lamb"
    assert "apex FusedLAMB cannot start (apex.optimizers.FusedLAMB requires cuda extensions)" in caplog.text


def test_without_apex_or_off_cuda_the_torch_lamb_is_used_saying_why(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="workflow.train.optim.lamb"):
        assert make_optimizer(torch.nn.Linear(2, 2), lr=1e-3)[1] == "torch.Lamb"
        monkeypatch.setattr(accelerator, "FUSED_LAMB_DEVICE_TYPES", ("cuda", "cpu"))
        monkeypatch.setitem(__import__("sys").modules, "apex", None)  # import apex raises ImportError
        assert make_optimizer(torch.nn.Linear(2, 2), lr=1e-3)[1] == "torch.Lamb"
    assert "runs on CUDA only (the model is on cpu)" in caplog.text and "apex is not importable" in caplog.text


# ---------------------------------------------------------------- the engine's optimizer step


@pytest.mark.parametrize("fused_adamw", [False, True])  # torch's fused AdamW skips an overflow step itself
def test_fp16_gives_this_steps_gradient_norm_and_whether_the_scaler_stepped(fused_adamw):
    layer = torch.nn.Linear(3, 1)
    optimizer = (torch.optim.AdamW(layer.parameters(), lr=1e-2, fused=True) if fused_adamw
                 else Lamb(param_groups(layer), lr=1e-2))
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(layer(torch.ones(1, 3)).sum()).backward()
    first, stepped = engine._optimizer_step(layer, optimizer, scaler, None)
    assert first == pytest.approx(2.0) and stepped  # d/dw = (1, 1, 1), d/db = 1, unscaled
    scaler.scale(layer(torch.ones(1, 3)).sum() * float("inf")).backward()  # an overflow: the scaler skips this step
    before = [p.detach().clone() for p in layer.parameters()]
    skipped, stepped = engine._optimizer_step(layer, optimizer, scaler, None)
    assert not torch.isfinite(skipped) and all(torch.equal(p, b) for p, b in zip(layer.parameters(), before))
    assert not stepped  # the engine then leaves the learning-rate schedule where it is


@pytest.mark.parametrize("keep_grads", [False, True])
def test_gradients_are_zeroed_in_place_under_ddp_and_dropped_otherwise_with_either_optimizer(monkeypatch, keep_grads):
    cls = install_apex(monkeypatch)
    for optimizer_of in (lambda layer: Lamb(param_groups(layer), lr=1e-2), lambda layer: cls(param_groups(layer))):
        layer = torch.nn.Linear(3, 1)
        optimizer = optimizer_of(layer)
        layer(torch.ones(1, 3)).sum().backward()
        views = [p.grad for p in layer.parameters()]
        norm, stepped = engine._optimizer_step(layer, optimizer, None, None, keep_grads=keep_grads)
        assert norm == pytest.approx(2.0) and stepped
        if keep_grads:  # the same tensors (DDP's bucket views), zeroed
            assert all(p.grad is view and not view.any() for p, view in zip(layer.parameters(), views))
        else:
            assert all(p.grad is None for p in layer.parameters())


# ---------------------------------------------------------------- RNG state on fewer visible GPUs


@pytest.mark.parametrize("visible_now, device_now", [(8, 5), (4, 1), (1, 0)])
def test_rng_state_saved_with_8_visible_gpus_restores_exactly_with_4_or_1(monkeypatch, tmp_path, visible_now,
                                                                          device_now):
    saving = VisibleDevices(8, current=5)
    monkeypatch.setattr(accelerator, "cuda", saving)
    states = [ckpt.rng_state(torch.device("cuda", 5))]  # rank 0 of the run trained on cuda:5 of 8
    ckpt.save_checkpoint(tmp_path, 1, {"rng": states}, keep=1)
    mine = saving.get_rng_state(5).clone()
    # What the old code saved (every visible device's state) cannot go back onto fewer devices:
    with pytest.raises(IndexError):
        VisibleDevices(4).set_rng_state_all(saving.get_rng_state_all())

    restoring = VisibleDevices(visible_now, current=device_now)
    monkeypatch.setattr(accelerator, "cuda", restoring)
    loaded = ckpt.load_checkpoint(tmp_path / "step_00000001.pt")["rng"]
    env = DistEnv(rank=0, world_size=1, local_rank=device_now, device=torch.device("cuda", device_now), backend=None)
    engine._restore_rng(loaded, env, seed=1, step=1)
    assert torch.equal(restoring.get_rng_state(device_now), mine)
    assert torch.equal(ckpt.rng_state(env.device)["cuda"], mine)


# ---------------------------------------------------------------- the unpadded path: empty micro-batches, host syncs


@pytest.fixture
def varlen_on_cpu(monkeypatch):
    """Packed rows take the unpadded (CUDA) path on CPU too."""
    monkeypatch.setattr(kit, "VARLEN_DEVICE_TYPES", ("cuda", "cpu"))


def tiny_model(tmp_path):
    torch.manual_seed(0)
    return BertForPreTraining(BertConfig.from_json(bert_config(tmp_path / "config.json", dropout=0.0)))


def step_gradients(model, task, batches) -> dict:
    """The gradients of one step made of `batches` (the loss normalised by their global counts, as the engine does)."""
    model.zero_grad()
    counts = [task.count(b) for b in batches]
    totals = {key: sum(c[key] for c in counts).float() for key in counts[0]}
    sum(task.loss(model, batch, totals)["loss"] for batch in batches).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_a_rank_given_no_rows_trains_on_the_unpadded_path_with_the_steps_gradient(tmp_path, monkeypatch):
    write_synthetic_shards(tmp_path, n_training_shards=1, sequences_per_shard=24, seed=4, short_seq_prob=0.7,
                           max_sequences_per_pack=3)
    model = tiny_model(tmp_path)
    task = PretrainingTask(PretrainingSequences(list_shards(tmp_path, "training"), seed=3, chunk_rows=8), 32)
    start, count, world = 0, 3, 4  # 3 sequences, at most 3 rows, over 4 ranks: one rank has none
    reference = step_gradients(model, task, [task.read(start, count)])  # one batch, on rows (the CPU path)
    monkeypatch.setattr(kit, "VARLEN_DEVICE_TYPES", ("cuda", "cpu"))
    split = [task.micro_batches(start, count, rank, world, 2) for rank in range(world)]
    empty = [mine for mine in split if all(not (b["attention_mask"] > 0).any() for b in mine)]
    # Their rows run as they are: each row's padding a sequence of its own (static shapes: nothing is left out).
    assert empty and all(b["cu_seqlens"].tolist()[:3] == [0, 32, 64] for mine in empty for b in mine)
    got = step_gradients(model, task, [b for mine in split for b in mine])
    assert got.keys() == reference.keys()  # every parameter has a gradient: DDP's all-reduce needs each of them
    for name in got:
        assert torch.allclose(got[name], reference[name], atol=1e-6, rtol=1e-4), name


def test_an_all_padding_micro_batch_alone_trains_on_the_unpadded_path_with_zero_gradients(tmp_path, varlen_on_cpu):
    model = tiny_model(tmp_path)
    zeros = torch.zeros(2, 32, dtype=torch.long)
    batch = host_indices({"input_ids": zeros, "token_type_ids": zeros, "attention_mask": zeros, "position_ids": zeros,
                          "cls_positions": torch.zeros(2, 3, dtype=torch.long),
                          "masked_lm_positions": torch.zeros(2, 5, dtype=torch.long),
                          "masked_lm_labels": torch.full((2, 5), -1), "next_sentence_labels": torch.full((2, 3), -1)})
    grads = step_gradients(model, PretrainingTask(None, 32), [batch])
    assert grads and all(not g.any() for g in grads.values())


class HostSyncs(accelerator.DeviceReads):
    """Counts the calls that make CUDA wait for the device: a value read back, or a shape that depends on values."""

    SHAPES = {torch.Tensor.nonzero, torch.nonzero, torch.argwhere, torch.Tensor.argwhere, torch.masked_select,
              torch.Tensor.masked_select, torch.unique, torch.Tensor.unique, torch.unique_consecutive}

    def counted(self, func, args, kwargs) -> bool:
        boolean_index = func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (
                args[1] if isinstance(args[1], tuple) else (args[1],)))
        return (super().counted(func, args, kwargs) or func in self.SHAPES or boolean_index
                or (func is torch.repeat_interleave and "output_size" not in kwargs))


@pytest.mark.parametrize("packed", [True, False])
def test_no_host_sync_remains_in_the_forward_of_a_training_micro_batch(tmp_path, varlen_on_cpu, packed):
    write_synthetic_shards(tmp_path, n_training_shards=1, sequences_per_shard=24, seed=4, short_seq_prob=0.7,
                           max_sequences_per_pack=3 if packed else None)
    model = tiny_model(tmp_path)
    task = PretrainingTask(PretrainingSequences(list_shards(tmp_path, "training"), seed=3, chunk_rows=8), 32)
    batch = task.micro_batches(0, 12, 0, 1, 8)[0]  # as the loader hands it over: host_indices applied
    plain = {key: batch[key] for key in ("input_ids", "token_type_ids", "attention_mask", "masked_lm_positions",
                                         "masked_lm_labels", "next_sentence_labels", "position_ids",
                                         "cls_positions") if key in batch}
    totals = task.count(batch)
    with HostSyncs() as before:
        old = task.loss(model, plain, totals)["loss"]  # the indices selected in the forward: what the GPU waited on
    with HostSyncs() as now:
        new = task.loss(model, batch, totals)["loss"]
    assert len(before.calls) >= (4 if packed else 2), before.calls  # the counter sees them
    assert now.calls == []
    assert torch.allclose(new, old, rtol=1e-6, atol=0)  # every slot summed (empty ones 0) vs the real ones alone


# ---------------------------------------------------------------- smaller GPU settings


def test_deterministic_runs_set_cublas_workspace_and_the_allocator_grows_segments(monkeypatch):
    for name in ("CUBLAS_WORKSPACE_CONFIG", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    accelerator.configure_process(deterministic=False)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")  # the user's own wins
    try:
        accelerator.configure_process(deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"


def test_a_token_id_beyond_the_models_vocabulary_is_named_with_its_shard_at_start(tmp_path):
    write_synthetic_shards(tmp_path, vocab_size=64, n_training_shards=2, sequences_per_shard=8)
    shards = list_shards(tmp_path, "training")
    vocab = str(tmp_path / "vocab.txt")
    check_token_ids(shards, vocab, 64)
    with pytest.raises(UserError, match=rf"^{shards[0].path}: input_ids holds token id \d+, beyond the model's "
                                        rf"vocab_size 48; encode the data with {vocab} \(or use a model of that "
                                        rf"vocabulary\)$"):
        check_token_ids(shards, vocab, 48)
    for shard in shards:  # encoded with this vocab file: ids below its size by construction, nothing read
        with h5py.File(shard.path, "a") as handle:
            handle.attrs["vocab_sha256"] = ckpt.file_sha256(Path(vocab))
            handle["input_ids"][0, 0] = 10**6
    check_token_ids(shards, vocab, 64)


def test_peak_flops_come_from_the_cards_datasheet_for_its_matmul_math():
    assert accelerator.peak_flops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4e12)
    assert accelerator.peak_flops("NVIDIA H100 PCIe", "bf16") == pytest.approx(756.5e12)
    assert accelerator.peak_flops("NVIDIA A100-SXM4-80GB", "tf32") == pytest.approx(156e12)
    assert accelerator.peak_flops("NVIDIA A100-SXM4-80GB", "fp32") is None  # fp32 there runs as tf32
    assert accelerator.peak_flops("Tesla V100-SXM2-32GB", "fp32") == pytest.approx(15.7e12)  # no TF32 cores
    assert accelerator.peak_flops("Tesla V100-SXM2-32GB", "bf16") is None  # no bf16 tensor cores
    assert accelerator.peak_flops(None, "bf16") is None


@pytest.mark.parametrize("name, bf16", [("NVIDIA H100 NVL", 835.5), ("NVIDIA H200 NVL", 835.5),
                                        ("NVIDIA H200", 989.4), ("NVIDIA A100 80GB PCIe", 312.0),
                                        ("NVIDIA L40S", 362.05), ("NVIDIA L40", 181.05)])
def test_a_cards_peak_is_its_own_parts_not_a_sibling_whose_name_contains_it(name, bf16):
    # "H100 NVL" and "H200 NVL" contain "H100" and "H200": a match by fragment gave them the SXM peak (~18% more).
    assert accelerator.peak_flops(name, "bf16") == pytest.approx(bf16 * 1e12)


@pytest.mark.parametrize("name", ["NVIDIA H100", "NVIDIA H800", "NVIDIA GeForce RTX 4090", "NVIDIA A100-SXM4"])
def test_a_card_not_in_the_table_has_no_peak_and_no_mfu(name):
    assert accelerator.peak_flops(name, "bf16") is None


class Capability:
    """torch.cuda as far as the compute capability goes (an A100 is (8, 0), a V100 (7, 0))."""

    def __init__(self, major: int, minor: int = 0):
        self.capability = (major, minor)

    def get_device_capability(self, device=None) -> tuple[int, int]:
        return self.capability


@pytest.fixture
def tf32_flags():
    """torch's TF32 switches, put back after the test."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("major, precision, math", [(8, "fp32", "tf32"), (9, "fp32", "tf32"), (7, "fp32", "fp32"),
                                                     (8, "bf16", "bf16"), (7, "fp16", "fp16")])
def test_fp32_runs_its_matmuls_in_tf32_where_the_gpu_has_tf32_cores(monkeypatch, tf32_flags, major, precision,
                                                                   math):
    from workflow.train.precision import configure_matmuls

    monkeypatch.setattr(accelerator, "cuda", Capability(major))
    assert configure_matmuls(precision, torch.device("cuda", 0)) == math
    assert torch.backends.cuda.matmul.allow_tf32 == torch.backends.cudnn.allow_tf32 == (math == "tf32")
    assert configure_matmuls("fp32", torch.device("cpu")) == "fp32"  # no GPU: nothing to switch


def test_the_runs_log_says_its_fp32_matmuls_run_in_tf32(data, tmp_path, monkeypatch, tf32_flags, caplog):  # noqa: F811
    # The CPU stands in for an Ampere GPU: the engine's own call decides and logs (CPU matmuls ignore the switch).
    monkeypatch.setattr(accelerator, "tf32_native", lambda device: True)
    with caplog.at_level(logging.INFO, logger="engine"):
        phase(data, tmp_path, total_steps=2, log_every=1, checkpoint_every=2)
    assert "pretrain.phase1: global batch 32 sequences, micro-batches of 16 rows x 1 ranks, fp32 (matmuls in TF32), " \
           "steps 2/2" in caplog.text
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
