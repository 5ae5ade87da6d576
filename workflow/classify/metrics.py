"""The classification and regression metrics of the GLUE benchmark's reference (which calls scikit-learn/scipy),
written in numpy: Matthews correlation (CoLA), accuracy and F1 of the positive class (MRPC, QQP), Pearson and Spearman
correlation (STS-B), macro F1 (the config's classification tasks). Values are fractions (0..1; correlations -1..1).
"""
import numpy as np

from workflow.classify.task import SentenceTask


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


def score(task: SentenceTask, logits: np.ndarray, labels: np.ndarray) -> dict:
    """The task's metrics of `logits` [N, num_labels] against `labels`, and the number of examples."""
    predictions = logits[:, 0] if task.labels is None else logits.argmax(-1)
    return {**{name: METRICS[name](predictions, labels) for name in task.metrics}, "examples": int(len(labels))}
