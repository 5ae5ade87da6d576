"""SQuAD fine-tuning: a span-prediction head on a pretrained BERT (the phase-2 export or any HF BERT directory).

Recipe of Google's/NVIDIA's run_squad.py: loss = mean of start and end cross-entropy, AdamW (no weight decay on
biases and LayerNorm), linear warmup then linear decay, gradient clipping (squad.max_grad_norm), bf16 autocast on GPUs.
The loop is the training engine's (workflow/train/engine.py: DDP, accumulation, elastic resume from `--run-dir`,
refusal of changed settings, SIGTERM/SIGUSR1 checkpoint and exit); this module supplies the task. The result is an
HF directory (BertForQuestionAnswering names: `bert.*`, `qa_outputs.*`); the run directory is removed once it is
written (the model supersedes its checkpoints).

    python -m workflow.squad.finetune --config '{"seed": 12345, "squad": {...}}' --init results/pretrain/phase2/model \
        --features data/squad/train_features.npz --output results/squad/model --metrics ... --run-dir runs/squad
"""
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from workflow.cli import UserError, run
from workflow.squad.data import load_features
from workflow.train import checkpoint, distributed
from workflow.train.engine import (LoopSettings, accumulation_steps, export_finetuned, finetune_parser,
                                   set_threads, train)
from workflow.train.lamb import param_groups
from workflow.train.model import BertConfig, BertModel, load_pretrained, load_weights
from workflow.train.precision import resolve_precision

log = logging.getLogger(__name__)
# The `squad` config keys fine-tuning reads (the others belong to featurizing and prediction).
SETTING_KEYS = ("learning_rate", "epochs", "batch_size", "micro_batch_size", "warmup_proportion", "weight_decay",
                "max_grad_norm", "precision", "checkpoint_every", "keep_checkpoints", "log_every")


@dataclass
class FinetuneSettings:
    learning_rate: float = 3e-5
    epochs: float = 2.0
    batch_size: int = 32
    micro_batch_size: int = 8
    warmup_proportion: float = 0.1
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    precision: str = "auto"
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    log_every: int = 10
    seed: int = 12345

    @classmethod
    def from_config(cls, config: dict) -> "FinetuneSettings":
        """From the config sections seed and squad (as validated by the schema)."""
        try:
            return cls(seed=config["seed"], **{key: config["squad"][key] for key in SETTING_KEYS})
        except (KeyError, TypeError) as error:
            raise UserError(f"config: missing key squad.{error.args[0] if error.args else error} "
                            "(see config.schema.yaml)") from None


def check_features_fit(features: dict, features_path, config: BertConfig) -> None:
    """Features a fine-tune can feed this model: ids within its vocab, rows within its position embeddings."""
    if int(features["input_ids"].max()) >= config.vocab_size:
        raise UserError(f"{features_path}: token ids reach {int(features['input_ids'].max())}, beyond the model's "
                        f"vocab_size {config.vocab_size} (features made with another vocab?)")
    if features["input_ids"].shape[1] > config.max_position_embeddings:
        raise UserError(f"{features_path}: max_seq_length {features['input_ids'].shape[1]} exceeds the model's "
                        f"max_position_embeddings {config.max_position_embeddings}")


def adamw_with_warmup(model, s: FinetuneSettings, total_steps: int):
    """(optimizer, scheduler) of BERT fine-tuning: AdamW, linear warm-up then linear decay to 0."""
    optimizer = torch.optim.AdamW(param_groups(model, s.weight_decay), lr=s.learning_rate, betas=(0.9, 0.999),
                                  eps=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: linear_warmup_decay(step, total_steps, s.warmup_proportion))
    return optimizer, scheduler


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


def qa_loss(start_logits, end_logits, start_positions, end_positions, reduction="mean"):
    """Mean (or sum) over sequences of the mean of start and end cross-entropies (positions outside the sequence
    clamped, as HF does)."""
    length = start_logits.shape[1]
    start = F.cross_entropy(start_logits.float(), start_positions.clamp(0, length - 1), reduction=reduction)
    end = F.cross_entropy(end_logits.float(), end_positions.clamp(0, length - 1), reduction=reduction)
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


def linear_warmup_decay(step: int, total_steps: int, warmup_proportion: float) -> float:
    """LR multiplier: linear 0 -> 1 over the warmup steps, then linear 1 -> 0 at total_steps."""
    warmup = warmup_proportion * total_steps
    if step < warmup:
        return min(1.0, (step + 1) / warmup)  # a fractional warmup must not overshoot the peak lr
    return max(0.0, (total_steps - step) / max(1.0, total_steps - warmup))


def batch_indices(step: int, n: int, batch_size: int, steps_per_epoch: int, seed: int) -> np.ndarray:
    """Feature indices of global batch `step`: a fresh permutation per epoch, wrapped to fill the last batch."""
    return SquadTask.order_of(np.arange(step * batch_size, (step + 1) * batch_size), n, batch_size,
                              steps_per_epoch, seed)


