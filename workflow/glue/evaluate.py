"""GLUE evaluation: predict a fine-tuned classifier on a task's dev set(s) and score it with the task's own metric.

The metrics of the GLUE benchmark's reference (which calls scikit-learn/scipy), written in numpy: Matthews correlation
(CoLA), accuracy and F1 of the positive class (MRPC, QQP), Pearson and Spearman correlation (STS-B), accuracy
otherwise. Values are fractions (0..1; correlations -1..1). eval.json:
`{"task": "MNLI", "splits": {"dev_matched": {"accuracy": ..., "examples": ...}, "dev_mismatched": {...}}}`.

    python -m workflow.glue.evaluate --task MRPC --model results/glue/MRPC/model \
        --features dev=data/glue/MRPC/dev_features.npz --output results/glue/MRPC/eval.json
"""
import argparse
import logging
from typing import Sequence

import numpy as np

from workflow.atomic import write_json
from workflow.cli import UserError, phase_directory, run
from workflow.glue.data import GlueTask, task_of
from workflow.data.features import load_features
from workflow.train.precision import autocast, resolve_precision

log = logging.getLogger(__name__)


def accuracy(predictions: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean(predictions == labels))


def f1(predictions: np.ndarray, labels: np.ndarray) -> float:
    """F1 of class 1 (0 when it is neither predicted nor present, as scikit-learn's f1_score)."""
    tp = np.sum((predictions == 1) & (labels == 1))
    wrong = np.sum(predictions != labels)
    return float(2 * tp / (2 * tp + wrong)) if tp + wrong else 0.0


def matthews_corr(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Matthews correlation of binary predictions (0 when a marginal is constant, as scikit-learn's)."""
    tp = float(np.sum((predictions == 1) & (labels == 1)))
    tn = float(np.sum((predictions == 0) & (labels == 0)))
    fp = float(np.sum((predictions == 1) & (labels == 0)))
    fn = float(np.sum((predictions == 0) & (labels == 1)))
    denominator = np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return float((tp * tn - fp * fn) / denominator) if denominator else 0.0


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    x, y = np.asarray(x, np.float64) - np.mean(x), np.asarray(y, np.float64) - np.mean(y)
    denominator = np.sqrt(np.sum(x * x) * np.sum(y * y))
    return float(np.sum(x * y) / denominator) if denominator else float("nan")


def average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, ties sharing their mean rank (scipy.stats.rankdata's default)."""
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    return (ends - (counts - 1) / 2)[inverse]


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    return pearson(average_ranks(x), average_ranks(y))


def macro_f1(predictions: np.ndarray, labels: np.ndarray) -> float:
    """The mean over the classes present (in labels or predictions) of each one's F1 (scikit-learn's average="macro")."""
    scores = [f1((predictions == c).astype(int), (labels == c).astype(int))
              for c in np.union1d(predictions, labels)]
    return float(np.mean(scores))


METRICS = {"accuracy": accuracy, "macro_f1": macro_f1, "f1": f1, "matthews_corr": matthews_corr, "pearson": pearson, "spearman": spearman}


def score(task: GlueTask, logits: np.ndarray, labels: np.ndarray) -> dict:
    """The task's metrics of `logits` [N, num_labels] against `labels`, and the number of examples."""
    predictions = logits[:, 0] if task.labels is None else logits.argmax(-1)
    return {**{name: METRICS[name](predictions, labels) for name in task.metrics}, "examples": int(len(labels))}


def compute_logits(model, features: dict, batch_size: int, device, precision: str) -> np.ndarray:
    """float32 logits [N, num_labels] of `model` in eval mode."""
    import torch

    model.eval()
    out = []
    with torch.no_grad():
        for begin in range(0, len(features["input_ids"]), batch_size):
            batch = [torch.from_numpy(features[k][begin:begin + batch_size].astype(np.int64)).to(device)
                     for k in ("input_ids", "token_type_ids", "attention_mask")]
            with autocast(device, precision):
                out.append(model(*batch).float().cpu().numpy())
    return np.concatenate(out)


def evaluate(task: GlueTask, model_dir, splits: dict, batch_size: int = 128, precision: str = "auto",
             device: str = "auto") -> dict:
    """eval.json's content: the task's metrics on each dev split {name: features path}."""
    import torch

    from workflow.glue.finetune import load_classifier

    model, _ = load_classifier(model_dir, task.num_labels, require_head=True)
    device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                          "cpu" if device == "auto" else device)
    model.to(device)
    precision = resolve_precision(precision, device, "glue.precision")
    result = {"task": task.name, "splits": {}}
    for split, path in splits.items():
        features = load_features(path)
        if "labels" not in features:
            raise UserError(f"{path}: no labels (not GLUE features)")
        logits = compute_logits(model, features, batch_size, device, precision)
        result["splits"][split] = score(task, logits, features["labels"])
        log.info("%s %s: %s", task.name, split, result["splits"][split])
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", required=True, help="GLUE task name")
    parser.add_argument("--model", required=True, help="fine-tuned classifier directory")
    parser.add_argument("--features", action="append", type=phase_directory, required=True, metavar="SPLIT=NPZ",
                        help="dev features of one split (dev, or MNLI's dev_matched/dev_mismatched); repeatable")
    parser.add_argument("--output", required=True, help="eval.json")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    task = task_of(args.task)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    missing = set(task.dev_splits) - {split for split, _ in args.features}
    if missing:
        raise UserError(f"{task.name}: no --features for the dev split(s) {', '.join(sorted(missing))}")
    write_json(args.output, evaluate(task, args.model, dict(args.features), args.batch_size, args.precision,
                                     args.device))


if __name__ == "__main__":
    run(main)
