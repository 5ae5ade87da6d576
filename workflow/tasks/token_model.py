"""Token classification's model and training task: a token-classification head (HF BertForTokenClassification's
names: `bert.*`, `classifier.*`; from a ModernBERT directory HF's ModernBertForTokenClassification: `model.*`, `head.*`,
`classifier.*`) and cross-entropy over each word's first sub-word (workflow.tasks.tokens' features).
"""
import torch.nn.functional as F

from workflow.classify.model import BertForSequenceClassification
from workflow.tasks.tokens import IGNORE
from workflow.train.finetune import FeatureTask
from workflow.train.models.modernbert import ModernBertWithClassifier


class BertForTokenClassification(BertForSequenceClassification):
    """The sentence classifier (dropout + a linear layer, the same names) on every token's output: `num_labels` logits per
    token. No pooler (HF's BertForTokenClassification has none): under DDP its parameters would take no part in the
    loss and fail the second step."""
    reads_pooled_output = False

    def forward(self, input_ids, token_type_ids, attention_mask, mask_needed: bool | None = None, unpadded=None):
        sequence, _ = self.bert(input_ids, token_type_ids, attention_mask, mask_needed=mask_needed)
        return self.classifier(self.dropout(sequence))


class ModernBertForTokenClassification(ModernBertWithClassifier):
    """HF's ModernBertForTokenClassification: `head`, `drop` and `classifier` on every token: `num_labels` logits per
    token."""

    def forward(self, input_ids, token_type_ids, attention_mask, mask_needed: bool | None = None, unpadded=None):
        return self.classify_tokens(input_ids, attention_mask, mask_needed, unpadded)


TOKEN_CLASSIFIERS = (BertForTokenClassification, ModernBertForTokenClassification)  # one per model family


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
