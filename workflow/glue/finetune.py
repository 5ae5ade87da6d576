"""GLUE fine-tuning: a sequence-classification head (a regression head for STS-B) on a pretrained BERT.

Recipe of Google's run_classifier.py / HF's run_glue: the pooled [CLS] output, dropout, one linear layer;
cross-entropy (STS-B: mean squared error on the score), AdamW (no weight decay on biases and LayerNorm), linear warmup
then linear decay, gradient clipping. Defaults: seq 128, lr 2e-5, 3 epochs, batch 32, warmup 0.1, each overridable per
task (config glue.overrides). The loop is the training engine's (workflow/train/engine.py: DDP, accumulation, elastic
resume from `--run-dir`, refusal of changed settings, SIGTERM/SIGUSR1 checkpoint and exit); this module supplies the
task. The result is an HF directory (BertForSequenceClassification names: `bert.*`, `classifier.*`).

    python -m workflow.glue.finetune --config '{"seed": 12345, "glue": {...}}' --task MRPC \
        --init results/pretrain/phase2/model --features data/glue/MRPC/train_features.npz \
        --output results/glue/MRPC/model --metrics results/glue/MRPC/finetune_metrics.jsonl --run-dir runs/glue/MRPC
"""
import logging
import math
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from workflow.cli import UserError, run
from workflow.glue.data import GlueTask, task_of
from workflow.squad.data import load_features
from workflow.squad.finetune import FinetuneSettings as SquadFinetuneSettings
from workflow.squad.finetune import SquadTask, adamw_with_warmup, check_features_fit
from workflow.train import checkpoint, distributed
from workflow.train.engine import (LoopSettings, accumulation_steps, export_finetuned, finetune_parser,
                                   set_threads, train)
from workflow.train.model import BertConfig, BertModel, load_pretrained, load_weights
from workflow.train.precision import resolve_precision

log = logging.getLogger(__name__)
# The settings that change the fine-tuned model (its fingerprint: a change refuses to resume).
RECIPE_KEYS = ("learning_rate", "epochs", "batch_size", "warmup_proportion", "weight_decay", "max_grad_norm")


@dataclass
class FinetuneSettings(SquadFinetuneSettings):
    """SQuAD's fine-tuning settings with GLUE's defaults (BERT paper: 2e-5, 3 epochs)."""

    learning_rate: float = 2e-5
    epochs: float = 3.0
    micro_batch_size: int = 32

    @classmethod
    def from_config(cls, config: dict, task: str) -> "FinetuneSettings":
        """From the config sections seed and glue (as validated by the schema), glue.overrides.<task> applied."""
        names = [f.name for f in fields(cls) if f.name != "seed"]
        try:
            glue = config["glue"]
            merged = {**{key: glue[key] for key in names}, **glue.get("overrides", {}).get(task, {})}
            return cls(seed=config["seed"], **{key: merged[key] for key in names})
        except (KeyError, TypeError) as error:
            raise UserError(f"config: missing key glue.{error.args[0] if error.args else error} "
                            "(see config.schema.yaml)") from None


class BertForSequenceClassification(nn.Module):
    """BERT encoder + dropout + a linear layer on the pooled [CLS] output: `num_labels` logits (1: a regression)."""

    def __init__(self, config: BertConfig, num_labels: int):
        super().__init__()
        self.config, self.num_labels = config, num_labels
        self.bert = BertModel(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, num_labels)
        nn.init.normal_(self.classifier.weight, std=config.initializer_range)
        nn.init.zeros_(self.classifier.bias)

    def forward(self, input_ids, token_type_ids, attention_mask):
        _, pooled = self.bert(input_ids, token_type_ids, attention_mask)
        return self.classifier(self.dropout(pooled))


def classification_loss(logits, labels, reduction="mean"):
    """Cross-entropy over classes; a single output is a regression (mean squared error), as HF's run_glue."""
    if logits.shape[-1] == 1:
        return F.mse_loss(logits.float().squeeze(-1), labels.float(), reduction=reduction)
    return F.cross_entropy(logits.float(), labels, reduction=reduction)


def load_classifier(directory: str | Path, num_labels: int, require_head: bool = False):
    """A classifier from an HF BERT directory; the head is freshly initialised unless present (require_head: must be)."""
    config, state = load_pretrained(directory)
    if "classifier.weight" in state and state["classifier.weight"].shape[0] != num_labels:
        if require_head:
            raise UserError(f"{directory}: its classifier has {state['classifier.weight'].shape[0]} outputs, "
                            f"the task {num_labels}")
        state = {k: v for k, v in state.items() if not k.startswith("classifier.")}  # another task's head
    model = BertForSequenceClassification(config, num_labels)
    missing, _unexpected = load_weights(model, state)
    encoder_missing = [k for k in missing if not k.startswith("classifier.")]
    if encoder_missing:
        raise UserError(f"{directory}: weights lack {len(encoder_missing)} encoder tensors, e.g. {encoder_missing[0]}")
    if require_head and missing:
        raise UserError(f"{directory}: no classification head (classifier.*): not a fine-tuned GLUE model")
    return model, config


