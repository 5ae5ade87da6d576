"""RoBERTa and XLM-R (encoder + masked-LM head) in one file, as Hugging Face's `RobertaForMaskedLM` and
`XLMRobertaForMaskedLM` compute them. The encoder is BERT's (workflow/train/models/bert.py); what differs is here:
positions offset past the padding index, one token type (no segment embeddings in use), no next-sentence head, the
LM head (dense, exact GELU, layer_norm, the decoder tied to the word embeddings) and HF's names.

API (the shape of the other families' modules; the engine and the pretraining task call it the same way):
    RobertaConfig                   BertConfig with RoBERTa's defaults (roberta-base: max_position_embeddings 514 =
                                    512 positions + pad_token_id + 1, type_vocab_size 1, layer_norm_eps 1e-5, pad 1,
                                    bos 0, eos 2) and `model_type` ("roberta" | "xlm-roberta", written back to
                                    config.json); .preset("roberta-base" | "roberta-large" | "roberta-tiny"),
                                    .positions (the sequence length it takes)
    RobertaModel(config, add_pooling_layer=True)   BertModel with RoBERTa's positions (roberta_position_ids)
    RobertaForMaskedLM(config)      .roberta is the RobertaModel (no pooler); forward(input_ids, token_type_ids,
                                    attention_mask, masked_lm_positions, ...) -> (mlm_logits, None) as
                                    ModernBertForMaskedLM's; without masked_lm_positions, logits at every position
    roberta_position_ids(input_ids, attention_mask, position_ids, padding_idx)
    host_indices(batch), flops_per_sequence(config, ...)   BERT's (the same encoder; no pooler, no NSP head)
    load_pretrained(directory, key) -> (config, state), save_pretrained(model, config, vocab, directory)
    HEAD_PARTS                      the fine-tuning heads' parts (RobertaFor<kind> / XLMRobertaFor<kind>, HF's
                                    layouts: workflow/train/models/heads.py); save_pretrained writes their exports

Parameter names equal HF's but for the tied `lm_head.decoder.weight` (= the word embeddings) and
`lm_head.decoder.bias` (= `lm_head.bias`), which HF itself leaves out of model.safetensors.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from workflow.cli import UserError
from workflow.train.models.bert import BertConfig, BertHeadParts, BertModel, flops_per_sequence
from workflow.train.models.heads import SEQUENCE_CLASSIFICATION
from workflow.train.models.hf_weights import read_weights
from workflow.train.models.kit import Unpadded, at_positions, host_indices, read_config_json

MODEL_TYPES = {"roberta": "RobertaForMaskedLM", "xlm-roberta": "XLMRobertaForMaskedLM"}  # -> the export's class

_PRESETS = {
    "roberta-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "roberta-large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    # CPU sample model: minutes on a laptop for the sample data.
    "roberta-tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
}

POSITIONS = 512  # the presets' longest sequence

_TIED = ("lm_head.decoder.weight", "lm_head.decoder.bias")  # HF's aliases of the word embeddings and lm_head.bias


@dataclass
class RobertaConfig(BertConfig):
    """RoBERTa hyper-parameters, named and defaulted as HF's RobertaConfig for FacebookAI/roberta-base."""

    vocab_size: int = 50265
    max_position_embeddings: int = 514
    type_vocab_size: int = 1
    layer_norm_eps: float = 1e-5
    pad_token_id: int = 1
    bos_token_id: int = 0
    eos_token_id: int = 2
    model_type: str = "roberta"

    def __post_init__(self):
        super().__post_init__()
        if self.model_type not in MODEL_TYPES:
            raise UserError(f"roberta config: model_type {self.model_type!r} is not one of {', '.join(MODEL_TYPES)}")
        if not 0 <= self.pad_token_id < min(self.vocab_size, self.max_position_embeddings - 1):
            raise UserError(f"roberta config: pad_token_id {self.pad_token_id} must be below vocab_size "
                            f"{self.vocab_size} and max_position_embeddings - 1 ({self.max_position_embeddings - 1})")

    @property
    def positions(self) -> int:
        """The longest sequence: the position table's rows past the padding index."""
        return self.max_position_embeddings - self.pad_token_id - 1

    @classmethod
    def preset(cls, name: str, **overrides) -> "RobertaConfig":
        if name not in _PRESETS:
            raise UserError(f"config model.preset: unknown preset {name!r} (one of {sorted(_PRESETS)})")
        values = {**_PRESETS[name], **overrides}
        # 512 positions past the padding index, wherever the vocab puts it (514 rows for RoBERTa's pad 1)
        values.setdefault("max_position_embeddings", POSITIONS + values.get("pad_token_id", cls.pad_token_id) + 1)
        return cls(**values)

    def to_json(self, path: str | os.PathLike, architecture: str | None = None) -> None:
        """config.json as HF writes it for `model_type` (its MaskedLM class unless `architecture` says otherwise)."""
        data = {**self.to_dict(), "architectures": [architecture or MODEL_TYPES[self.model_type]],
                "tie_word_embeddings": True}
        Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def roberta_position_ids(input_ids, attention_mask, position_ids, padding_idx: int):
    """HF's create_position_ids_from_input_ids: a real token's position is padding_idx + 1 + its place in its
    sequence, padding's is padding_idx. Real tokens are the attention mask's non-zero ones (the data may pad with an
    id that is text here: RoBERTa's <s> is 0), else the ids other than padding_idx; given `position_ids` (packed rows:
    0, 1, ... per sequence) are offset alike."""
    real = input_ids != padding_idx if attention_mask is None else attention_mask != 0
    if position_ids is None:
        position_ids = real.cumsum(1) - 1
    return torch.where(real, position_ids + padding_idx + 1, padding_idx)


