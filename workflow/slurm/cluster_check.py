"""A few-minute check of a new cluster with the phase-1 job's own layout and code: `snakemake --profile slurm
cluster_check`, so that the first multi-day job is not the first run of the real code path there.

Every rank reports its host, device (CUDA_VISIBLE_DEVICES, the GPU it trains on and its name) and the cores it may
run on; one NCCL (gloo on CPU) all-reduce of `--allreduce-mb` MB is timed (bus bandwidth, as nccl-tests reports
it: 2(n-1)/n x size / time). Then the real phase-1 trainer (workflow/train/pretrain.py: the configured data and
model, PretrainingTask, LAMB, DDP, its reads, a checkpoint, the evaluation and export) runs `--steps` steps in a
scratch run directory (`--run-dir`, emptied before and after; never a phase's); one checkpoint write of its
model and LAMB state is timed on that filesystem; and the loss of packed rows is compared with the loss of the same
sequences read unpacked (one per row), which must agree: the packed attention path on this device. Rank 0 prints
the table to stderr (the rule's log) and writes it as JSON, with the host syncs per optimizer step it measured in the
trainer's steps (engine.measured_host_syncs: steps between log lines and checkpoints, and the steps at them) and the
MFU against the card's datasheet peak for the math its matmuls ran in (tf32 for fp32 on compute capability >= 8.0).

First, before the trainer, every rank proves each fast path it will train with against its reference on its own
device, on a few sequences of the phase-1 data and the configured model (no dropout; `fast_paths`): apex FusedLAMB
(when it runs here) against the torch LAMB for one step, the unpadded (varlen) attention of packed rows against the
same rows with a block-diagonal mask, BERT's 16-bit flash kernel against nested SDPA in the same precision
(outputs, gradients, and its dropout: the backward's mask the forward's, the kept fraction 1 - p), ModernBERT's
windowed attention per layer type, each path the config turns on (a compiled step against eager, the fused MLM loss
against the logits path, float8 against 16-bit; one that cannot run here is listed as not checked, with why), the
training precision's loss against fp32's, a checkpoint's save -> load (identical weights and optimizer state), the
RNG state's restore, and (on CUDA) a packed forward with no host sync.
Each rank prints which optimizer, attention kernel (the one that trains: workflow/train/models/kernels.py) and
precision it uses; a fast path that disagrees with its reference stops the check with one `error:` line naming the
config key that turns it off (FAST_PATHS). Comparisons in fp32 run in full fp32 (TF32 off, restored after). The
check ends with one line: `cluster_check: passed on N ranks (what was checked)` or `error: cluster_check: what
failed`.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import shutil
import socket
import sys
import time
import traceback
from pathlib import Path

import torch

from workflow.atomic import write_text
from workflow.cli import UserError, config_sections
from workflow.config import PHASES
from workflow.train import accelerator
from workflow.train import checkpoint as ckpt
from workflow.train import distributed
from workflow.train import engine
from workflow.train.float8 import convert_to_float8, float8_error
from workflow.train.models import fused_loss, kernels, kit
from workflow.train.models.flash_varlen import runs_flash_varlen
from workflow.train.optim.optimizers import make_optimizer
from workflow.train.precision import autocast, autocast_dtype, matmul_math, resolve_precision
from workflow.train.models.family import family
from workflow.train.pretrain import PretrainingTask, TrainSettings, forward, read_vocab_size, train_phase
from workflow.train.pretraining_data import PretrainingSequences, list_shards

AGREEMENT = 1e-4  # relative difference of the packed and unpacked losses in fp32 (summation order only)
# A step's loss and gradients through another kernel path (compiled, fused): its rounding, per precision (gradients
# relative in norm, parameter by parameter; the loss relative)
STEP_TOLERANCE = {"fp32": 1e-3, "fp16": 1e-2, "bf16": 5e-2}
BINOMIAL_SIGMAS = 5.0  # a kept fraction further from 1 - p than this many standard deviations: not dropout p
# Each fast path: its reference, the largest relative difference allowed, and what to set when it is exceeded
# (None: no key turns it off; the message says what is wrong instead).
FUSED_OPTIMIZERS = {"lamb": "apex FusedLAMB", "adamw": "fused AdamW", "stable_adamw": "fused StableAdamW"}
FAST_PATHS = {
    "unpadded attention": ("the same packed rows with a block-diagonal mask (fp32 logits)", AGREEMENT,
                           "encode.packing.enabled: false"),
    # ModernBERT unpads every batch, in 16-bit only (flash kernels): both sides in that precision, its rounding
    "unpadded attention (16-bit)": ("the same rows with dense masks in the same precision (logits)", 3e-2,
                                    "pretrain.precision: fp32"),
    "precision": ("the same loss in fp32", 2e-2, "pretrain.precision: fp32"),
    "apex FusedLAMB": ("one torch LAMB step from the same gradients (relative to the update)", 1e-3,
                       "pretrain.lamb.fused: false"),
    "fused AdamW": ("one unfused torch AdamW step from the same gradients (relative to the update)", 1e-3,
                    "pretrain.adamw.fused: false"),
    "fused StableAdamW": ("one for-loop StableAdamW step of torch-optimi from the same gradients (relative to the "
                          "update)", 1e-3, "pretrain.stable_adamw.fused: false"),
    # BERT's packed rows in 16-bit: the flash kernel that trains (kernels.bert_flash_kernel) on the batch's sequences
    "flash_varlen": ("nested SDPA in the same precision (outputs and gradients, dropout 0)", 3e-2,
                     "pretrain.precision: fp32"),
    "flash_varlen dropout mask": ("the forward's dropout mask (<dv, v> = <g, out>, relative to the root sum of "
                                  "squares of g x out per token)", 2e-2, "pretrain.precision: fp32"),
    "flash_varlen dropout rate": ("the kept fraction 1 - p (in binomial standard deviations)", BINOMIAL_SIGMAS,
                                  "pretrain.precision: fp32"),
    "compiled step": ("the eager step's loss and gradients in the same precision", STEP_TOLERANCE,
                      "pretrain.compile: false"),
    "fused loss": ("the logits path's MLM loss and gradients on the model's own head", STEP_TOLERANCE,
                   "pretrain.fused_loss: false"),
    "float8": ("the same step's loss without float8", 5e-2, "pretrain.float8: false"),
    "checkpoint": ("the weights and optimizer state saved", 0.0, None),
    "rng restore": ("the draws after the saved state", 0.0, None),
}


def placement(env: distributed.DistEnv) -> dict:
    gpu = accelerator.device_name(env.device)
    return {"rank": env.rank, "local_rank": env.local_rank, "host": socket.gethostname(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "slurm_step_gpus": os.environ.get("SLURM_STEP_GPUS"), "device": str(env.device),
            "trains_on_gpu": env.local_rank if os.environ.get("CUDA_VISIBLE_DEVICES") else None, "gpu": gpu,
            "cores": sorted(os.sched_getaffinity(0))}


def allreduce_bus_gbps(env: distributed.DistEnv, megabytes: int, repeats: int = 5) -> float | None:
    if not env.distributed:
        return None
    tensor = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=env.device)
    distributed.all_reduce_(tensor)  # warm-up: the first call sets up the communicators
    accelerator.synchronize(env.device)
    start = time.perf_counter()
    for _ in range(repeats):
        distributed.all_reduce_(tensor)
    accelerator.synchronize(env.device)
    seconds = (time.perf_counter() - start) / repeats
    n = env.world_size
    return 2 * (n - 1) / n * tensor.numel() * 4 / seconds / 1e9


def unpacked(batch: dict) -> dict:
    """The live sequences of a batch of packed rows, one per row, as a batch of NVIDIA-schema rows would hold them."""
    rows, slots = (batch["next_sentence_labels"] >= 0).nonzero(as_tuple=True)
    length = batch["input_ids"].shape[1]
    member = batch["attention_mask"][rows] == (slots + 1)[:, None]   # [N, L]: the tokens of each sequence
    order = torch.argsort((~member).long(), dim=1, stable=True)    # its tokens first, in order
    present = torch.arange(length)[None, :] < member.sum(1, keepdim=True)
    positions, labels = batch["masked_lm_positions"][rows], batch["masked_lm_labels"][rows]
    mine = (labels >= 0) & torch.gather(member, 1, positions)
    slot_order = torch.argsort((~mine).long(), dim=1, stable=True)
    mine = torch.gather(mine, 1, slot_order)
    start = batch["cls_positions"][rows, slots][:, None]
    return {
        "input_ids": torch.gather(batch["input_ids"][rows], 1, order) * present,
        "token_type_ids": torch.gather(batch["token_type_ids"][rows], 1, order) * present,
        "attention_mask": present.long(),
        "masked_lm_positions": torch.where(mine, torch.gather(positions, 1, slot_order) - start, 0),
        "masked_lm_labels": torch.where(mine, torch.gather(labels, 1, slot_order), -1),
        "next_sentence_labels": batch["next_sentence_labels"][rows, slots],
    }


def packed_unpacked_losses(s: TrainSettings, model_dir: Path, env, sequences: int) -> dict:
    """This rank's share of the first `sequences` x world sequences, their loss read packed and unpacked (fp32, no
    dropout), with the trained weights."""
    shards = list_shards(s.data_dir, "training")
    if not shards[0].packed:
        return {"packed": False}
    _, model = family(s.model.family).build(dataclasses.replace(s.model, init_from=str(model_dir)), s.vocab,
                                            read_vocab_size(s.vocab), shards[0].seq_length)
    model.to(env.device).eval()
    reader = PretrainingSequences(shards, s.seed)
    try:
        packed = reader.read(env.rank * sequences, sequences)
    finally:
        reader.close()
    task = PretrainingTask(None, shards[0].seq_length)  # its loss and counts; the batches are read above
    losses = {}
    with torch.no_grad():
        for name, batch in (("packed", packed), ("unpacked", unpacked(packed))):
            batch = {k: v.to(env.device) for k, v in batch.items()}
            losses[name] = task.loss(model, batch, task.count(batch))["loss"].item()
    return {"packed": True, "sequences": sequences, **{f"{name}_loss": value for name, value in losses.items()},
            "relative_difference": abs(losses["packed"] - losses["unpacked"]) / abs(losses["unpacked"])}


@contextlib.contextmanager
def attention_path(device: torch.device, unpadded: bool):
    """Packed rows on `device` take the unpadded (varlen) path, or the rows with a block-diagonal mask."""
    saved = kit.VARLEN_DEVICE_TYPES
    others = tuple(kind for kind in saved if kind != device.type)
    kit.VARLEN_DEVICE_TYPES = (*others, device.type) if unpadded else others
    try:
        yield
    finally:
        kit.VARLEN_DEVICE_TYPES = saved


def relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.double() - reference.double()).abs().max() / reference.double().abs().max().clamp(min=1e-30))


def windowed_attention_difference(model, host: dict, device: torch.device, precision: str) -> float:
    """ModernBERT's unpadded attention (torch's varlen flash kernels, each layer type with its window) against the same
    sequences as rows with dense masks, on the same q, k, v in the same 16-bit precision: the larger relative
    difference of the two layer types. q, k, v are random, scaled so that softmax is peaked (logits' std 3, as a
    trained model's are): a wrong window or sequence boundary then moves the output by O(1), the kernels' rounding
    by ~1e-2. One layer at a time: through a whole model of 22 layers, widened so that its attention mattered, the
    rounding alone grew to 0.11 on an H200."""
    from workflow.train.models.modernbert import FULL, SLIDING, WindowedVarlenAttention

    encoder, config = model.model, model.config
    mask = host["attention_mask"].to(device)
    batch, length = mask.shape
    tokens = host["unpadded_tokens"].to(device)
    offsets = host["cu_seqlens"].to(device, torch.int32)
    generator = torch.Generator(device=device).manual_seed(0)
    head_size = config.hidden_size // config.num_attention_heads
    dtype = autocast_dtype(precision)
    q, k, v = (torch.randn(len(tokens), config.num_attention_heads, head_size, device=device, generator=generator)
               .mul(3 ** 0.5 if name != "v" else 1.0).to(dtype) for name in "qkv")

    def as_rows(x):
        return x.new_zeros(batch * length, *x.shape[1:]).index_copy(0, tokens, x).view(batch, length, *x.shape[1:])

    rows = encoder._row_attention(mask, length, True)
    windows = {FULL: None, SLIDING: config.sliding_window}
    differences = []
    for layer_type in (FULL, SLIDING):
        unpadded = WindowedVarlenAttention(offsets, host["max_seqlen"], windows[layer_type])(q, k, v, 0.0)
        padded = rows[layer_type](as_rows(q), as_rows(k), as_rows(v), 0.0).flatten(0, 1)[tokens]
        differences.append(relative(unpadded.float(), padded.float()))
    return max(differences)


def nested_sdpa(q, k, v, offsets, min_seqlen: int, max_seqlen: int):
    """kit.VarlenAttention with flash_varlen off: nested tensors' SDPA, the exact path, without dropout."""
    saved, kit.FLASH_VARLEN = kit.FLASH_VARLEN, False
    try:
        return kit.VarlenAttention(offsets, min_seqlen, max_seqlen)(q, k, v, 0.0)
    finally:
        kit.FLASH_VARLEN = saved


DROPOUT_QUANTUM = 1 / 256  # flash kernels keep an entry when an 8-bit random number is below (1 - p) x 255


def flash_varlen_differences(kernel, host: dict, config, device: torch.device, precision: str) -> dict:
    """BERT's 16-bit training kernel (`kernel`, in flash_varlen's signature) on the batch's sequences (host_indices'
    offsets) and random q, k, v: outputs and gradients against nested SDPA at dropout 0; at the model's attention
    dropout p, whether the backward drops what the forward dropped (out = A_dropped v is linear in v, so <dv, v> =
    <g, out> exactly then) and whether it keeps 1 - p of the weights: with q = k = 0 and v = 1, sequences of one token
    each give out = 1 / (1 - p) where kept and 0 where dropped, a binomial proportion over tokens x heads."""
    dtype, heads = autocast_dtype(precision), config.num_attention_heads
    offsets = host["cu_seqlens"].to(device)
    offsets32 = offsets.to(torch.int32)
    shape = (len(host["unpadded_tokens"]), heads, config.hidden_size // heads)
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v, g = (torch.randn(shape, device=device, generator=generator).to(dtype) for _ in range(4))

    def output_and_gradients(attention):
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = attention(*inputs)
        return [out.detach(), *torch.autograd.grad(out, inputs, g)]

    fast = output_and_gradients(lambda *qkv: kernel(*qkv, offsets32, host["max_seqlen"], 0.0))
    exact = output_and_gradients(lambda *qkv: nested_sdpa(*qkv, offsets, host["min_seqlen"], host["max_seqlen"]))
    differences = {"flash_varlen": max(relative(a.float(), b.float()) for a, b in zip(fast, exact))}
    p = config.attention_probs_dropout_prob
    if not p:
        return differences
    dropped_v = v.clone().requires_grad_()
    out = kernel(q, k, dropped_v, offsets32, host["max_seqlen"], p)
    (dv,) = torch.autograd.grad(out, dropped_v, g)
    per_token = (g.double() * out.detach().double()).sum((1, 2))
    differences["flash_varlen dropout mask"] = float(
        (per_token.sum() - (dv.double() * v.double()).sum()).abs() / per_token.square().sum().sqrt())
    singles = torch.arange(shape[0] + 1, device=device, dtype=torch.int32)
    zeros = torch.zeros_like(q)
    kept = (kernel(zeros, zeros, torch.ones_like(v), singles, 1, p)[..., 0] != 0).double().mean()
    sigma = (p * (1 - p) / (shape[0] * heads)) ** 0.5
    differences["flash_varlen dropout rate"] = max(0.0, abs(float(kept) - (1 - p)) - DROPOUT_QUANTUM) / sigma
    return differences


def loss_and_gradients(model, compute) -> tuple[torch.Tensor, list]:
    """compute()'s loss and the gradients its backward leaves on `model`'s parameters (cleared before and after)."""
    model.zero_grad(set_to_none=True)
    value = compute()
    value.backward()
    gradients = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return value.detach(), gradients


GRADIENT_FLOOR = 1e-3  # of all gradients' norm: a gradient that is zero in exact arithmetic (a key's bias) is noise


def step_difference(got: tuple, expected: tuple) -> float:
    """The larger of the losses' relative difference and each parameter's gradients' (in norm, relative to the
    reference gradient's, at least GRADIENT_FLOOR of all the reference gradients')."""
    (loss, gradients), (reference_loss, reference_gradients) = got, expected
    floor = GRADIENT_FLOOR * torch.stack([b.double().norm() for b in reference_gradients]).norm().clamp(min=1e-30)
    return max([relative(loss, reference_loss), *(
        float((a.double() - b.double()).norm() / torch.maximum(b.double().norm(), floor))
        for a, b in zip(gradients, reference_gradients))])


def compiled_step_difference(model, loss_of, compile_mode: str, device: torch.device) -> float:
    """One step's loss and gradients through torch.compile as the trainer compiles (engine.compiled) against eager's;
    `loss_of(network)` is the step's loss."""
    compiled = engine.compiled(model, compile_mode, device)
    return step_difference(loss_and_gradients(model, lambda: loss_of(compiled)),
                           loss_and_gradients(model, lambda: loss_of(model)))


def fused_loss_difference(model, batch: dict, device: torch.device, unpadded: bool, precision: str) -> float:
    """The MLM loss of the model's own head through the fused kernel (fused_loss.summed_mlm_loss, liger on CUDA)
    against the logits path, in loss and gradients."""
    def loss_of(fused: bool):
        def compute():
            with attention_path(device, unpadded), autocast(device, precision):
                hidden, _, labels = forward(model, batch, return_hidden=True)
                return fused_loss.summed_mlm_loss(hidden, *model.mlm_decoder(), labels, fused=fused)[0].float()
        return compute

    return step_difference(loss_and_gradients(model, loss_of(True)), loss_and_gradients(model, loss_of(False)))


def float8_difference(model, loss_of) -> float:
    """The loss with torchao's float8 matmuls (a converted copy of the model) against the model's own."""
    with torch.no_grad():
        return relative(loss_of(convert_to_float8(copy.deepcopy(model))), loss_of(model))


def fast_paths(config, batch: dict, env, precision: str, fused: bool, scratch: Path,
               model_family, optimizer_kind: str = "lamb", compile_mode: str | None = None,
               fused_mlm_loss: bool = False, float8: bool = False) -> dict:
    """This rank's fast paths on its device, each against its reference (FAST_PATHS), on `batch` (host tensors, as
    the data reader gives them) and a fresh model of `config` (of `model_family`) in eval mode (no dropout: both
    sides compute one function), with the paths the config turns on (`compile_mode`: pretrain.compile's mode, None
    when off; pretrain.fused_loss; pretrain.float8): {"rank", "optimizer", "attention", "precision", "paths": {name:
    relative difference}, "skipped": {name: why}, "syncs"}."""
    device, packed = env.device, "cls_positions" in batch
    task = PretrainingTask(None, batch["input_ids"].shape[1], host_indices=model_family.host_indices)
    host = model_family.host_indices(batch)
    on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in host.items()}
    head_size = config.hidden_size // config.num_attention_heads
    training_path = model_family.trains_unpadded(device.type, packed, precision)
    if training_path and not model_family.unpads_in_fp32:  # below its torch or GPU floor ModernBERT trains as rows
        training_path = kernels.fast_kernel(model_family.name, device) != kernels.ROWS
    torch.manual_seed(0)
    model = model_family.pretraining_model(config).to(device).eval()

    def loss(network, unpadded: bool, dtype: str):
        with attention_path(device, unpadded), autocast(device, dtype):
            return task.loss(network, on_device, task.count(on_device))["loss"].float()

    def outputs(unpadded: bool, dtype: str = "fp32", network=model):  # the logits at every labelled slot
        with attention_path(device, unpadded), autocast(device, dtype):
            mlm_logits, nsp_logits, _ = forward(network, on_device)
        nsp = [] if nsp_logits is None else [nsp_logits[on_device["next_sentence_labels"] >= 0].float().flatten()]
        return torch.cat([mlm_logits.float().flatten(), *nsp])

    paths, skipped = {}, {}
    if training_path and model_family.unpads_in_fp32 and precision != "fp32":  # BERT's packed rows in 16-bit
        probe = torch.empty(0, 1, head_size, dtype=autocast_dtype(precision), device=device)
        flash_kernel = (kernels.bert_flash_kernel(device, kit.flash_varlen)
                        if kit.FLASH_VARLEN and runs_flash_varlen(probe) else None)
        if flash_kernel is not None:  # else nested SDPA trains, which the unpadded attention check below covers
            paths.update(flash_varlen_differences(flash_kernel, on_device, config, device, precision))
    with torch.no_grad():
        if packed and model_family.unpads_in_fp32:  # checked on any device (BERT's nested tensors run on CPU)
            paths["unpadded attention"] = relative(outputs(True), outputs(False))
        elif training_path and not model_family.unpads_in_fp32:  # ModernBERT's flash kernels: where they run
            paths["unpadded attention (16-bit)"] = windowed_attention_difference(model, host, device, precision)
        if precision != "fp32":
            paths["precision"] = relative(loss(model, training_path, precision), loss(model, training_path, "fp32"))

    def step_loss(network):
        return loss(network, training_path, precision)

    if compile_mode is not None:
        paths["compiled step"] = compiled_step_difference(model, step_loss, compile_mode, device)
    if fused_mlm_loss:
        why = fused_loss.fused_mlm_loss_reason(device)
        if why is None:
            paths["fused loss"] = fused_loss_difference(model, on_device, device, training_path, precision)
        else:  # the trainer runs the logits path here too: nothing fused to check
            skipped["fused loss"] = why
    if float8:
        why = float8_error(device)
        if why is None:
            paths["float8"] = float8_difference(model, step_loss)
        else:
            skipped["float8"] = why
    optimizer, name = make_optimizer(optimizer_kind, model, 1e-3, fused=fused)
    twin = reference = None
    if fused:  # the unfused twin, stepped only where the fused path is another than its own
        twin = model_family.pretraining_model(config).to(device).eval()
        twin.load_state_dict(model.state_dict())
        reference, reference_name = make_optimizer(optimizer_kind, twin, 1e-3, fused=False)
    if twin is not None and name != reference_name:  # one step of each from the same gradients
        before = [p.detach().clone() for p in model.parameters()]
        for network, step in ((model, optimizer), (twin, reference)):
            loss(network, training_path, "fp32").backward()
            step.step()
        paths[FUSED_OPTIMIZERS[optimizer_kind]] = max(relative(p.detach() - b, q.detach() - b) for p, q, b in zip(
            model.parameters(), twin.parameters(), before))
    else:
        loss(model, training_path, "fp32").backward()
        optimizer.step()
    del twin, reference
    saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    loaded = ckpt.load_checkpoint(ckpt.save_checkpoint(scratch / f"rank{env.rank}", 0, saved, keep=1))
    expected, got = ckpt.flat_tensors(saved), ckpt.flat_tensors(loaded)
    paths["checkpoint"] = 0.0 if expected.keys() == got.keys() and all(
        torch.equal(got[k].cpu(), v.cpu()) for k, v in expected.items()) else float("inf")
    state = ckpt.rng_state(device)
    first = torch.rand(64, device=device)
    ckpt.set_rng_state(state, device)
    paths["rng restore"] = 0.0 if torch.equal(torch.rand(64, device=device), first) else float("inf")
    kernel = (accelerator.attention_kernel(device, autocast_dtype(precision), head_size, family=model_family.name)
              if training_path else kernels.ROWS)
    return {"rank": env.rank, "optimizer": name, "attention": kernel, "precision": precision, "paths": paths,
            "skipped": skipped, "syncs": accelerator.host_syncs(device, lambda: loss(model, training_path, precision))}


def disagreement(results: list[dict]) -> UserError | None:
    """The error of the first fast path of any rank beyond its tolerance (None: all agree)."""
    for result in results:
        for path, difference in result["paths"].items():
            reference, tolerance, key = FAST_PATHS[path]
            if isinstance(tolerance, dict):  # stated per precision
                tolerance = tolerance[result["precision"]]
            if not difference <= tolerance:
                fix = (f"set {key} until it is fixed" if key else
                       "training cannot resume exactly here; check the device and the run directory's filesystem")
                return UserError(f"rank {result['rank']}: {path} differs from {reference} by {difference:.2e} "
                                 f"(relative; at most {tolerance:g}) on this cluster; {fix}")
    return None


def report_fast_paths(results: list[dict]) -> None:
    for r in results:
        checks = ", ".join(f"{path} {difference:.1e}" for path, difference in r["paths"].items())
        syncs = "" if r["syncs"] is None else f"; host syncs in a packed forward: {r['syncs'] or 'none'}"
        syncs += "".join(f"; {path} not checked: {why}" for path, why in r.get("skipped", {}).items())
        print(f"rank {r['rank']:>3}: optimizer {r['optimizer']}, attention {r['attention']}, precision "
              f"{r['precision']}; against the references: {checks}{syncs}", file=sys.stderr, flush=True)


def checkpoint_write(run_dir: Path, scratch: Path) -> dict:
    """Seconds to write (and fsync, checksum) the newest checkpoint's model and LAMB state once more, on the run
    directory's filesystem: what every checkpoint of the phase costs, and what the time-limit margin must cover."""
    state, _ = ckpt.load_latest_checkpoint(run_dir / "checkpoints")
    start = time.perf_counter()
    path = ckpt.save_checkpoint(scratch, 0, state, keep=1)
    seconds = time.perf_counter() - start
    return {"checkpoint_bytes": path.stat().st_size, "checkpoint_write_s": seconds}


def gather(env, value) -> list:
    """Every rank's `value`, in rank order, on every rank."""
    if not env.distributed:
        return [value]
    gathered = [None] * env.world_size
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def check_fast_paths(s: TrainSettings, shards, env, scratch: Path, sequences: int = 16) -> dict:
    """fast_paths with the phase-1 settings: the configured model (fresh weights), this rank's first sequences."""
    config, _ = family(s.model.family).build(dataclasses.replace(s.model, init_from=None), s.vocab,
                                             read_vocab_size(s.vocab), shards[0].seq_length)
    reader = PretrainingSequences(shards, s.seed)
    try:
        batch = reader.read(env.rank * sequences, sequences)
    finally:
        reader.close()
    with accelerator.full_fp32():
        p = s.pretrain
        return fast_paths(config, batch, env, resolve_precision(p.precision, env.device, "pretrain.precision"),
                          p.optimizer.fused, scratch, family(s.model.family), p.optimizer.name,
                          p.compile_mode if p.compile else None, p.fused_loss, p.float8)


def check(config: dict, data_dir: str, vocab: str, scratch: Path, steps: int, allreduce_mb: int,
          threads: int | None) -> dict | None:
    env = distributed.setup()
    try:
        if env.is_main:
            shutil.rmtree(scratch, ignore_errors=True)
        distributed.barrier()
        ranks = gather(env, placement(env))
        bandwidth = allreduce_bus_gbps(env, allreduce_mb)
        s = TrainSettings.from_config(
            config, PHASES[0], data_dir=data_dir, vocab=vocab, run_dir=str(scratch / "run"),
            out_model=str(scratch / "model"), out_metrics=str(scratch / "metrics.jsonl"),
            out_summary=str(scratch / "summary.json"), out_telemetry=None, out_optimizer=None,
            threads=threads)
        shards = list_shards(data_dir, "training")
        fast = gather(env, check_fast_paths(s, shards, env, scratch / "fast_paths"))
        if env.is_main:
            report_fast_paths(fast)
        failure = disagreement(fast)  # every rank has every result: all stop together
        if failure:
            raise failure
        # steps of about one micro-batch (micro_batch_size rows) per rank: the phase's shapes, not its accumulation
        per_row = sum(shard.n for shard in shards) / sum(shard.rows for shard in shards)
        # (no batch-size warm-up: every step the same shapes)
        phase = dataclasses.replace(
            s.phase, global_batch_size=max(1, int(s.phase.micro_batch_size * per_row)) * env.world_size,
            batch_size_warmup=None, max_steps=min(steps, s.phase.total_steps))
        # a step between log lines: its syncs are counted
        s = dataclasses.replace(s, phase=phase, pretrain=dataclasses.replace(
            s.pretrain, checkpoint_every=steps, log_every=max(2, steps // 4)))
        with engine.measured_host_syncs() as syncs:
            summary = train_phase(s, env)
        distributed.barrier()  # rank 0 has exported the model the comparison loads
        with accelerator.full_fp32():  # the trainer in fp32 left TF32 on: its rounding is beyond AGREEMENT
            losses = packed_unpacked_losses(s, scratch / "model", env, sequences=16)
        gathered = gather(env, losses)
        result = None
        if env.is_main:
            result = {"world_size": env.world_size, "ranks": ranks, "fast_paths": fast, "allreduce_mb": allreduce_mb,
                      "allreduce_bus_gbps": bandwidth, "preset": s.model.preset, "precision": summary["precision"],
                      "optimizer": summary["optimizer"], "seq_length": summary["seq_length"], "steps": summary["steps"],
                      "sequences_per_second": summary["seq_per_s"], "real_tokens_per_s": summary["real_tokens_per_s"],
                      "test_mlm_accuracy": summary.get("test_mlm_accuracy"),
                      **checkpoint_write(scratch / "run", scratch / "write"), "packed_vs_unpacked": gathered,
                      "host_syncs": syncs_per_step(syncs), **utilization(summary, env)}
            shutil.rmtree(scratch, ignore_errors=True)
        distributed.barrier()
        return result
    finally:
        distributed.cleanup()


def syncs_per_step(record: dict) -> dict:
    """Host syncs per optimizer step on steps between log lines and checkpoints, and on the steps at them."""
    return {f"{kind}_{name}": value for kind in ("between", "boundary")
            for name, value in (("steps", record.get(f"{kind}_steps", 0)),
                                ("per_step", record.get(f"{kind}_syncs", 0) / max(1, record.get(f"{kind}_steps", 0))))}


def utilization(summary: dict, env) -> dict:
    """MFU: the model FLOPs per second per device over the datasheet peak of the math its matmuls ran in (None: no
    peak for this device)."""
    math = matmul_math(summary["precision"], env.device)
    peak = accelerator.peak_flops(accelerator.device_name(env.device), math)
    flops = summary["seq_per_s"] * summary["train_flops_per_sequence"] / env.world_size
    return {"matmul_math": math, "peak_tflops": peak and peak / 1e12, "mfu": flops / peak if peak else None}


def _steps(count: int) -> str:
    return f"{count} step{'s' if count != 1 else ''}"


def report(result: dict) -> None:
    for r in result["ranks"]:
        print(f"rank {r['rank']:>3} on {r['host']}: GPU {r['gpu'] or '-'} (CUDA_VISIBLE_DEVICES="
              f"{r['cuda_visible_devices']}, trains on {r['device']}), cores {r['cores']}", file=sys.stderr)
    bandwidth = result["allreduce_bus_gbps"]
    print(f"world size {result['world_size']}; all-reduce {result['allreduce_mb']} MB: "
          f"{bandwidth if bandwidth is None else round(bandwidth, 2)} GB/s bus bandwidth; {result['preset']} "
          f"phase 1 (seq {result['seq_length']}, {result['precision']}, {result['optimizer']}): "
          f"{result['sequences_per_second']:.1f} seq/s over {result['steps']} steps; checkpoint "
          f"{result['checkpoint_bytes'] / 1e9:.2f} GB written in {result['checkpoint_write_s']:.1f} s", file=sys.stderr)
    mfu = (f"{result['mfu']:.1%} of {result['peak_tflops']:g} TFLOP/s (datasheet dense {result['matmul_math']})"
           if result.get("mfu") is not None else f"unknown (no datasheet peak for this device; matmuls in "
           f"{result.get('matmul_math')})")
    syncs = result.get("host_syncs")
    if syncs:
        print(f"MFU {mfu}; host syncs per optimizer step: {syncs['between_per_step']:g} between log lines and "
              f"checkpoints ({_steps(syncs['between_steps'])}), {syncs['boundary_per_step']:g} at them "
              f"({_steps(syncs['boundary_steps'])})", file=sys.stderr)
    agreement = result["packed_vs_unpacked"]
    if agreement[0]["packed"]:
        worst = max(a["relative_difference"] for a in agreement)
        print(f"packed vs unpacked loss of the same sequences: relative difference up to {worst:.2e} "
              f"(must be <= {AGREEMENT:g})", file=sys.stderr, flush=True)
        if worst > AGREEMENT:
            raise UserError(f"packed and unpacked losses of the same sequences differ by {worst:.2e} (relative) on "
                            f"this cluster: the packed attention path is wrong here; train with "
                            f"encode.packing.enabled: false until it is fixed")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, type=config_sections,
                        help="JSON of the config sections seed, model and pretrain")
    parser.add_argument("--data-dir", required=True, help="phase 1's data: data/hdf5_seq128")
    parser.add_argument("--vocab", required=True)
    parser.add_argument("--run-dir", required=True, type=Path, help="a scratch directory (emptied before and after)")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--allreduce-mb", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads of the job (shared by its local ranks)")
    args = parser.parse_args(argv)
    try:
        result = check(args.config, args.data_dir, args.vocab, args.run_dir, args.steps, args.allreduce_mb,
                       args.threads)
        if result is not None:
            write_text(args.output, json.dumps(result, indent=1) + "\n")
            report(result)
            print(passed(result), file=sys.stderr, flush=True)
    except UserError as error:
        raise UserError(f"cluster_check: {error}") from None
    except Exception as error:  # a kernel or a collective that crashed: its traceback, then the one line
        traceback.print_exc()
        reason = (str(error).strip().splitlines() or [""])[0]
        raise UserError(f"cluster_check: {type(error).__name__}: {reason} (the traceback above says where)") from None


def passed(result: dict) -> str:
    """The check's last line when every rank passed: what was checked, on how many ranks."""
    fast = result["fast_paths"][0]
    packed = " and packed vs unpacked loss" if result["packed_vs_unpacked"][0]["packed"] else ""
    skipped = "".join(f"; {path} not checked ({why})" for path, why in fast.get("skipped", {}).items())
    return (f"cluster_check: passed on {result['world_size']} rank{'s' if result['world_size'] != 1 else ''} "
            f"({', '.join(fast['paths'])} against their references, attention {fast['attention']}{skipped}; "
            f"{_steps(result['steps'])} of the trainer in {result['precision']} with {result['optimizer']}{packed})")


if __name__ == "__main__":
    from workflow.cli import run

    run(main)
