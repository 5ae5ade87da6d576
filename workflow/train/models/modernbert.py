"""ModernBERT (encoder + masked-LM head) in one file, as Hugging Face's `ModernBertForMaskedLM` computes it.

API (the BERT family's shape, workflow/train/models/bert.py; the engine and the pretraining task call either the same way):
    ModernBertConfig                dataclass with HF's config.json key names; .preset("modernbert-base" |
                                    "modernbert-large" | "modernbert-tiny", **overrides), .from_dict/.from_json (both
                                    the 4.48-era keys global_rope_theta, local_rope_theta, global_attn_every_n_layers,
                                    local_attention and 5.x's layer_types, rope_parameters), .to_dict/.to_json (both);
                                    .layer_types, .sliding_window (local_attention // 2, each side)
    ModernBertModel(config)         forward(input_ids, attention_mask=None, position_ids=None, packed=False)
                                    -> last_hidden_state [B, L, H] (after final_norm); encode(...) -> [B, L, H]
                                    as BertModel.encode
    ModernBertForMaskedLM(config)   .model is the ModernBertModel; forward(input_ids, token_type_ids, attention_mask,
                                    masked_lm_positions, position_ids=None, cls_positions=None, masked_lm_valid=None,
                                    masked_lm_index=None, unpadded=None, mask_needed=None) -> (mlm_logits, None):
                                    the MLM logits exactly as BertForPreTraining returns them ([B, P, V], or [M, V] at
                                    the real slots), and no NSP logits (this family has no NSP head). Without
                                    masked_lm_positions, logits at every position [B, L, V] (HF's output).
                                    token_type_ids are accepted and ignored (no segment embeddings).
    HEAD_PARTS                      the fine-tuning heads' ModernBERT parts (ModernBertFor<kind>, HF's `model`,
                                    `head`, `drop`, `classifier`: workflow/train/models/heads.py)
    host_indices(batch) -> batch    model.host_indices, plus the sequences of unpacked rows too (this family runs
                                    every batch unpadded on the devices of model.VARLEN_DEVICE_TYPES)
    flops_per_sequence(config, seq_length, max_predictions)   training FLOPs, counting the GLU and the local window
    attended_pairs(seq_length, reach)   query-key pairs of a sequence whose tokens see `reach` tokens each side

Parameter names equal HF's `ModernBertForMaskedLM`'s but for the tied `decoder.weight` (= the token embeddings),
which HF itself leaves out of model.safetensors: the HF export is `state_dict()` and `config.to_json`.

The batch: input_ids [B, L]; attention_mask [B, L]: 1/0 for rows of one sequence with padding, or each token's
sequence number 1..S (0 = padding) for packed rows, whose position_ids [B, L] restart at 0 per sequence and whose
cls_positions [B, S] mark them as packed (as for BERT); training adds masked_lm_positions [B, P] and
masked_lm_labels [B, P] (-1 = empty slot), and host_indices what the forward would read back from the device.
A token attends only to its own sequence, and in a local layer only to tokens at most `sliding_window` away; rotary
positions are position_ids (else 0..L-1). Padding attends to padding only (HF lets it attend to real keys; no real
token's output differs).
Two paths: rows with dense boolean SDPA masks (CPU; exact), or, on model.VARLEN_DEVICE_TYPES (CUDA) in a 16-bit
compute dtype (VARLEN_DTYPES: flash kernels), the rows laid end to end [B * L, H] (a row's padding a sequence of its
own, offsets padded to a power of two, one graph under torch.compile) through the varlen flash kernels with a window of
sliding_window each side for local layers, and attention dropout (workflow.train.models.flash_varlen's custom ops,
whose exact CPU reference the tests run).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from workflow.cli import UserError
from workflow.train.models import kernels, kit
from workflow.train.models.kit import (ACTIVATIONS, UNPADDED_KEYS, RowAttention, Unpadded, at_positions,
                                       read_config_json, row_attention, unpad)
from workflow.train.models.heads import SEQUENCE_CLASSIFICATION

from workflow.train.models.flash_varlen import flash_varlen

FULL, SLIDING = "full_attention", "sliding_attention"  # HF's layer types
VARLEN_DTYPES = (torch.float16, torch.bfloat16)  # what flash kernels take; fp32 runs as rows with masks

_PRESETS = {
    "modernbert-base": dict(hidden_size=768, num_hidden_layers=22, num_attention_heads=12, intermediate_size=1152),
    "modernbert-large": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, intermediate_size=2624),
    # CPU sample model: one global and three local layers, a window the sample's sequences cross.
    "modernbert-tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=2, intermediate_size=192,
                            local_attention=64, max_position_embeddings=1024),
}


@dataclass
class ModernBertConfig:
    """ModernBERT hyper-parameters, named and defaulted as HF's ModernBertConfig (answerdotai/ModernBERT-base)."""

    vocab_size: int = 50368
    hidden_size: int = 768
    intermediate_size: int = 1152
    num_hidden_layers: int = 22
    num_attention_heads: int = 12
    hidden_activation: str = "gelu"
    max_position_embeddings: int = 8192
    initializer_range: float = 0.02
    initializer_cutoff_factor: float = 2.0
    norm_eps: float = 1e-5
    norm_bias: bool = False
    pad_token_id: int | None = 50283
    eos_token_id: int | None = 50282
    bos_token_id: int | None = 50281
    cls_token_id: int | None = 50281
    sep_token_id: int | None = 50282
    attention_bias: bool = False
    attention_dropout: float = 0.0
    global_attn_every_n_layers: int = 3
    local_attention: int = 128
    global_rope_theta: float = 160000.0
    local_rope_theta: float = 10000.0
    embedding_dropout: float = 0.0
    mlp_bias: bool = False
    mlp_dropout: float = 0.0
    decoder_bias: bool = True
    classifier_pooling: str = "cls"
    classifier_dropout: float = 0.0
    classifier_bias: bool = False
    classifier_activation: str = "gelu"

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise UserError(f"modernbert config: hidden_size {self.hidden_size} is not a multiple of "
                            f"num_attention_heads {self.num_attention_heads}")
        for key in ("hidden_activation", "classifier_activation"):
            if getattr(self, key) not in ACTIVATIONS:
                raise UserError(f"modernbert config: {key} {getattr(self, key)!r} is not one of {sorted(ACTIVATIONS)}")
        if self.global_attn_every_n_layers < 1 or self.local_attention < 0:
            raise UserError(f"modernbert config: global_attn_every_n_layers {self.global_attn_every_n_layers} must be "
                            f">= 1 and local_attention {self.local_attention} >= 0")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise UserError(f"modernbert config: pad_token_id {self.pad_token_id} is not below vocab_size "
                            f"{self.vocab_size}")
        if self.classifier_pooling not in ("cls", "mean"):
            raise UserError(f"modernbert config: classifier_pooling {self.classifier_pooling!r} is not cls or mean")

    @property
    def layer_types(self) -> list[str]:
        """HF's layer_types: layer i is global when i is a multiple of global_attn_every_n_layers."""
        return [SLIDING if i % self.global_attn_every_n_layers else FULL for i in range(self.num_hidden_layers)]

    @property
    def sliding_window(self) -> int:
        """How far a local layer's token sees on each side (HF: local_attention // 2)."""
        return self.local_attention // 2

    @classmethod
    def preset(cls, name: str, **overrides) -> "ModernBertConfig":
        if name not in _PRESETS:
            raise UserError(f"config model.preset: unknown preset {name!r} (one of {sorted(_PRESETS)})")
        return cls(**{**_PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls, data: dict) -> "ModernBertConfig":
        """Either era's keys; where both are given, 5.x's win (as transformers 5.x reads them)."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        rope = data.get("rope_parameters") or {}
        for layer_type, key in ((FULL, "global_rope_theta"), (SLIDING, "local_rope_theta")):
            parameters = rope.get(layer_type) or {}
            if parameters.get("rope_type", "default") != "default":
                raise UserError(f"modernbert config: rope_parameters.{layer_type}.rope_type "
                                f"{parameters['rope_type']!r}: only the default rotary embedding is implemented")
            if "rope_theta" in parameters:
                values[key] = parameters["rope_theta"]
        if data.get("layer_types") is not None:
            values["global_attn_every_n_layers"] = _every_n(data["layer_types"])
        return cls(**values)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "ModernBertConfig":
        return cls.from_dict(read_config_json(path))

    def to_dict(self) -> dict:
        """Every field plus 5.x's layer_types and rope_parameters: transformers 4.48 and 5.x read the same model."""
        rope = {FULL: {"rope_type": "default", "rope_theta": self.global_rope_theta},
                SLIDING: {"rope_type": "default", "rope_theta": self.local_rope_theta}}
        return {**dataclasses.asdict(self), "layer_types": self.layer_types, "rope_parameters": rope}

    def to_json(self, path: str | os.PathLike, architecture: str = "ModernBertForMaskedLM") -> None:
        data = {**self.to_dict(), "model_type": "modernbert", "architectures": [architecture],
                "tie_word_embeddings": True}
        Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _every_n(layer_types: list[str]) -> int:
    """N of layer_types that are one global layer every N (layer 0 global), as the 4.48-era key says it."""
    for n in range(1, len(layer_types) + 1):
        if list(layer_types) == [SLIDING if i % n else FULL for i in range(len(layer_types))]:
            return n
    raise UserError(f"modernbert config: layer_types {layer_types} are not one global layer every N layers "
                    "(the only pattern transformers 4.48 can read)")


class ModernBertEmbeddings(nn.Module):
    def __init__(self, config: ModernBertConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)
        self.drop = nn.Dropout(config.embedding_dropout)

    def forward(self, input_ids):
        return self.drop(self.norm(self.tok_embeddings(input_ids)))


class ModernBertRotaryEmbedding(nn.Module):
    """cos and sin of each layer type's rotary frequencies (HF's default rope) at given positions."""

    def __init__(self, config: ModernBertConfig):
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        exponents = torch.arange(0, dim, 2, dtype=torch.float) / dim
        for layer_type, theta in ((FULL, config.global_rope_theta), (SLIDING, config.local_rope_theta)):
            self.register_buffer(f"{layer_type}_inv_freq", 1.0 / (theta ** exponents), persistent=False)

    @torch.no_grad()
    def forward(self, position_ids, layer_type: str):
        """(cos, sin) [*position_ids.shape, head_size], float32."""
        freqs = position_ids[..., None].float() * getattr(self, f"{layer_type}_inv_freq").float()
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos(), angles.sin()


def _rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x, cos, sin):
    """x [..., heads, head_size] rotated by cos, sin [..., head_size] (computed in float32, as HF does)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rotated = x.float() * cos + _rotate_half(x.float()) * sin
    return rotated.to(x.dtype)


class WindowedVarlenAttention:
    """Attention within each sequence of tokens laid end to end ([T, heads, head_size] q, k, v; cu_seqlens offsets
    [N + 1] int32, empty sequences allowed), within `window` tokens on each side (None: the whole sequence), with
    dropout: the varlen flash kernels on CUDA, their exact reference on CPU (flash_varlen's custom ops)."""

    def __init__(self, offsets, max_seqlen: int, window: int | None):
        self.offsets, self.max_seqlen, self.window = offsets, max_seqlen, window

    def __call__(self, q, k, v, dropout_p):
        return kernels.windowed_varlen_kernel(q.device, flash_varlen)(
            q, k, v, self.offsets, self.max_seqlen, dropout_p, self.window)


class ModernBertAttention(nn.Module):
    def __init__(self, config: ModernBertConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.Wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.attention_bias)
        self.Wo = nn.Linear(config.hidden_size, config.hidden_size, bias=config.attention_bias)
        self.dropout_p = config.attention_dropout
        self.out_drop = nn.Dropout(config.attention_dropout) if config.attention_dropout > 0.0 else nn.Identity()

    def forward(self, x, attention, rotary):
        """x: [B, L, H] rows or [T, H] tokens, as `attention` expects; rotary: their (cos, sin)."""
        q, k, v = self.Wqkv(x).unflatten(-1, (3, self.num_heads, -1)).unbind(-3)
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        context = attention(q, k, v, self.dropout_p if self.training else 0.0)
        return self.out_drop(self.Wo(context.flatten(-2)))


class ModernBertMLP(nn.Module):
    """GeGLU: Wi makes the input and its gate in one matmul."""

    def __init__(self, config: ModernBertConfig):
        super().__init__()
        self.Wi = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.act = ACTIVATIONS[config.hidden_activation]
        self.drop = nn.Dropout(config.mlp_dropout)
        self.Wo = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x):
        hidden, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.drop(self.act(hidden) * gate))


