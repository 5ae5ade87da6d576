"""SQuAD fine-tuning: a span-prediction head on a pretrained BERT (the phase-2 export or any HF BERT directory).

Recipe of Google's/NVIDIA's run_squad.py: loss = mean of start and end cross-entropy, AdamW (no weight decay on
biases and LayerNorm), linear warmup then linear decay, gradient clipping at 1.0, bf16 autocast on GPUs.
DDP over torchrun/srun ranks like pretraining; checkpoints in `--run-dir` (resumed automatically, SIGTERM/SIGUSR1
checkpoint and exit). The result is an HF directory (BertForQuestionAnswering names: `bert.*`, `qa_outputs.*`).

    python -m workflow.squad.finetune --init results/pretrain/phase2/model \
        --features data/squad/train_features.npz --output results/squad/model --run-dir runs/squad
"""
import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from workflow.train import checkpoint, distributed
from workflow.atomic import atomic_path, write_text
from workflow.cli import UserError, run
from workflow.train.model import BertConfig, BertModel, load_pretrained, load_weights, save_pretrained
from workflow.train.precision import autocast, resolve_precision
from workflow.squad.data import load_features

log = logging.getLogger(__name__)


class BertForQuestionAnswering(nn.Module):
    """BERT encoder + a linear layer giving start and end logits for every token."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.bert = BertModel(config)
        self.bert.pooler.requires_grad_(False)  # unused by QA; frozen so DDP does not wait for its gradients
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        nn.init.normal_(self.qa_outputs.weight, std=config.initializer_range)
        nn.init.zeros_(self.qa_outputs.bias)

    def forward(self, input_ids, token_type_ids, attention_mask):
        sequence_output, _ = self.bert(input_ids, token_type_ids, attention_mask)
        logits = self.qa_outputs(sequence_output)
        return logits[..., 0], logits[..., 1]


def qa_loss(start_logits, end_logits, start_positions, end_positions):
    """Mean of the start and end cross-entropies (positions outside the sequence clamped, as HF does)."""
    length = start_logits.shape[1]
    start = F.cross_entropy(start_logits.float(), start_positions.clamp(0, length - 1))
    end = F.cross_entropy(end_logits.float(), end_positions.clamp(0, length - 1))
    return (start + end) / 2


def load_qa_model(directory: str | Path, require_head: bool = False) -> tuple[BertForQuestionAnswering, BertConfig]:
    """A QA model from an HF BERT directory; the head is freshly initialised unless present (require_head: must be)."""
    config, state = load_pretrained(directory)
    model = BertForQuestionAnswering(config)
    missing, _unexpected = load_weights(model, state)
    encoder_missing = [k for k in missing if not k.startswith(("qa_outputs.", "bert.pooler."))]
    if encoder_missing:
        raise UserError(f"{directory}: weights lack {len(encoder_missing)} encoder tensors, e.g. {encoder_missing[0]}")
    if require_head and any(k.startswith("qa_outputs.") for k in missing):
        raise UserError(f"{directory}: no question-answering head (qa_outputs.*): not a fine-tuned SQuAD model")
    return model, config


def optimizer_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on weight matrices only: not on biases and LayerNorm parameters (BERT's recipe)."""
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        (no_decay if name.endswith("bias") or "LayerNorm" in name else decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def linear_warmup_decay(step: int, total_steps: int, warmup_proportion: float) -> float:
    """LR multiplier: linear 0 -> 1 over the warmup steps, then linear 1 -> 0 at total_steps."""
    warmup = warmup_proportion * total_steps
    if step < warmup:
        return min(1.0, (step + 1) / warmup)  # a fractional warmup must not overshoot the peak lr
    return max(0.0, (total_steps - step) / max(1.0, total_steps - warmup))


def batch_indices(step: int, n: int, batch_size: int, steps_per_epoch: int, seed: int) -> np.ndarray:
    """Feature indices of global batch `step`: a fresh permutation per epoch, wrapped to fill the last batch."""
    epoch, position = divmod(step, steps_per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return order[np.arange(position * batch_size, (position + 1) * batch_size) % n]


def finetune(
    init: str | Path,
    features_path: str | Path,
    output: str | Path,
    run_dir: str | Path,
    vocab: str | Path | None = None,
    metrics_path: str | Path | None = None,
    learning_rate: float = 3e-5,
    epochs: float = 2.0,
    batch_size: int = 32,
    micro_batch_size: int = 8,
    warmup_proportion: float = 0.1,
    weight_decay: float = 0.01,
    seed: int = 12345,
    precision: str = "auto",
    checkpoint_every: int = 500,
    keep_checkpoints: int = 2,
    log_every: int = 10,
    device: str = "auto",
) -> int:
    """Fine-tune; write the HF directory `output` (rank 0). Returns 0, or 128+signal when stopped by a signal."""
    env = distributed.setup(device)
    try:
        return _finetune(env, init, features_path, output, run_dir, vocab, metrics_path, learning_rate, epochs,
                         batch_size, micro_batch_size, warmup_proportion, weight_decay, seed, precision,
                         checkpoint_every, keep_checkpoints, log_every)
    finally:
        distributed.cleanup()


def _finetune(env, init, features_path, output, run_dir, vocab, metrics_path, learning_rate, epochs, batch_size,
              micro_batch_size, warmup_proportion, weight_decay, seed, precision, checkpoint_every,
              keep_checkpoints, log_every) -> int:
    per_step = micro_batch_size * env.world_size
    if batch_size % per_step:
        raise UserError(f"squad batch_size {batch_size} is not a multiple of micro_batch_size {micro_batch_size} "
                        f"x {env.world_size} processes")
    accumulation = batch_size // per_step
    features = load_features(features_path)
    if "start_positions" not in features:
        raise UserError(f"{features_path}: no answer labels (not SQuAD features)")
    n = len(features["input_ids"])
    steps_per_epoch = math.ceil(n / batch_size)
    total_steps = max(1, math.ceil(steps_per_epoch * epochs))

    torch.manual_seed(seed)
    model, config = load_qa_model(init)
    if int(features["input_ids"].max()) >= config.vocab_size:
        raise UserError(f"{features_path}: token ids reach {int(features['input_ids'].max())}, beyond the model's "
                        f"vocab_size {config.vocab_size} (features made with another vocab?)")
    if features["input_ids"].shape[1] > config.max_position_embeddings:
        raise UserError(f"{features_path}: max_seq_length {features['input_ids'].shape[1]} exceeds the model's "
                        f"max_position_embeddings {config.max_position_embeddings}")
    model.to(env.device)
    if env.distributed:  # own dropout masks per rank; DDP broadcasts rank 0's weights
        torch.manual_seed(seed + env.rank)
    precision = resolve_precision(precision, env.device, "squad.precision")
    optimizer = torch.optim.AdamW(optimizer_groups(model, weight_decay), lr=learning_rate, betas=(0.9, 0.999),
                                  eps=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: linear_warmup_decay(step, total_steps, warmup_proportion))
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")

    # A checkpoint belongs to this run only if the run's defining settings and inputs agree (a re-made
    # features file has a new mtime, so Snakemake rerunning featurize also restarts fine-tuning).
    fingerprint = {"init": str(Path(init).resolve()), "features": str(Path(features_path).resolve()),
                   "features_mtime_ns": os.stat(features_path).st_mtime_ns, "n_features": n,
                   "total_steps": total_steps, "batch_size": batch_size, "learning_rate": learning_rate,
                   "warmup_proportion": warmup_proportion, "weight_decay": weight_decay, "seed": seed,
                   "world_size": env.world_size}
    step = 0
    state, path = checkpoint.load_latest_checkpoint(run_dir)
    if state is not None and state.get("fingerprint") == json.dumps(fingerprint, sort_keys=True):
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        checkpoint.set_rng_state(state["rng"][env.rank] if isinstance(state["rng"], list) else state["rng"])
        step = int(state["step"])
        log.info("resumed from %s at step %d/%d", path, step, total_steps)
    elif state is not None:
        log.warning("ignoring checkpoint %s: it belongs to a run with other settings", path)
        if env.is_main:
            shutil.rmtree(run_dir, ignore_errors=True)

    train_model = model
    if env.distributed:
        train_model = nn.parallel.DistributedDataParallel(
            model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
    # compact int32/int8 arrays, widened per batch (SQuAD train in int64 would take ~1 GB per rank)
    tensors = {k: torch.from_numpy(features[k]) for k in
               ("input_ids", "token_type_ids", "attention_mask", "start_positions", "end_positions")}
    metrics_file = None
    if env.is_main and metrics_path is not None:
        partial = Path(metrics_path).with_name(Path(metrics_path).name + ".partial")
        partial.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if step and partial.is_file():  # drop lines logged after the checkpoint we resume from
            kept = [line for line in partial.read_text().splitlines(keepends=True)
                    if line.strip() and json.loads(line)["step"] <= step]
        metrics_file = open(partial, "w")
        metrics_file.writelines(kept)
    log.info("fine-tuning %d features, %d steps (%d per epoch), batch %d = %d x %d ranks x %d accumulation, %s",
             n, total_steps, steps_per_epoch, batch_size, micro_batch_size, env.world_size, accumulation, precision)

    def save(at_step):
        rng = checkpoint.rng_state()
        if env.distributed:
            rngs = [None] * env.world_size
            torch.distributed.all_gather_object(rngs, rng)
            rng = rngs
        if env.is_main:
            checkpoint.save_checkpoint(run_dir, at_step, {
                "step": at_step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "rng": rng,
                "fingerprint": json.dumps(fingerprint, sort_keys=True)}, keep_checkpoints)

    train_model.train()
    started, window_loss, window_count = time.time(), 0.0, 0
    with checkpoint.StopSignals() as stop:
        while step < total_steps:
            indices = batch_indices(step, n, batch_size, steps_per_epoch, seed)
            mine = indices[env.rank * accumulation * micro_batch_size:(env.rank + 1) * accumulation * micro_batch_size]
            loss_sum = torch.zeros((), device=env.device)
            for micro in range(accumulation):
                part = mine[micro * micro_batch_size:(micro + 1) * micro_batch_size]
                batch = {k: v[part].long().to(env.device, non_blocking=True) for k, v in tensors.items()}
                sync = micro == accumulation - 1 or not env.distributed
                context = train_model.no_sync() if not sync else contextlib.nullcontext()
                with context:
                    with autocast(env.device, precision):
                        start_logits, end_logits = train_model(
                            batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
                    loss = qa_loss(start_logits, end_logits, batch["start_positions"], batch["end_positions"])
                    scaler.scale(loss / accumulation).backward()
                loss_sum += loss.detach()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            loss_value = distributed.all_reduce_(loss_sum / accumulation).item() / env.world_size
            window_loss, window_count = window_loss + loss_value, window_count + 1
            if metrics_file is not None and (step % log_every == 0 or step == total_steps):
                elapsed = time.time() - started
                record = {"step": step, "epoch": step / steps_per_epoch, "loss": window_loss / window_count,
                          "lr": scheduler.get_last_lr()[0], "grad_norm": float(grad_norm),
                          "seq_per_s": window_count * batch_size / max(elapsed, 1e-9)}
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
                log.info("step %d/%d loss %.4f lr %.2e", step, total_steps, record["loss"], record["lr"])
                started, window_loss, window_count = time.time(), 0.0, 0
            checkpoint.fail_at_step(step)
            stopping = stop.received is not None
            if env.distributed:  # every rank stops together when any rank got the signal
                flag = distributed.all_reduce_(torch.tensor(float(stopping), device=env.device), "max")
                stopping = bool(flag.item())
            if stopping or (step % checkpoint_every == 0 and step < total_steps):
                save(step)
            if stopping:
                log.warning("stopped by a signal at step %d; rerun to resume from %s", step, run_dir)
                if metrics_file is not None:
                    metrics_file.close()
                return stop.exit_code() if stop.received else 143

    if env.is_main:
        with atomic_path(output) as temporary:
            vocab_path = Path(vocab) if vocab else Path(init) / "vocab.txt"
            save_pretrained(model, config, vocab_path if vocab_path.is_file() else None, temporary)
            config_json = json.loads((temporary / "config.json").read_text())
            config_json["architectures"] = ["BertForQuestionAnswering"]
            write_text(temporary / "config.json", json.dumps(config_json, indent=2, sort_keys=True) + "\n")
        if metrics_file is not None:
            metrics_file.close()
            Path(metrics_file.name).replace(metrics_path)
        shutil.rmtree(run_dir, ignore_errors=True)  # scratch: the finished model supersedes the checkpoints
        log.info("fine-tuned model -> %s", output)
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--init", required=True, help="HF BERT directory to start from (phase-2 export)")
    parser.add_argument("--features", required=True, help="training features .npz (squad_data --training)")
    parser.add_argument("--output", required=True, help="fine-tuned HF model directory")
    parser.add_argument("--run-dir", required=True, help="checkpoints (resumed automatically)")
    parser.add_argument("--vocab", default=None, help="vocab.txt copied into the output (default: the init's)")
    parser.add_argument("--metrics", default=None, help="JSONL of step, epoch, loss, lr, grad_norm, seq_per_s")
    parser.add_argument("--learning-rate", type=float, default=3e-5)
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch size")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="per-process batch size")
    parser.add_argument("--warmup-proportion", type=float, default=0.1)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--precision", choices=["auto", "bf16", "fp16", "fp32"], default="auto")
    parser.add_argument("--checkpoint-every", type=int, default=500)
    parser.add_argument("--keep-checkpoints", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads of torch (the rule's threads)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    code = finetune(args.init, args.features, args.output, args.run_dir, args.vocab, args.metrics,
                    args.learning_rate, args.epochs, args.batch_size, args.micro_batch_size, args.warmup_proportion,
                    args.weight_decay, args.seed, args.precision, args.checkpoint_every, args.keep_checkpoints,
                    args.log_every)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    run(main)
