"""Evaluate a fine-tuned sentence (pair) classifier: its logits on feature files, scored with the task's own metrics
(workflow.classify.metrics). The result (eval.json's content):
`{"task": "MNLI", "splits": {"dev_matched": {"accuracy": ..., "examples": ...}, "dev_mismatched": {...}}}`.
"""
import logging

import numpy as np

from workflow.classify.metrics import score
from workflow.classify.task import SentenceTask
from workflow.cli import UserError
from workflow.data.features import load_features
from workflow.train.precision import autocast, resolve_precision

log = logging.getLogger(__name__)


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


def evaluate(task: SentenceTask, model_dir, splits: dict, batch_size: int = 128, precision: str = "auto",
             device: str = "auto") -> dict:
    """eval.json's content: the task's metrics on each dev split {name: features path}."""
    import torch

    from workflow.classify.model import load_classifier

    model, _ = load_classifier(model_dir, task.num_labels, require_head=True)
    device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                          "cpu" if device == "auto" else device)
    model.to(device)
    precision = resolve_precision(precision, device, "glue.precision")
    result = {"task": task.name, "splits": {}}
    for split, path in splits.items():
        features = load_features(path)
        if "labels" not in features:
            raise UserError(f"{path}: no labels (not classification features)")
        logits = compute_logits(model, features, batch_size, device, precision)
        result["splits"][split] = score(task, logits, features["labels"])
        log.info("%s %s: %s", task.name, split, result["splits"][split])
    return result