class ModernBertEncoderLayer(nn.Module):
    """Pre-norm layer; the first has no attention norm (the embeddings' norm precedes it)."""

    def __init__(self, config: ModernBertConfig, index: int):
        super().__init__()
        self.attention_type = config.layer_types[index]
        self.attn_norm = nn.Identity() if index == 0 else nn.LayerNorm(config.hidden_size, eps=config.norm_eps,
                                                                       bias=config.norm_bias)
        self.attn = ModernBertAttention(config)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)
        self.mlp = ModernBertMLP(config)

    def forward(self, x, attention, rotary):
        x = x + self.attn(self.attn_norm(x), attention, rotary)
        return x + self.mlp(self.mlp_norm(x))


def _init_weights(module: nn.Module, config: ModernBertConfig) -> None:
    """HF's initialisation: truncated normal (cutoff initializer_cutoff_factor std) of initializer_range for inputs,
    of initializer_range / sqrt(2 layers) for outputs (Wo, head, decoder), zero biases, unit norms."""
    std_in = config.initializer_range
    std_out = config.initializer_range / math.sqrt(2.0 * config.num_hidden_layers)

    def init(weight, std):
        cutoff = config.initializer_cutoff_factor * std
        nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-cutoff, b=cutoff)

    if isinstance(module, ModernBertEmbeddings):
        init(module.tok_embeddings.weight, std_in)
    elif isinstance(module, (ModernBertAttention, ModernBertMLP)):
        init((module.Wqkv if isinstance(module, ModernBertAttention) else module.Wi).weight, std_in)
        init(module.Wo.weight, std_out)
    elif isinstance(module, ModernBertPredictionHead):
        init(module.dense.weight, std_out)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
    if isinstance(module, (nn.Linear, nn.LayerNorm)) and module.bias is not None:
        nn.init.zeros_(module.bias)


