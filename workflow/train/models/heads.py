"""The fine-tuning heads' one shape, as HF's `<Family>For<Kind>` classes: the family's encoder under its HF name, the
kind's output layers beside it, the logits of the kind.

A head is written once, per kind, beside its task (workflow/squad: question answering; workflow/classify: sequence
classification and regression; workflow/tasks: token classification), as a FamilyHead subclass naming its `kind`.
The family supplies the rest through its model module's HEAD_PARTS (family.Family.head_parts), an object with:
    build(head, kind, config, num_labels)    registers the encoder and the kind's layers on `head`, under HF's names,
                                             initialised as HF does
    logits(head, kind, input_ids, token_type_ids, attention_mask, mask_needed, unpadded)
                                             [B, L, num_labels] per token, [B, num_labels] per sequence
    output_layer(kind)                       the layer sized by the task ("classifier."): another task's is dropped
    fresh_prefixes(kind)                     the layers a bare encoder's directory lacks (freshly initialised)
    class_name(config, kind)                 the HF class that loads the export (config.json's architectures)
The registry says which kinds a family has (Family.heads).
"""
from torch import nn

QUESTION_ANSWERING, SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION = KINDS = (
    "QuestionAnswering", "SequenceClassification", "TokenClassification")  # HF's: <Family>For<Kind>


class FamilyHead(nn.Module):
    """A kind's head on a family's encoder (`parts`: the family's HEAD_PARTS); subclasses give `kind` (and a forward
    where the kind's logits are not its output)."""

    kind: str

    def __init__(self, config, num_labels: int, parts):
        super().__init__()
        self.config, self.num_labels, self.parts = config, num_labels, parts
        parts.build(self, self.kind, config, num_labels)

    @property
    def output_layer(self) -> str:
        return self.parts.output_layer(self.kind)

    @property
    def fresh_prefixes(self) -> tuple:
        return self.parts.fresh_prefixes(self.kind)

    @property
    def hf_class_name(self) -> str:
        return self.parts.class_name(self.config, self.kind)

    def forward(self, input_ids, token_type_ids, attention_mask, mask_needed: bool | None = None, unpadded=None):
        """The kind's logits; `mask_needed`, `unpadded`: the batch's (finetune.FeatureTask.inputs)."""
        return self.parts.logits(self, self.kind, input_ids, token_type_ids, attention_mask, mask_needed, unpadded)