class RobertaModel(BertModel):
    """BERT's encoder with RoBERTa's positions: the padding index's position row is zero and gets no gradient (as
    HF's padding_idx), and token_type_ids are ignored (one token type, all zeros)."""

    def __init__(self, config: RobertaConfig, add_pooling_layer: bool = True):
        super().__init__(config, add_pooling_layer)
        positions = self.embeddings.position_embeddings
        positions.padding_idx = config.pad_token_id
        with torch.no_grad():
            positions.weight[config.pad_token_id].zero_()

    def encode(self, input_ids, token_type_ids=None, attention_mask=None, position_ids=None, packed=False,
               unpadded: Unpadded | None = None, mask_needed: bool | None = None):
        """BertModel.encode at RoBERTa's positions; packed rows still need their position_ids."""
        if position_ids is not None or not packed:
            position_ids = roberta_position_ids(input_ids, attention_mask, position_ids, self.config.pad_token_id)
        return super().encode(input_ids, None, attention_mask, position_ids, packed, unpadded, mask_needed)


class RobertaLMHead(nn.Module):
    """HF's lm_head: dense, exact GELU (whatever hidden_act says), layer_norm, then the tied decoder with `bias`."""

    def __init__(self, config: RobertaConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        nn.init.normal_(self.dense.weight, std=config.initializer_range)
        nn.init.zeros_(self.dense.bias)

    def transform(self, x):
        """The hidden states the decoder projects: dense, exact GELU, layer_norm."""
        return self.layer_norm(F.gelu(self.dense(x)))

    def forward(self, x, decoder_weight):
        return F.linear(self.transform(x), decoder_weight, self.bias)


class RobertaForMaskedLM(nn.Module):
    """RoBERTa / XLM-R with the masked-LM head; the forward is the pretraining task's (see the module doc)."""

    base_model_prefix = "roberta"  # HF's: the encoder's name

    def __init__(self, config: RobertaConfig):
        super().__init__()
        self.config = config
        self.roberta = RobertaModel(config, add_pooling_layer=False)
        self.lm_head = RobertaLMHead(config)

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, masked_lm_positions=None,
                position_ids=None, cls_positions=None, masked_lm_valid=None, masked_lm_index=None,
                unpadded: Unpadded | None = None, mask_needed: bool | None = None, return_hidden: bool = False):
        """(mlm_logits, None): [B, P, V] at every slot of `masked_lm_positions`, [M, V] at the real slots given
        `masked_lm_valid`, [N, V] at the row-major positions `masked_lm_index` (host_indices: every slot, a fixed
        shape, no host sync on CUDA), [B, L, V] without slots (HF's logits). With `return_hidden`, the head's hidden
        states before its decoder (mlm_decoder(): a fused loss takes them) in the logits' place. token_type_ids are
        ignored."""
        hidden = self.roberta.encode(input_ids, None, attention_mask, position_ids, cls_positions is not None,
                                     unpadded, mask_needed)
        batch, length = input_ids.shape
        rows = torch.arange(batch, device=input_ids.device).unsqueeze(1) * length
        slots = rows + (torch.arange(length, device=input_ids.device) if masked_lm_positions is None
                        else masked_lm_positions.long())
        if masked_lm_index is not None:
            predicted = masked_lm_index
        elif masked_lm_valid is not None:  # a data-dependent selection: one host sync on CUDA
            predicted = slots[masked_lm_valid]
        else:
            predicted = slots
        at_slots = at_positions(hidden, predicted)
        return (self.lm_head.transform(at_slots) if return_hidden else self.logits(at_slots)), None

    def logits(self, hidden):
        """The MLM head over final hidden states [..., H] -> [..., V]."""
        return self.lm_head(hidden, self.roberta.embeddings.word_embeddings.weight)

    def mlm_decoder(self):
        """(weight [V, H], bias [V]) of the tied decoder: the word embeddings and the head's bias."""
        return self.roberta.embeddings.word_embeddings.weight, self.lm_head.bias