class ClassificationTask(SquadTask):
    """Sentence (pair) classification on the training features; the global order of SquadTask (a permutation per
    epoch), the tensors and the loss its own."""

    def __init__(self, features: dict, batch_size: int, seed: int):
        self.tensors = {k: torch.from_numpy(features[k]) for k in ("input_ids", "token_type_ids", "attention_mask")}
        self.labels = torch.from_numpy(features["labels"])
        self.n = len(self.labels)
        self.batch_size = batch_size
        self.steps_per_epoch = math.ceil(self.n / batch_size)
        self.seed = seed

    def read(self, start: int, count: int) -> dict:
        rows = torch.from_numpy(self.order_of(np.arange(start, start + count), self.n, self.batch_size,
                                              self.steps_per_epoch, self.seed))
        return {**{k: v[rows].long() for k, v in self.tensors.items()}, "labels": self.labels[rows]}

    def loss(self, model, batch: dict, totals: dict) -> dict:
        logits = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        share = classification_loss(logits, batch["labels"], "sum")
        out = {"loss": share / totals["sequences"]}
        if logits.shape[-1] > 1:
            out["correct"] = (logits.argmax(-1) == batch["labels"]).sum().float()
        return out

    def metrics(self, sums: dict, steps: int, sequences: int, elapsed: float, step: int) -> dict:
        line = {"epoch": step / self.steps_per_epoch, "loss": sums["loss"] / steps}
        if "correct" in sums:
            line["accuracy"] = sums["correct"] / sequences
        return line


def _digest(path: Path) -> str:
    return checkpoint.file_sha256(path)[:16] if path.is_file() else str(path)


def finetune(task: GlueTask, init, features_path, output, run_dir, settings: FinetuneSettings | None = None,
             vocab=None, metrics_path=None, device: str = "auto", threads: int | None = None) -> int:
    """Fine-tune; write the HF directory `output` (rank 0). Returns 0, or 128+signal when stopped by a signal."""
    set_threads(threads)
    env = distributed.setup(device)
    try:
        return _finetune(env, task, Path(init), Path(features_path), Path(output), Path(run_dir),
                         settings or FinetuneSettings(), vocab, metrics_path)
    finally:
        distributed.cleanup()


def _finetune(env, task: GlueTask, init: Path, features_path: Path, output: Path, run_dir: Path,
              s: FinetuneSettings, vocab, metrics_path) -> int:
    key = f"glue.overrides.{task.name}"  # where a per-task fix goes
    accumulation_steps(s.batch_size, s.micro_batch_size, env.world_size, key, "batch_size")
    features = load_features(features_path)
    if "labels" not in features:
        raise UserError(f"{features_path}: no labels (not GLUE features)")
    if (features["labels"].dtype.kind == "f") != (task.labels is None):
        raise UserError(f"{features_path}: labels of another task than {task.name} (features of another task?)")
    data = ClassificationTask(features, s.batch_size, s.seed)
    total_steps = max(1, math.ceil(data.steps_per_epoch * s.epochs))

    torch.manual_seed(s.seed)
    model, config = load_classifier(init, task.num_labels)
    check_features_fit(features, features_path, config)
    model.to(env.device)
    if env.distributed:  # own dropout masks per rank; weights stay identical
        torch.manual_seed(s.seed + env.rank)
    precision = resolve_precision(s.precision, env.device, "glue.precision")
    optimizer, scheduler = adamw_with_warmup(model, s, total_steps)
    fingerprint = {**{f"glue.{k}": getattr(s, k) for k in RECIPE_KEYS}, "task": task.name, "seed": s.seed,
                   "init weights": _digest(init / "model.safetensors"),
                   "training features": f"{data.n} examples, sha256 {_digest(features_path)}"}
    log.info("%s: fine-tuning on %d examples, %d steps (%d per epoch)", task.name, data.n, total_steps,
             data.steps_per_epoch)
    loop = LoopSettings(config_key=f"glue.{task.name}", run_dir=str(run_dir), total_steps=total_steps,
                        global_batch_size=s.batch_size, micro_batch_size=s.micro_batch_size, precision=precision,
                        clip_grad_norm=s.max_grad_norm, checkpoint_every=s.checkpoint_every,
                        keep_checkpoints=s.keep_checkpoints, log_every=s.log_every, seed=s.seed,
                        global_batch_key="batch_size")
    outcome = train(env, model, optimizer, scheduler, data, loop, fingerprint)
    if outcome.stopped:
        return outcome.stopped

    labels = task.labels or ("score",)
    export_finetuned(env, model, config, init, vocab, output, metrics_path, run_dir, dict(
        architectures=["BertForSequenceClassification"], finetuning_task=task.name,
        id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)},
        problem_type="regression" if task.labels is None else "single_label_classification"))
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    parser = finetune_parser(__doc__.split("\n\n")[0], "seed and glue", "workflow.glue.data",
                             "step, epoch, loss, accuracy, lr, grad_norm, seq_per_s")
    parser.add_argument("--task", required=True, help="GLUE task name (CoLA, SST-2, MRPC, STS-B, QQP, MNLI, ...)")
    args = parser.parse_args(argv)
    task = task_of(args.task)
    code = finetune(task, args.init, args.features, args.output, args.run_dir,
                    FinetuneSettings.from_config(args.config, task.name), args.vocab, args.metrics, args.device,
                    args.threads)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    run(main)