class ModernBertModel(nn.Module):
    """The encoder: embeddings + norm, layers (global every N, the others local), final norm."""

    def __init__(self, config: ModernBertConfig):
        super().__init__()
        self.config = config
        self.embeddings = ModernBertEmbeddings(config)
        self.layers = nn.ModuleList(ModernBertEncoderLayer(config, index) for index in range(config.num_hidden_layers))
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)
        self.rotary_emb = ModernBertRotaryEmbedding(config)
        self.apply(lambda m: _init_weights(m, config))

    def forward(self, input_ids, attention_mask=None, position_ids=None, packed=False):
        """last_hidden_state [B, L, H]."""
        return self.encode(input_ids, attention_mask, position_ids, packed)

    def encode(self, input_ids, attention_mask=None, position_ids=None, packed=False,
               unpadded: Unpadded | None = None, mask_needed: bool | None = None):
        """The final norm's output [B, L, H]. On the unpadded path (see the module doc) the rows run laid end to end,
        [B * L, H] (`unpadded`: their sequences as host_indices found them, else found here with host syncs); else
        with dense masks (`mask_needed`: see model.row_attention). Every shape is the rows'."""
        if packed and (attention_mask is None or position_ids is None):
            raise ValueError("packed rows need attention_mask (sequence numbers) and position_ids")
        batch, length = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(length, device=input_ids.device).expand(batch, length)
        x = self.embeddings(input_ids)
        if self._runs_unpadded(input_ids.device):
            if unpadded is None:
                unpadded = unpad(attention_mask if attention_mask is not None else torch.ones_like(input_ids))
            offsets = unpadded.offsets.to(torch.int32)
            attention = {FULL: WindowedVarlenAttention(offsets, unpadded.max_seqlen, None),
                         SLIDING: WindowedVarlenAttention(offsets, unpadded.max_seqlen, self.config.sliding_window)}
            return self._layers(x.flatten(0, 1), attention, position_ids.flatten()).view_as(x)
        return self._layers(x, self._row_attention(attention_mask, length, mask_needed), position_ids)

    def _runs_unpadded(self, device) -> bool:
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else \
            self.embeddings.tok_embeddings.weight.dtype
        return (device.type in kit.VARLEN_DEVICE_TYPES and dtype in VARLEN_DTYPES
                and kernels.windowed_varlen_kernel(device, flash_varlen) is not None)

    def _row_attention(self, attention_mask, length: int, mask_needed: bool | None) -> dict:
        """Each layer type's RowAttention: same sequence (equal mask values: padding sees padding only), and for
        local layers within the window."""
        # Equal values, for rows of one sequence too: every query keeps a key (no empty softmax row, no NaN).
        full = row_attention(attention_mask, True, mask_needed)
        if length - 1 <= self.config.sliding_window:
            return {FULL: full, SLIDING: full}
        index = torch.arange(length, device=self.embeddings.tok_embeddings.weight.device)
        band = (index[:, None] - index[None, :]).abs() <= self.config.sliding_window
        return {FULL: full, SLIDING: RowAttention(band if full.mask is None else full.mask & band)}

    def _layers(self, x, attention: dict, positions):
        rotary = {layer_type: self.rotary_emb(positions, layer_type) for layer_type in (FULL, SLIDING)}
        for layer in self.layers:
            x = layer(x, attention[layer.attention_type], rotary[layer.attention_type])
        return self.final_norm(x)


