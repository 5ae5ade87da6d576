"""Token classification's model and training task: the token-classification head (HF's <Family>ForTokenClassification
on the fine-tuned directory's family's encoder, in the family's layout: workflow/train/models/heads.py) and
cross-entropy over each word's first sub-word (workflow.tasks.tokens' features).
"""
import torch.nn.functional as F

from workflow.tasks.tokens import IGNORE
from workflow.train.finetune import FeatureTask
from workflow.train.models.heads import TOKEN_CLASSIFICATION, FamilyHead


class ForTokenClassification(FamilyHead):
    """`num_labels` logits per token."""

    kind = TOKEN_CLASSIFICATION


TOKEN_CLASSIFIERS = ForTokenClassification  # load_classifier's head for token classification, every family's


class TokenTask(FeatureTask):
    """Token classification on the training features: cross-entropy over the labelled (first) sub-words."""

    def __init__(self, features: dict, batch_size: int, seed: int):
        super().__init__(features, ("input_ids", "token_type_ids", "attention_mask"), ("labels",), batch_size, seed)

    def count(self, batch: dict) -> dict:
        return {**super().count(batch), "words": (batch["labels"] != IGNORE).sum()}

    def loss(self, model, batch: dict, totals: dict) -> dict:
        logits = model(*self.inputs(batch))
        labels = batch["labels"]
        share = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
        correct = ((logits.argmax(-1) == labels) & (labels != IGNORE)).sum().float()
        return {"loss": share / totals["words"].clamp(min=1), "correct": correct, "words": (labels != IGNORE).sum()}

    def metrics(self, sums: dict, steps: int, sequences: int, elapsed: float, step: int) -> dict:
        return {"epoch": step / self.steps_per_epoch, "loss": sums["loss"] / steps,
                "accuracy": sums["correct"] / max(1.0, float(sums["words"]))}