class SquadTask:
    """Span prediction on the training features; global order: a permutation per epoch of ceil(n / batch) batches."""

    def __init__(self, features: dict, batch_size: int, seed: int):
        # compact int32/int8 arrays, widened per batch (SQuAD train in int64 would take ~1 GB per rank)
        self.tensors = {k: torch.from_numpy(features[k]) for k in
                        ("input_ids", "token_type_ids", "attention_mask", "start_positions", "end_positions")}
        self.n = len(features["input_ids"])
        self.batch_size = batch_size
        self.steps_per_epoch = math.ceil(self.n / batch_size)
        self.seed = seed

    @staticmethod
    def order_of(positions: np.ndarray, n: int, batch_size: int, steps_per_epoch: int, seed: int) -> np.ndarray:
        epochs, within = np.divmod(positions, steps_per_epoch * batch_size)
        out = np.empty(len(positions), dtype=np.int64)
        for epoch in np.unique(epochs):
            order = np.random.default_rng([seed, int(epoch)]).permutation(n)
            out[epochs == epoch] = order[within[epochs == epoch] % n]
        return out

    def read(self, start: int, count: int) -> dict:
        rows = torch.from_numpy(self.order_of(np.arange(start, start + count), self.n, self.batch_size,
                                              self.steps_per_epoch, self.seed))
        return {k: v[rows].long() for k, v in self.tensors.items()}

    def count(self, batch: dict) -> dict:
        return {"sequences": torch.tensor(batch["input_ids"].shape[0], device=batch["input_ids"].device)}

    def loss(self, model, batch: dict, totals: dict) -> dict:
        start_logits, end_logits = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        share = qa_loss(start_logits, end_logits, batch["start_positions"], batch["end_positions"], "sum")
        return {"loss": share / totals["sequences"]}

    def metrics(self, sums: dict, steps: int, sequences: int, elapsed: float, step: int) -> dict:
        return {"epoch": step / self.steps_per_epoch, "loss": sums["loss"] / steps}


def _digest(path: Path) -> str:
    return checkpoint.file_sha256(path)[:16] if path.is_file() else str(path)


def finetune(init, features_path, output, run_dir, settings: FinetuneSettings | None = None, vocab=None,
             metrics_path=None, device: str = "auto", threads: int | None = None) -> int:
    """Fine-tune; write the HF directory `output` (rank 0). Returns 0, or 128+signal when stopped by a signal."""
    set_threads(threads)
    env = distributed.setup(device)
    try:
        return _finetune(env, Path(init), Path(features_path), Path(output), Path(run_dir),
                         settings or FinetuneSettings(), vocab, metrics_path)
    finally:
        distributed.cleanup()


def _finetune(env, init: Path, features_path: Path, output: Path, run_dir: Path, s: FinetuneSettings, vocab,
              metrics_path) -> int:
    accumulation_steps(s.batch_size, s.micro_batch_size, env.world_size, "squad", "batch_size")
    features = load_features(features_path)
    if "start_positions" not in features:
        raise UserError(f"{features_path}: no answer labels (not SQuAD features)")
    task = SquadTask(features, s.batch_size, s.seed)
    total_steps = max(1, math.ceil(task.steps_per_epoch * s.epochs))

    torch.manual_seed(s.seed)
    model, config = load_qa_model(init)
    check_features_fit(features, features_path, config)
    model.to(env.device)
    if env.distributed:  # own dropout masks per rank; weights stay identical
        torch.manual_seed(s.seed + env.rank)
    precision = resolve_precision(s.precision, env.device, "squad.precision")
    optimizer, scheduler = adamw_with_warmup(model, s, total_steps)
    fingerprint = {**{f"squad.{k}": getattr(s, k) for k in ("learning_rate", "epochs", "batch_size",
                                                            "warmup_proportion", "weight_decay", "max_grad_norm")},
                   "seed": s.seed, "init weights": _digest(init / "model.safetensors"),
                   "training features": f"{task.n} features, sha256 {_digest(features_path)}"}
    log.info("fine-tuning %d features, %d steps (%d per epoch)", task.n, total_steps, task.steps_per_epoch)
    loop = LoopSettings(config_key="squad", run_dir=str(run_dir), total_steps=total_steps,
                        global_batch_size=s.batch_size, micro_batch_size=s.micro_batch_size, precision=precision,
                        clip_grad_norm=s.max_grad_norm, checkpoint_every=s.checkpoint_every,
                        keep_checkpoints=s.keep_checkpoints, log_every=s.log_every, seed=s.seed,
                        global_batch_key="batch_size")
    outcome = train(env, model, optimizer, scheduler, task, loop, fingerprint)
    if outcome.stopped:
        return outcome.stopped

    export_finetuned(env, model, config, init, vocab, output, metrics_path, run_dir,
                     {"architectures": ["BertForQuestionAnswering"]})
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    args = finetune_parser(__doc__.split("\n\n")[0], "seed and squad", "squad_data --training",
                           "step, epoch, loss, lr, grad_norm, seq_per_s").parse_args(argv)
    code = finetune(args.init, args.features, args.output, args.run_dir, FinetuneSettings.from_config(args.config),
                    args.vocab, args.metrics, args.device, args.threads)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    run(main)