class ModernBertPredictionHead(nn.Module):
    def __init__(self, config: ModernBertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.classifier_bias)
        self.act = ACTIVATIONS[config.classifier_activation]
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)

    def forward(self, x):
        return self.norm(self.act(self.dense(x)))


class TiedDecoder(nn.Module):
    """HF's `decoder` (a Linear whose weight is the token embeddings): only its bias is its own."""

    def __init__(self, config: ModernBertConfig):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(config.vocab_size)) if config.decoder_bias else None

    def forward(self, x, weight):
        return F.linear(x, weight, self.bias)


class ModernBertForMaskedLM(nn.Module):
    """ModernBERT with the masked-LM head (dense + act + norm, the tied decoder with its bias)."""

    base_model_prefix = "model"  # HF's: the encoder's name

    def __init__(self, config: ModernBertConfig):
        super().__init__()
        self.config = config
        self.model = ModernBertModel(config)
        self.head = ModernBertPredictionHead(config)
        self.decoder = TiedDecoder(config)
        self.head.apply(lambda m: _init_weights(m, config))

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, masked_lm_positions=None,
                position_ids=None, cls_positions=None, masked_lm_valid=None, masked_lm_index=None,
                unpadded: Unpadded | None = None, mask_needed: bool | None = None, return_hidden: bool = False):
        """(mlm_logits, None): see the module doc; the head runs at the prediction slots only. With `return_hidden`,
        the head's hidden states before the decoder (mlm_decoder(): a fused loss takes them) in the logits' place."""
        hidden = self.model.encode(input_ids, attention_mask, position_ids, cls_positions is not None, unpadded,
                                   mask_needed)
        batch, length = input_ids.shape
        if masked_lm_positions is None:  # every position, as HF's logits
            return self.logits(hidden), None
        slots = masked_lm_positions.long() + torch.arange(batch, device=input_ids.device).unsqueeze(1) * length
        if masked_lm_index is not None:
            predicted = masked_lm_index
        else:  # a data-dependent selection: one host sync on CUDA (host_indices avoids it)
            predicted = slots.flatten() if masked_lm_valid is None else slots[masked_lm_valid]
        at_slots = at_positions(hidden, predicted)
        logits = self.head(at_slots) if return_hidden else self.logits(at_slots)
        selected = masked_lm_valid is not None or masked_lm_index is not None
        return (logits if selected else logits.view(*slots.shape, -1)), None

    def logits(self, hidden):
        """The MLM head over final hidden states [..., H] -> [..., V]."""
        return self.decoder(self.head(hidden), self.model.embeddings.tok_embeddings.weight)

    def mlm_decoder(self):
        """(weight [V, H], bias [V]) of the tied decoder: the token embeddings and the decoder's bias."""
        return self.model.embeddings.tok_embeddings.weight, self.decoder.bias