class RobertaClassificationHead(nn.Module):
    """HF's sequence classification head (`classifier`): dropout, `dense`, tanh, dropout, `out_proj` on the first
    token's (<s>) output."""

    def __init__(self, config: RobertaConfig, num_labels: int):
        super().__init__()
        self.dense = BertHeadParts.linear(config, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)  # HF's classifier_dropout, None (ours has none)
        self.out_proj = BertHeadParts.linear(config, num_labels)

    def forward(self, hidden):
        return self.out_proj(self.dropout(torch.tanh(self.dense(self.dropout(hidden[:, 0])))))


class RobertaHeadParts(BertHeadParts):
    """RoBERTa's and XLM-R's fine-tuning heads under HF's names (RobertaFor<kind>, XLMRobertaFor<kind>, by
    config.model_type): BERT's, with the encoder `roberta`, no pooler, and RobertaClassificationHead as the sequence
    classifier (its out_proj sized by the task)."""

    encoder_name, model_class = "roberta", RobertaModel

    @staticmethod
    def has_pooler(kind: str) -> bool:
        return False

    def sequence_classifier(self, config: RobertaConfig, num_labels: int) -> nn.Module:
        return RobertaClassificationHead(config, num_labels)

    @staticmethod
    def classify_sequence(head: nn.Module, sequence, pooled):
        return head.classifier(sequence)

    @staticmethod
    def output_layer(kind: str) -> str:
        return "classifier.out_proj." if kind == SEQUENCE_CLASSIFICATION else BertHeadParts.output_layer(kind)

    def fresh_prefixes(self, kind: str) -> tuple:
        return ("classifier.",) if kind == SEQUENCE_CLASSIFICATION else super().fresh_prefixes(kind)

    def class_name(self, config: RobertaConfig, kind: str) -> str:
        return MODEL_TYPES[config.model_type].replace("ForMaskedLM", f"For{kind}")


HEAD_PARTS = RobertaHeadParts()


# ---------------------------------------------------------------- Hugging Face directories


def load_pretrained(directory: str | os.PathLike, key: str | None = "model.init_from") -> tuple[RobertaConfig, dict]:
    """(RobertaConfig, state dict) of an HF RoBERTa or XLM-R directory (HF's own save or ours; model_type kept; its
    weights as hf_weights reads them, never unpickling code); another model type is refused in one line (naming the
    config `key` that gave the directory, if any)."""
    directory = Path(directory)
    where = f"{key} {directory}" if key else str(directory)
    if not (directory / "config.json").is_file():
        raise UserError(f"{where}: not a Hugging Face model directory (no config.json)")
    fields = read_config_json(directory / "config.json")
    if fields.get("model_type") not in MODEL_TYPES:
        raise UserError(f"{where}: a {fields.get('model_type')!r} model, not a RoBERTa or XLM-R one "
                        "(model.family: roberta)")
    state = read_weights(directory, where, RobertaForMaskedLM.base_model_prefix)
    if "lm_head.bias" not in state and "lm_head.decoder.bias" in state:
        state["lm_head.bias"] = state["lm_head.decoder.bias"]
    for name in (*_TIED, "roberta.embeddings.position_ids", "roberta.embeddings.token_type_ids"):
        state.pop(name, None)
    return RobertaConfig.from_dict(fields), state


def save_pretrained(model: nn.Module, config: RobertaConfig, vocab, directory: str | os.PathLike) -> None:
    """An HF directory that RobertaForMaskedLM / XLMRobertaForMaskedLM (by config.model_type), AutoModelForMaskedLM
    and pipeline("fill-mask") load: model.safetensors (without the tied aliases, as HF saves it), config.json, the
    tokenizer's files."""
    from safetensors.torch import save_file

    from workflow.data.tokenizer import save_tokenizer

    model = getattr(model, "module", model)  # unwrap DDP
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in model.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config.to_json(directory / "config.json")
    if vocab is not None:
        save_tokenizer(vocab, directory, None, config.positions)


__all__ = ["RobertaConfig", "RobertaModel", "RobertaForMaskedLM", "roberta_position_ids", "host_indices",
           "flops_per_sequence", "load_pretrained", "save_pretrained", "MODEL_TYPES", "HEAD_PARTS"]
