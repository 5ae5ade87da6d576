"""Sentence (pair) classification and regression fine-tuning: a head on a pretrained encoder, its loss, its training
task and the driver's job, shared by the GLUE presets (workflow.glue.finetune) and the config's tasks
(workflow.tasks.run).

Recipe of Google's run_classifier.py / HF's run_glue: the pooled [CLS] output, dropout, one linear layer;
cross-entropy (a regression: mean squared error on the score), AdamW (no weight decay on biases and LayerNorm), linear
warmup then linear decay, gradient clipping. Defaults: seq 128, lr 2e-5, 3 epochs, batch 32, warmup 0.1. The loop is
the training engine's (workflow/train/engine.py: DDP, accumulation, elastic resume from a run directory, refusal of
changed settings, SIGTERM/SIGUSR1 checkpoint and exit); this module supplies the task. The result is an HF directory,
HF's <Family>ForSequenceClassification of the init's family, in the family's layout (workflow/train/models/heads.py).
"""
from dataclasses import dataclass
from pathlib import Path

import torch.nn.functional as F

from workflow.classify.task import SentenceTask
from workflow.cli import UserError
from workflow.train import finetune as finetuning
from workflow.train.finetune import FeatureTask, FinetuneJob, load_head
from workflow.train.models.heads import SEQUENCE_CLASSIFICATION, FamilyHead


@dataclass
class ClassifierSettings(finetuning.FinetuneSettings):
    """BERT fine-tuning's settings with the classification defaults (BERT paper: 2e-5, 3 epochs)."""

    learning_rate: float = 2e-5
    epochs: float = 3.0
    micro_batch_size: int = 32


class ForSequenceClassification(FamilyHead):
    """`num_labels` logits per sequence (1: a regression): HF's <Family>ForSequenceClassification on the directory's
    family's encoder, in the family's layout (workflow/train/models/heads.py)."""

    kind = SEQUENCE_CLASSIFICATION


SEQUENCE_CLASSIFIERS = ForSequenceClassification  # load_classifier's default head: every family's sequence classifier


def classification_loss(logits, labels, reduction="mean"):
    """Cross-entropy over classes; a single output is a regression (mean squared error), as HF's run_glue."""
    if logits.shape[-1] == 1:
        return F.mse_loss(logits.float().squeeze(-1), labels.float(), reduction=reduction)
    return F.cross_entropy(logits.float(), labels, reduction=reduction)


def load_classifier(directory: str | Path, num_labels: int, require_head: bool = False, heads=SEQUENCE_CLASSIFIERS):
    """(model, config): a classifier (`heads`: the sequence or the token classification head) from an HF directory
    of any family; the head is freshly initialised unless present (require_head: must be)."""
    return load_head(directory, heads, num_labels, require_head)


class ClassificationTask(FeatureTask):
    """Sentence (pair) classification on the training features (the global order of FeatureTask)."""

    def __init__(self, features: dict, batch_size: int, seed: int):
        super().__init__(features, ("input_ids", "token_type_ids", "attention_mask"), ("labels",), batch_size, seed)

    def loss(self, model, batch: dict, totals: dict) -> dict:
        logits = model(*self.inputs(batch))
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


def job_of(task: SentenceTask, config_key: str | None = None, batch_key: str | None = None) -> FinetuneJob:
    """The driver's view of a sentence task: its features checked, its head, its exported label names. Its config
    keys are a GLUE preset's (glue.<name>) unless named (a task of the config's tasks section: tasks.<name>)."""

    def make_task(features: dict, features_path: Path, s: ClassifierSettings) -> ClassificationTask:
        if "labels" not in features:
            raise UserError(f"{features_path}: no labels (not classification features)")
        if (features["labels"].dtype.kind == "f") != (task.labels is None):
            raise UserError(f"{features_path}: labels of another task than {task.name} (features of another task?)")
        return ClassificationTask(features, s.batch_size, s.seed)

    labels = task.labels or ("score",)
    return FinetuneJob(
        config_key=config_key or f"glue.{task.name}", section="glue",
        batch_key=batch_key or f"glue.overrides.{task.name}", unit="examples",
        make_task=make_task, load_model=lambda init: load_classifier(init, task.num_labels),
        fingerprint={"task": task.name}, config_json=dict(
            finetuning_task=task.name,
            id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)},
            problem_type="regression" if task.labels is None else "single_label_classification"))


def finetune(task: SentenceTask, init, features_path, output, run_dir, settings: ClassifierSettings | None = None,
             vocab=None, metrics_path=None, device: str = "auto", threads: int | None = None) -> int:
    """Fine-tune; write the HF directory `output` (rank 0). Returns 0, or 128+signal when stopped by a signal."""
    return finetuning.finetune(job_of(task), init, features_path, output, run_dir, settings or ClassifierSettings(),
                               vocab, metrics_path, device, threads)