class ModernBertHeadParts:
    """ModernBERT's fine-tuning heads under HF's names (ModernBertFor<kind>, workflow/train/models/heads.py), the
    same layers for every kind: the encoder `model`, `head` (dense + act + norm), `drop` (classifier_dropout) and
    `classifier`, initialised as HF does; sequence classification on the [CLS] token's output or the mean over the
    real tokens (config.classifier_pooling: cls | mean). token_type_ids are ignored."""

    def build(self, head: nn.Module, kind: str, config: ModernBertConfig, num_labels: int) -> None:
        head.model = ModernBertModel(config)
        head.head = ModernBertPredictionHead(config)
        head.drop = nn.Dropout(config.classifier_dropout)
        head.classifier = nn.Linear(config.hidden_size, num_labels)
        head.head.apply(lambda m: _init_weights(m, config))
        std = config.hidden_size ** -0.5  # HF's "final_out"
        cutoff = config.initializer_cutoff_factor * std
        nn.init.trunc_normal_(head.classifier.weight, mean=0.0, std=std, a=-cutoff, b=cutoff)
        nn.init.zeros_(head.classifier.bias)

    def logits(self, head, kind, input_ids, token_type_ids, attention_mask, mask_needed=None, unpadded=None):
        hidden = head.model.encode(input_ids, attention_mask, None, False, unpadded, mask_needed)  # unpacked rows
        if kind == SEQUENCE_CLASSIFICATION:
            hidden = self.pooled(head.config, hidden, input_ids, attention_mask)
        return head.classifier(head.drop(head.head(hidden)))

    @staticmethod
    def pooled(config: ModernBertConfig, hidden, input_ids, attention_mask):
        """Each row's [CLS] output or its real tokens' mean [B, H] (config.classifier_pooling)."""
        batch, length = input_ids.shape
        starts = torch.arange(batch, device=input_ids.device) * length
        if config.classifier_pooling == "cls":
            return at_positions(hidden, starts)
        rows = at_positions(hidden, starts[:, None] + torch.arange(length, device=input_ids.device))
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        return (rows * mask.unsqueeze(-1)).sum(dim=1) / mask.sum(dim=1, keepdim=True)

    @staticmethod
    def output_layer(kind: str) -> str:
        return "classifier."  # sized by the task: another task's is dropped when loading

    @staticmethod
    def fresh_prefixes(kind: str) -> tuple:
        return ("head.", "classifier.")  # initialised here where a directory lacks them (a bare encoder)

    @staticmethod
    def class_name(config: ModernBertConfig, kind: str) -> str:
        return f"ModernBertFor{kind}"


