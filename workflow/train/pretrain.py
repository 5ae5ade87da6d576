"""BERT pretraining (one phase): LAMB, accumulation, DDP, exact resume from a run directory, HF export.

API:
    TrainSettings          every knob of a phase (the CLI flags, one to one)
    pretrain(settings)     train (resuming from `run_dir/checkpoints` when possible), evaluate on the test
                           shards, export; returns the summary dict
    build_model(...)       (config, BertForPreTraining) from preset / bert_config.json / HF directory
    accumulation_steps(global_batch, micro_batch, world, phase) -> int (UserError naming the config key)
    train_step(model, optimizer, micro_batches, ...)   one optimizer step over a list of micro-batches
                           (no_sync on all but the last under DDP); used by pretrain() and the SQuAD stage

Metrics: tokens_per_s counts sequences x sequence length (padding included), as NVIDIA reports it. Gradient
clipping is LAMB's global-norm pre-normalisation (max_grad_norm 1.0), as in NVIDIA's recipe.

Run directory (`--run-dir`, not a rule output): checkpoints/step_*.pt, metrics.jsonl, gpu_telemetry.csv.
A rerun with the same settings resumes from the newest valid checkpoint; SIGTERM/SIGUSR1 checkpoint and exit
128+signal; SNAKEBERT_FAIL_AT_STEP=N kills the process (SIGKILL) right after step N (tests of crash recovery).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from workflow.train import checkpoint as ckpt
from workflow.train import distributed
from workflow.atomic import atomic_path, write_json
from workflow.cli import UserError, run
from workflow.train.lamb import make_optimizer, make_scheduler
from workflow.train.model import (BertConfig, BertForPreTraining, count_parameters, flops_per_sequence, load_pretrained,
                            load_weights, pretraining_loss, save_pretrained)
from workflow.train.precision import autocast, resolve_precision
from workflow.train.pretraining_data import PretrainingStream, iterate_in_order, list_shards
from workflow.train.telemetry import GpuTelemetry

log = logging.getLogger("pretrain")
STAT_KEYS = ("loss", "mlm_loss", "nsp_loss", "mlm_correct", "mlm_count", "nsp_correct", "nsp_count")


@dataclass
class TrainSettings:
    phase: str
    data_dir: str
    vocab: str
    run_dir: str
    out_model: str
    out_metrics: str
    out_summary: str
    learning_rate: float
    warmup_proportion: float
    total_steps: int
    global_batch_size: int
    micro_batch_size: int
    max_steps: int | None = None
    preset: str = "bert-large"
    bert_config: str | None = None
    init_from: str | None = None
    seed: int = 12345
    precision: str = "auto"
    checkpoint_every: int = 200
    keep_checkpoints: int = 3
    log_every: int = 10
    eval_max_sequences: int | None = None
    out_telemetry: str | None = None
    device: str = "auto"
    threads: int | None = None
    deterministic: bool = False
    compile: bool = False


def accumulation_steps(global_batch: int, micro_batch: int, world: int, phase: str) -> int:
    if global_batch % (micro_batch * world):
        raise UserError(f"config pretrain.{phase}.global_batch_size ({global_batch}) is not divisible by "
                        f"pretrain.{phase}.micro_batch_size ({micro_batch}) x world size ({world})")
    return global_batch // (micro_batch * world)


def read_vocab_size(path: str) -> int:
    try:
        with open(path, encoding="utf-8") as handle:
            size = sum(1 for line in handle if line.rstrip("\n"))
    except OSError as error:
        raise UserError(f"{path}: cannot read the vocabulary ({error})") from None
    if size == 0:
        raise UserError(f"{path}: empty vocabulary")
    return size


def build_model(preset: str, bert_config: str | None, init_from: str | None, vocab_size: int,
                seq_length: int) -> tuple[BertConfig, BertForPreTraining]:
    """Model from (in order of precedence) an HF directory, a bert_config.json, or a preset sized to the vocab."""
    state = None
    if init_from:
        config, state = load_pretrained(init_from)
        source = init_from
    elif bert_config:
        config, source = BertConfig.from_json(bert_config), bert_config
    else:
        # Pad the vocab to a multiple of 8 (tensor-core friendly), as NVIDIA does.
        config, source = BertConfig.preset(preset, vocab_size=(vocab_size + 7) // 8 * 8), f"preset {preset}"
    if config.vocab_size < vocab_size:
        raise UserError(f"{source}: vocab_size {config.vocab_size} is smaller than the vocabulary ({vocab_size})")
    if config.max_position_embeddings < seq_length:
        raise UserError(f"{source}: max_position_embeddings {config.max_position_embeddings} < sequence length "
                        f"{seq_length} of the data")
    model = BertForPreTraining(config)
    if state is not None:
        missing, unexpected = load_weights(model, state)
        log.info("initialised from %s (%d tensors)", init_from, len(state))
        if missing or unexpected:
            log.warning("init_from %s: missing %s, unexpected %s (kept freshly initialised)", init_from, missing,
                        unexpected)
    return config, model


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def train_step(model, optimizer, micro_batches, device, precision="fp32", scaler=None, loss_fn=None) -> dict:
    """Forward/backward every micro-batch (gradient all-reduce only on the last), then one optimizer step.

    The gradient is that of the mean loss over all micro-batches (and, under DDP, all ranks).
    `loss_fn(model, batch) -> dict with "loss"` defaults to BERT pretraining's. Returns summed statistics.
    """
    loss_fn = loss_fn or pretraining_forward
    ddp = getattr(model, "_orig_mod", model)  # under torch.compile, no_sync lives on the wrapped DDP module
    count = len(micro_batches)
    totals = {}
    for index, batch in enumerate(micro_batches):
        batch = to_device(batch, device)
        last = index == count - 1
        sync = contextlib.nullcontext() if last or not isinstance(ddp, DistributedDataParallel) else ddp.no_sync()
        with sync:
            with autocast(device, precision):
                out = loss_fn(model, batch)
            loss = out["loss"] / count
            (scaler.scale(loss) if scaler is not None else loss).backward()
        for key, value in out.items():
            totals[key] = totals.get(key, 0) + value.detach().float()
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = getattr(optimizer, "last_grad_norm", None)
    if not hasattr(optimizer, "last_grad_norm"):  # apex FusedLAMB does not expose it
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        grad_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    if hasattr(optimizer, "last_grad_norm"):
        grad_norm = optimizer.last_grad_norm
    optimizer.zero_grad(set_to_none=True)
    totals["grad_norm"] = grad_norm.detach().float() if grad_norm is not None else torch.zeros((), device=device)
    totals["micro_batches"] = torch.tensor(float(count), device=device)
    return totals


def pretraining_forward(model, batch: dict) -> dict:
    mlm_logits, nsp_logits = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
                                   batch["masked_lm_positions"])
    return pretraining_loss(mlm_logits, nsp_logits, batch["masked_lm_labels"], batch["next_sentence_labels"])


@torch.no_grad()
def evaluate(model, shards, env, precision, batch_size, limit) -> dict:
    """Held-out MLM/NSP accuracy and loss; test shards split over ranks, counts summed."""
    model.eval()
    mine = shards[env.rank::env.world_size]
    per_rank = None if limit is None else -(-limit // env.world_size)
    sums = torch.zeros(6, dtype=torch.float64, device=env.device)
    for batch in iterate_in_order(mine, batch_size, per_rank):
        batch = to_device(batch, env.device)
        with autocast(env.device, precision):
            out = pretraining_forward(model, batch)
        n = batch["input_ids"].shape[0]
        sums += torch.stack([out["mlm_correct"], out["mlm_count"], out["nsp_correct"], out["nsp_count"],
                             out["mlm_loss"].float() * out["mlm_count"], out["nsp_loss"].float() * n]).double()
    distributed.all_reduce_(sums)
    model.train()
    mlm_correct, mlm_count, nsp_correct, nsp_count, mlm_loss, nsp_loss = sums.tolist()
    return {"test_mlm_accuracy": mlm_correct / max(mlm_count, 1), "test_nsp_accuracy": nsp_correct / max(nsp_count, 1),
            "test_mlm_loss": mlm_loss / max(mlm_count, 1), "test_nsp_loss": nsp_loss / max(nsp_count, 1),
            "test_sequences": int(nsp_count), "test_predictions": int(mlm_count)}


def _fingerprint(s: TrainSettings, config: BertConfig, shards, world: int) -> dict:
    """What must match for a checkpoint to be resumed (max_steps may change)."""
    return {"phase": s.phase, "seed": s.seed, "learning_rate": s.learning_rate,
            "warmup_proportion": s.warmup_proportion, "total_steps": s.total_steps,
            "global_batch_size": s.global_batch_size, "micro_batch_size": s.micro_batch_size, "world_size": world,
            "model": config.to_dict(), "init_from": _weights_digest(s.init_from),
            "shards": [[Path(x.path).name, x.n] for x in shards]}


def _weights_digest(directory: str | None) -> str | None:
    """sha256 of an init model's weights: a retrained phase 1 invalidates phase 2's checkpoints."""
    if not directory:
        return None
    for name in ("model.safetensors", "pytorch_model.bin"):
        path = Path(directory) / name
        if path.is_file():
            return ckpt.file_sha256(path)
    return str(directory)


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines past `step` (they are about to be recomputed after a resume)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    with atomic_path(path) as temporary:
        temporary.write_text("".join(line + "\n" for line in kept))


def _gather_rng(env) -> list:
    state = ckpt.rng_state()
    if not env.distributed:
        return [state]
    gathered = [None] * env.world_size
    torch.distributed.all_gather_object(gathered, state)
    return gathered


def pretrain(s: TrainSettings) -> dict:
    if s.deterministic:
        torch.use_deterministic_algorithms(True)
    if s.threads:
        torch.set_num_threads(s.threads)
    env = distributed.setup(s.device)
    try:
        return _pretrain(s, env)
    finally:
        distributed.cleanup()


def _pretrain(s: TrainSettings, env) -> dict:
    accumulation = accumulation_steps(s.global_batch_size, s.micro_batch_size, env.world_size, s.phase)
    max_steps = s.max_steps or s.total_steps
    if max_steps > s.total_steps:
        raise UserError(f"config pretrain.{s.phase}.max_steps ({max_steps}) exceeds total_steps ({s.total_steps})")
    train_shards = list_shards(s.data_dir, "training")
    test_shards = list_shards(s.data_dir, "test")
    seq_length = train_shards[0].seq_length
    precision = resolve_precision(s.precision, env.device, "pretrain.precision")
    run_dir = Path(s.run_dir)
    checkpoint_dir = run_dir / "checkpoints"
    metrics_path = run_dir / "metrics.jsonl"

    torch.manual_seed(s.seed)  # identical initial weights on every rank
    config, model = build_model(s.preset, s.bert_config, s.init_from, read_vocab_size(s.vocab), seq_length)
    model.to(env.device)
    if env.distributed:  # own dropout masks per rank (as NVIDIA seeds seed + rank); weights stay identical
        torch.manual_seed(s.seed + env.rank)
    optimizer, optimizer_name = make_optimizer(model, s.learning_rate)
    scheduler = make_scheduler(optimizer, s.total_steps, s.warmup_proportion)
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    fingerprint = _fingerprint(s, config, train_shards, env.world_size)

    step, consumed, train_time = 0, 0, 0.0
    # On the CPU: RNG states must stay CPU tensors; load_state_dict moves weights/moments to the device.
    state, path = ckpt.load_latest_checkpoint(checkpoint_dir, map_location="cpu")
    if state is not None and state.get("fingerprint") != fingerprint:
        log.warning("%s was written with other settings or data; starting %s afresh", path, s.phase)
        if env.is_main:
            shutil.rmtree(checkpoint_dir, ignore_errors=True)
            metrics_path.unlink(missing_ok=True)
        state = None
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        step, consumed, train_time = state["step"], state["data"]["consumed"], state["train_time_s"]
        ckpt.set_rng_state(state["rng"][env.rank])
        log.info("resumed from %s at step %d (data position %s)", path, step, state["data"])
    elif env.is_main:
        metrics_path.unlink(missing_ok=True)
    if env.is_main:
        _truncate_metrics(metrics_path, step)
    del state

    log.info("%s: %s, %d parameters, %s, %s, seq %d, global batch %d = %d x %d micro x %d ranks, steps %d/%d",
             s.phase, env.device, count_parameters(model), precision, optimizer_name, seq_length,
             s.global_batch_size, accumulation, s.micro_batch_size, env.world_size, max_steps, s.total_steps)
    train_model = model
    if env.distributed:
        train_model = DistributedDataParallel(model, device_ids=[env.device.index] if env.device.type == "cuda"
                                              else None, gradient_as_bucket_view=True)
    if s.compile:
        train_model = torch.compile(train_model)
    stream = PretrainingStream(train_shards, s.micro_batch_size, s.seed, env.rank, env.world_size, consumed)

    def save():
        data = stream.position()
        rng = _gather_rng(env)
        if env.is_main:
            ckpt.save_checkpoint(checkpoint_dir, step, {
                "step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict() if scaler else {},
                "rng": rng, "data": data, "train_time_s": train_time, "fingerprint": fingerprint,
            }, s.keep_checkpoints)
        if env.distributed:
            torch.distributed.barrier()

    telemetry_path = run_dir / "gpu_telemetry.csv"
    window = {key: torch.zeros((), device=env.device) for key in (*STAT_KEYS, "grad_norm", "micro_batches")}
    window_steps, window_start = 0, time.perf_counter()
    model.train()
    with ckpt.StopSignals() as stop, GpuTelemetry(telemetry_path, enabled=env.is_main) as telemetry:
        progress = tqdm(total=max_steps, initial=step, desc=s.phase, disable=not env.is_main, file=sys.stderr)
        while step < max_steps:
            started = time.perf_counter()
            micro_batches = [next(stream) for _ in range(accumulation)]
            stats = train_step(train_model, optimizer, micro_batches, env.device, precision, scaler)
            scheduler.step()
            step += 1
            window_steps += 1
            for key in window:
                window[key] += stats[key]
            if step % s.log_every == 0 or step == max_steps:
                _log_metrics(window, window_steps, time.perf_counter() - window_start, step, scheduler, s,
                             seq_length, env, metrics_path)
                window = {key: torch.zeros_like(value) for key, value in window.items()}
                window_steps, window_start = 0, time.perf_counter()
            train_time += time.perf_counter() - started
            progress.update(1)
            stop_now = _stop_requested(stop, env)
            if step % s.checkpoint_every == 0 or step == max_steps or stop_now:
                save()
            ckpt.fail_at_step(step)
            if stop_now:
                progress.close()
                stream.close()
                log.warning("stopped by signal at step %d; rerun to resume", step)
                distributed.cleanup()
                sys.exit(stop.exit_code() if stop.received else 143)
        progress.close()
        stream.close()
        if telemetry.active:
            log.info("GPU telemetry in %s", telemetry_path)

    evaluation = evaluate(model, test_shards, env, precision, s.micro_batch_size * 2, s.eval_max_sequences)
    summary = {
        "phase": s.phase, "steps": step, "total_steps": s.total_steps, "train_time_s": round(train_time, 3),
        "sequences": step * s.global_batch_size, "seq_length": seq_length,
        "seq_per_s": step * s.global_batch_size / max(train_time, 1e-9),
        "tokens_per_s": step * s.global_batch_size * seq_length / max(train_time, 1e-9),
        "world_size": env.world_size, "device": str(env.device.type), "precision": precision,
        "optimizer": optimizer_name, "parameters": count_parameters(model), "global_batch_size": s.global_batch_size,
        "micro_batch_size": s.micro_batch_size, "accumulation_steps": accumulation,
        "train_flops_per_sequence": flops_per_sequence(config, seq_length, train_shards[0].max_predictions),
        "model": config.to_dict(), **evaluation,
    }
    if env.is_main:
        with atomic_path(s.out_model) as temporary:
            save_pretrained(model, config, s.vocab, temporary)
        with atomic_path(s.out_metrics) as temporary:
            shutil.copyfile(metrics_path, temporary)
        if s.out_telemetry and telemetry_path.exists():
            with atomic_path(s.out_telemetry) as temporary:
                shutil.copyfile(telemetry_path, temporary)
        write_json(s.out_summary, summary)
        log.info("%s done: %s", s.phase, {k: summary[k] for k in ("steps", "seq_per_s", "test_mlm_accuracy",
                                                                   "test_nsp_accuracy")})
    return summary


def _stop_requested(stop, env) -> bool:
    if not env.distributed:
        return stop.received is not None
    # A signal seen by any rank stops all of them after the same step.
    flag = torch.tensor(1.0 if stop.received else 0.0, device=env.device)
    distributed.all_reduce_(flag, op="max")
    return bool(flag.item())


def _log_metrics(window, steps, elapsed, step, scheduler, s, seq_length, env, path: Path) -> None:
    values = torch.stack([window[k].float() for k in (*STAT_KEYS, "grad_norm", "micro_batches")])
    distributed.all_reduce_(values)
    stats = dict(zip((*STAT_KEYS, "grad_norm", "micro_batches"), values.tolist()))
    micro = max(stats["micro_batches"], 1)
    sequences = steps * s.global_batch_size
    record = {
        "step": step,
        "loss": stats["loss"] / micro, "mlm_loss": stats["mlm_loss"] / micro, "nsp_loss": stats["nsp_loss"] / micro,
        "mlm_accuracy": stats["mlm_correct"] / max(stats["mlm_count"], 1),
        "nsp_accuracy": stats["nsp_correct"] / max(stats["nsp_count"], 1),
        "lr": scheduler.get_last_lr()[0],
        "grad_norm": stats["grad_norm"] / (steps * env.world_size),
        "seq_per_s": sequences / max(elapsed, 1e-9),
        "tokens_per_s": sequences * seq_length / max(elapsed, 1e-9),
    }
    if env.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        log.info("step %d loss %.4f mlm_acc %.3f lr %.3g", step, record["loss"], record["mlm_accuracy"],
                 record["lr"])


def _optional_int(text: str) -> int | None:
    """An integer, or None for an empty string (an unset config value)."""
    return int(text) if text.strip() else None


def _optional_str(text: str) -> str | None:
    return text or None


def parse_args(argv=None) -> TrainSettings:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--phase", required=True, choices=["phase1", "phase2"])
    p.add_argument("--data-dir", required=True, help="data/hdf5_seqN (training/ and test/ shards)")
    p.add_argument("--vocab", required=True)
    p.add_argument("--run-dir", required=True, help="checkpoints and live metrics (kept across reruns)")
    p.add_argument("--out-model", required=True)
    p.add_argument("--out-metrics", required=True)
    p.add_argument("--out-summary", required=True)
    p.add_argument("--out-telemetry", default=None)
    p.add_argument("--learning-rate", type=float, required=True)
    p.add_argument("--warmup-proportion", type=float, required=True)
    p.add_argument("--total-steps", type=int, required=True)
    p.add_argument("--max-steps", type=_optional_int, default=None)
    p.add_argument("--global-batch-size", type=int, required=True)
    p.add_argument("--micro-batch-size", type=int, required=True)
    p.add_argument("--preset", default="bert-large")
    p.add_argument("--bert-config", type=_optional_str, default=None)
    p.add_argument("--init-from", type=_optional_str, default=None, help="HF BERT directory to start from")
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    p.add_argument("--checkpoint-every", type=int, default=200)
    p.add_argument("--keep-checkpoints", type=int, default=3)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-max-sequences", type=_optional_int, default=None)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms(True)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (GPU)")
    args = p.parse_args(argv)
    return TrainSettings(**vars(args))


def main(argv=None) -> None:
    pretrain(parse_args(argv))


if __name__ == "__main__":
    run(main)