HEAD_PARTS = ModernBertHeadParts()


def host_indices(batch: dict) -> dict:
    """model.host_indices, with the sequences (model.UNPADDED_KEYS) of unpacked rows too."""
    batch = kit.host_indices(batch)
    if UNPADDED_KEYS[0] not in batch:
        batch.update(zip(UNPADDED_KEYS, unpad(batch["attention_mask"], 1)))
    return batch


def attended_pairs(seq_length: int, reach: int | None) -> int:
    """Query-key pairs of one sequence of `seq_length` tokens when each sees `reach` tokens on each side (None: all)."""
    if reach is None or reach >= seq_length - 1:
        return seq_length * seq_length
    return seq_length * (2 * reach + 1) - reach * (reach + 1)  # each end loses 1 + 2 + ... + reach pairs


def flops_per_sequence(config: ModernBertConfig, seq_length: int, max_predictions: float) -> float:
    """Training FLOPs of one sequence (forward + backward = 3x forward), matmuls only, as model.flops_per_sequence.

    Per layer and token: 2·(3h² + h²) (Wqkv, Wo) + 2·(2hi + ih) (the GLU's Wi makes input and gate: 3 matmuls of
    h x i); per layer 4·h·pairs for scores and context, pairs = L² in a global layer and the pairs within the window
    in a local one; plus the MLM head at the masked positions (2·h² + 2·h·V per prediction). No pooler.
    """
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    dense = seq_length * (8 * h * h + 6 * h * i)
    forward = sum(dense + 4 * h * attended_pairs(seq_length, None if kind == FULL else config.sliding_window)
                  for kind in config.layer_types)
    forward += max_predictions * (2 * h * h + 2 * h * v)
    return 3.0 * forward


__all__ = ["ModernBertConfig", "ModernBertModel", "ModernBertForMaskedLM", "HEAD_PARTS", "host_indices",
           "flops_per_sequence", "attended_pairs", "WindowedVarlenAttention"]
