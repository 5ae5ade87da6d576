"""BERT (encoder + pretraining heads) in one file, with Hugging Face-compatible import/export. What every family
uses alike (attention and unpadding, host_indices, pretraining_loss, load_weights) is workflow/train/models/kit.py,
re-exported here where BERT's API names it.

API (stable; the SQuAD stage builds on it):
    BertConfig                      dataclass with Google bert_config.json field names;
                                    BertConfig.preset("bert-large"|"bert-base"|"tiny"), .from_json(path), .to_json(path)
    BertModel(config)               forward(input_ids, token_type_ids, attention_mask, position_ids=None,
                                    cls_positions=None) -> (sequence_output [B, L, H], pooled_output [B, H])
    BertForPreTraining(config)      .bert is the BertModel; forward(input_ids, token_type_ids, attention_mask,
                                    masked_lm_positions, position_ids=None, cls_positions=None,
                                    masked_lm_valid=None, masked_lm_index=None, ...) -> (mlm_logits, nsp_logits);
                                    mlm_logits are [B, P, V] at the given positions only, or, with masked_lm_valid
                                    [B, P] (True = a real prediction slot), [M, V] at the M real slots only, in
                                    row-major slot order (= masked_lm_labels[masked_lm_valid]), or with
                                    masked_lm_index [N] (row-major positions; training's: every slot) [N, V]
    host_indices(batch) -> batch    plus the indices the forward would read back from the device (every prediction
                                    slot, packed rows' sequence offsets), computed where the batch is built, in shapes
                                    fixed by the batch's: no host sync remains in the forward, and a compiled graph is
                                    reused (what the training task passes)
    pretraining_loss(mlm_logits, nsp_logits, masked_lm_labels, next_sentence_labels) -> dict of loss/accuracy tensors
    save_pretrained(model, config, vocab_path, out_dir, normalization=None)   HF directory: model.safetensors +
                                    config.json + vocab.txt (+ tokenizer_config.json for AutoTokenizer, with
                                    normalization)
    load_pretrained(directory) -> (config, state_dict)   an HF directory; state_dict in BertForPreTraining names
                                    (heads may be absent). NVIDIA DLE checkpoints in and out:
                                    workflow/train/models/dle_checkpoint.py (which builds on this module)
    encoder_state_dict(state_dict)  the `bert.*` entries with the prefix stripped, for BertModel.load_state_dict
    load_weights(model, state_dict) load what matches; returns (missing, unexpected) key lists
    HEAD_PARTS                      the fine-tuning heads' BERT parts (BertFor<kind>: workflow/train/models/heads.py)

Parameter names equal Hugging Face `BertForPreTraining`'s, except the two tied aliases HF itself drops on save
(`cls.predictions.decoder.weight` = word embeddings, `cls.predictions.decoder.bias` = `cls.predictions.bias`).

Packed batches (rows holding several sequences, workflow.data.pack): pass `cls_positions` [B, S] (each sequence's
[CLS] slot), `position_ids` [B, L] restarting at 0 per sequence, and as `attention_mask` each token's sequence
number 1..S (0 = padding; a sequence's tokens are contiguous). A token then attends only to its own sequence:
through a block-diagonal SDPA mask on the rows, or, on the devices of VARLEN_DEVICE_TYPES (CUDA), with the rows laid
end to end, [B * L, H], and variable-length flash attention (VarlenAttention; a row's padding is a sequence of its
own, and the offsets are padded to a power of two, marked dynamic: one graph under torch.compile). The
pooler and NSP head run at every [CLS] slot: pooled_output [B, S, H], nsp_logits [B, S, 2] (labels -1 = empty slot).
Without packing, a mask with no padding is dropped (SDPA may then pick the flash kernel; host_indices checks it on the
host, else the check costs one device sync per forward on CUDA); padding queries still attend to real keys, as in HF.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from workflow.cli import UserError
from workflow.train.models import kit
from workflow.train.models.kit import (ACTIVATIONS, Unpadded, VarlenAttention, at_positions, count_parameters,
                                       gather_positions, host_indices, load_weights, pretraining_loss,
                                       read_config_json, row_attention, unpad)
from workflow.train.models.heads import QUESTION_ANSWERING, SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION

_PRESETS = {
    "bert-large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    "bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    # CPU demo model: minutes on a laptop for the sample data.
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512,
                 max_position_embeddings=512),
}


@dataclass
class BertConfig:
    """BERT hyper-parameters, named as in Google's bert_config.json."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise UserError(f"bert config: hidden_size {self.hidden_size} is not a multiple of "
                            f"num_attention_heads {self.num_attention_heads}")
        if self.hidden_act not in ACTIVATIONS:
            raise UserError(f"bert config: hidden_act {self.hidden_act!r} is not one of {sorted(ACTIVATIONS)}")

    @classmethod
    def preset(cls, name: str, **overrides) -> "BertConfig":
        if name not in _PRESETS:
            raise UserError(f"config model.preset: unknown preset {name!r} (one of {sorted(_PRESETS)})")
        return cls(**{**_PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls, data: dict) -> "BertConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "BertConfig":
        return cls.from_dict(read_config_json(path))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self, path: str | os.PathLike, architecture: str = "BertForPreTraining") -> None:
        """Write config.json readable both as a Google bert_config.json and by transformers; `architecture` says
        which heads the weights hold (BertForMaskedLM: no NSP head)."""
        data = {**self.to_dict(), "model_type": "bert", "architectures": [architecture],
                "tie_word_embeddings": True}
        Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids, token_type_ids, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[-1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(position_ids) + self.token_type_embeddings(
            token_type_ids)
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout_p = config.attention_probs_dropout_prob

    def forward(self, x, attention):
        """x: [B, L, H] rows or [T, H] tokens, as `attention` expects."""
        if isinstance(attention, VarlenAttention):
            # Nested tensors need contiguous q, k and v: three matmuls rather than copies.
            q, k, v = (layer(x).unflatten(-1, (self.num_heads, -1)) for layer in (self.query, self.key, self.value))
        else:
            # One matmul for q, k and v (names stay HF's; concatenating the weights costs <1% of the matmul).
            weight = torch.cat([self.query.weight, self.key.weight, self.value.weight])
            bias = torch.cat([self.query.bias, self.key.bias, self.value.bias])
            q, k, v = F.linear(x, weight, bias).unflatten(-1, (3, self.num_heads, -1)).unbind(-3)
        return attention(q, k, v, self.dropout_p if self.training else 0.0).flatten(-2)


class BertSelfOutput(nn.Module):
    def __init__(self, config: BertConfig, in_size: int):
        super().__init__()
        self.dense = nn.Linear(in_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x, residual):
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config, config.hidden_size)

    def forward(self, x, attention):
        return self.output(self.self(x, attention), x)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x):
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertSelfOutput(config, config.intermediate_size)

    def forward(self, x, attention):
        x = self.attention(x, attention)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x, attention):
        for layer in self.layer:
            x = layer(x, attention)
        return x


class BertPooler(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, first_token):
        """The pooled output of each sequence's first ([CLS]) token."""
        return torch.tanh(self.dense(first_token))


def _init_weights(module: nn.Module, std: float) -> None:
    """BERT's initialisation: N(0, initializer_range) weights, zero biases, unit LayerNorm."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            with torch.no_grad():
                module.weight[module.padding_idx].zero_()
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


class BertModel(nn.Module):
    """The BERT encoder: embeddings, transformer layers, pooler (HF's add_pooling_layer: a head that reads no pooled
    output goes without, as HF's token classification does, so that DDP finds no parameter outside the loss)."""

    def __init__(self, config: BertConfig, add_pooling_layer: bool = True):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.apply(lambda m: _init_weights(m, config.initializer_range))

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, position_ids=None, cls_positions=None,
                mask_needed: bool | None = None):
        """(sequence_output [B, L, H], pooled_output [B, H], or [B, S, H] for packed rows: see the module doc; None
        without a pooler). `mask_needed`: see encode."""
        sequence_output = self.encode(input_ids, token_type_ids, attention_mask, position_ids,
                                      cls_positions is not None, mask_needed=mask_needed)
        if self.pooler is None:
            return sequence_output, None
        first = sequence_output[:, 0] if cls_positions is None else gather_positions(sequence_output, cls_positions)
        return sequence_output, self.pooler(first)

    def encode(self, input_ids, token_type_ids=None, attention_mask=None, position_ids=None, packed=False,
               unpadded: Unpadded | None = None, mask_needed: bool | None = None):
        """The last layer's output [B, L, H]. Packed rows on the devices of VARLEN_DEVICE_TYPES run laid end to end,
        [B * L, H], through VarlenAttention (`unpadded`: their sequences as host_indices found them, else found here
        with host syncs); other rows with row_attention (`mask_needed`: see there). Every shape is the rows'."""
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        if packed and (attention_mask is None or position_ids is None):
            raise ValueError("packed rows need attention_mask (sequence numbers) and position_ids")
        x = self.embeddings(input_ids, token_type_ids, position_ids)
        if packed and input_ids.device.type in kit.VARLEN_DEVICE_TYPES:
            if unpadded is None:
                unpadded = unpad(attention_mask)
            attention = VarlenAttention(unpadded.offsets, unpadded.min_seqlen, unpadded.max_seqlen)
            return self.encoder(x.flatten(0, 1), attention).view_as(x)
        return self.encoder(x, row_attention(attention_mask, packed, mask_needed))


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACTIVATIONS[config.hidden_act]
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x):
        return self.LayerNorm(self.act(self.dense(x)))


class BertLMPredictionHead(nn.Module):
    """Transform + decoder; the decoder weight is the word embedding matrix (tied), its bias is `bias`."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, x, decoder_weight):
        return F.linear(self.transform(x), decoder_weight, self.bias)


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)


class BertForPreTraining(nn.Module):
    """BERT with the masked-LM and next-sentence heads."""

    base_model_prefix = "bert"  # HF's: the encoder's name

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.bert = BertModel(config)
        self.cls = BertPreTrainingHeads(config)
        self.cls.apply(lambda m: _init_weights(m, config.initializer_range))

    def forward(self, input_ids, token_type_ids, attention_mask, masked_lm_positions, position_ids=None,
                cls_positions=None, masked_lm_valid=None, masked_lm_index=None, unpadded: Unpadded | None = None,
                mask_needed: bool | None = None, return_hidden: bool = False):
        """(mlm_logits, nsp_logits), or with `return_hidden` the MLM head's hidden states before its decoder
        (mlm_decoder(): a fused loss takes them, no logits made) in the logits' place; the MLM head runs at the
        prediction slots only (the vocab projection dominates a small model's cost): [B, P, V] at every slot of `masked_lm_positions` [B, P], or, with `masked_lm_valid`
        [B, P], [M, V] at its M real slots (row-major order; a host sync on CUDA), or, with `masked_lm_index` [N]
        (host_indices: every slot, N = B * P, a fixed shape), [N, V] at those row-major positions without a host
        sync; `unpadded` gives packed rows' sequences and `mask_needed` whether the rows need a mask (see encode)."""
        batch, length = input_ids.shape
        rows = torch.arange(batch, device=input_ids.device).unsqueeze(1) * length
        flat = masked_lm_positions.long() + rows
        if masked_lm_index is not None:
            predicted = masked_lm_index
        else:  # M depends on the data: without masked_lm_index the selection syncs once with the host on CUDA
            predicted = flat.flatten() if masked_lm_valid is None else flat[masked_lm_valid]
        hidden = self.bert.encode(input_ids, token_type_ids, attention_mask, position_ids, cls_positions is not None,
                                  unpadded, mask_needed)
        first = rows.squeeze(1) if cls_positions is None else cls_positions.long() + rows
        mlm_logits, nsp_logits = self._heads(at_positions(hidden, predicted),
                                             self.bert.pooler(at_positions(hidden, first)), return_hidden)
        selected = masked_lm_valid is not None or masked_lm_index is not None
        return (mlm_logits if selected else mlm_logits.view(*flat.shape, -1)), nsp_logits

    def _heads(self, predicted, pooled_output, return_hidden: bool = False):
        """(MLM logits of the `predicted` hidden states, or their transform with `return_hidden`; NSP logits of the
        pooled outputs)."""
        if return_hidden:
            mlm = self.cls.predictions.transform(predicted)
        else:
            mlm = self.cls.predictions(predicted, self.bert.embeddings.word_embeddings.weight)
        return mlm, self.cls.seq_relationship(pooled_output)

    def mlm_decoder(self):
        """(weight [V, H], bias [V]) of the MLM head's decoder: the tied word embeddings and the head's bias."""
        return self.bert.embeddings.word_embeddings.weight, self.cls.predictions.bias


# ---------------------------------------------------------------- Hugging Face directories

_TIED_ALIASES = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")
NSP_HEAD = "cls.seq_relationship."  # the next-sentence head's weights (left out of a model trained without NSP)


def save_pretrained(model: nn.Module, config: BertConfig, vocab_path: str | os.PathLike | None,
                    out_dir: str | os.PathLike, normalization=None, next_sentence_prediction: bool = True) -> None:
    """Write an HF directory (model.safetensors, config.json, the vocab's files: workflow.data.tokenizer's
    save_tokenizer; a tokenizer.json comes with its tokenizer_config.json) into `out_dir` (created); with a vocab.txt
    and `normalization` (workflow.data.vocab.Normalization: how the vocab was built and the data tokenized), also
    tokenizer_config.json, so that `AutoTokenizer.from_pretrained` loads BERT's WordPiece tokenizer that lower-cases,
    strips accents and splits CJK characters exactly as the data was tokenized. Without `next_sentence_prediction` (a model trained without NSP), the untrained NSP head is left out and
    config.json says BertForMaskedLM."""
    from safetensors.torch import save_file

    model = getattr(model, "module", model)  # unwrap DDP
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", torch.float32).contiguous().clone()
             for k, v in model.state_dict().items()
             if k not in _TIED_ALIASES and (next_sentence_prediction or not k.startswith(NSP_HEAD))}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.to_json(out_dir / "config.json", "BertForPreTraining" if next_sentence_prediction else "BertForMaskedLM")
    if vocab_path is not None:
        from workflow.data.tokenizer import save_tokenizer

        save_tokenizer(vocab_path, out_dir, normalization, config.max_position_embeddings)


def _normalise_names(state: dict) -> dict:
    """Map older/other BERT checkpoint spellings onto BertForPreTraining names."""
    out = dict(state)
    if "cls.predictions.bias" not in out and "cls.predictions.decoder.bias" in out:
        out["cls.predictions.bias"] = out["cls.predictions.decoder.bias"]
    for key in (*_TIED_ALIASES, "bert.embeddings.position_ids"):
        out.pop(key, None)
    return out


def load_pretrained(directory: str | os.PathLike) -> tuple[BertConfig, dict]:
    """(config, state_dict) of an HF BERT directory (its weights as hf_weights reads them); never unpickles
    arbitrary objects."""
    from workflow.train.models.hf_weights import read_weights

    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise UserError(f"{directory}: not a BERT model directory (no config.json)")
    config = BertConfig.from_json(config_path)
    return config, _normalise_names(read_weights(directory, str(directory), BertForPreTraining.base_model_prefix))


def encoder_state_dict(state: dict) -> dict:
    """The encoder's entries (`bert.` stripped), ready for BertModel.load_state_dict."""
    return {k[len("bert."):]: v for k, v in state.items() if k.startswith("bert.")}


class BertHeadParts:
    """BERT's fine-tuning heads under HF's names (BertFor<kind>, workflow/train/models/heads.py): the encoder `bert`;
    question answering `qa_outputs` on every token (the pooler kept, frozen: a masked-LM export has none);
    token classification `dropout` and `classifier` on every token (no pooler: under DDP its parameters would take
    no part in the loss); sequence classification the same on the pooled [CLS] output."""

    encoder_name, model_class, class_prefix = "bert", BertModel, "Bert"

    @staticmethod
    def has_pooler(kind: str) -> bool:
        return kind != TOKEN_CLASSIFICATION

    def build(self, head: nn.Module, kind: str, config: BertConfig, num_labels: int) -> None:
        head.add_module(self.encoder_name, self.model_class(config, add_pooling_layer=self.has_pooler(kind)))
        if kind == QUESTION_ANSWERING:
            if self.has_pooler(kind):  # unused by QA; frozen so DDP does not wait for its gradients
                self.encoder(head).pooler.requires_grad_(False)
            head.qa_outputs = self.linear(config, num_labels)
            return
        head.dropout = nn.Dropout(config.hidden_dropout_prob)
        head.classifier = (self.sequence_classifier(config, num_labels) if kind == SEQUENCE_CLASSIFICATION
                           else self.linear(config, num_labels))

    @staticmethod
    def linear(config: BertConfig, outputs: int) -> nn.Linear:
        """A head's linear layer (hidden -> `outputs`), initialised as HF does."""
        layer = nn.Linear(config.hidden_size, outputs)
        nn.init.normal_(layer.weight, std=config.initializer_range)
        nn.init.zeros_(layer.bias)
        return layer

    def sequence_classifier(self, config: BertConfig, num_labels: int) -> nn.Module:
        return self.linear(config, num_labels)

    def encoder(self, head: nn.Module) -> nn.Module:
        return getattr(head, self.encoder_name)

    def logits(self, head, kind, input_ids, token_type_ids, attention_mask, mask_needed=None, unpadded=None):
        sequence, pooled = self.encoder(head)(input_ids, token_type_ids, attention_mask, mask_needed=mask_needed)
        if kind == QUESTION_ANSWERING:
            return head.qa_outputs(sequence)
        if kind == SEQUENCE_CLASSIFICATION:
            return self.classify_sequence(head, sequence, pooled)
        return head.classifier(head.dropout(sequence))

    @staticmethod
    def classify_sequence(head: nn.Module, sequence, pooled):
        return head.classifier(head.dropout(pooled))

    @staticmethod
    def output_layer(kind: str) -> str:
        return "qa_outputs." if kind == QUESTION_ANSWERING else "classifier."

    def fresh_prefixes(self, kind: str) -> tuple:
        pooler = (f"{self.encoder_name}.pooler.",) if kind == QUESTION_ANSWERING and self.has_pooler(kind) else ()
        return (self.output_layer(kind), *pooler)

    def class_name(self, config: BertConfig, kind: str) -> str:
        return f"{self.class_prefix}For{kind}"


HEAD_PARTS = BertHeadParts()


def flops_per_sequence(config: BertConfig, seq_length: int, max_predictions: float) -> float:
    """Training FLOPs of one sequence (forward + backward = 3x forward), matmuls only.

    Per layer and token: 24·h² (QKV, output, 2 FFN with i = 4h: 2·(4h² + 2·h·i)) + 4·L·h (scores and context);
    plus the MLM head at the masked positions (2·h² + 2·h·V per prediction) and the pooler/NSP (negligible).
    """
    h, n, i, v = config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size
    per_token_layer = 2 * (4 * h * h + 2 * h * i) + 4 * seq_length * h
    forward = n * seq_length * per_token_layer + max_predictions * (2 * h * h + 2 * h * v) + 2 * h * h
    return 3.0 * forward


__all__ = ["BertConfig", "BertModel", "BertForPreTraining", "pretraining_loss", "save_pretrained", "host_indices",
           "load_pretrained", "encoder_state_dict", "load_weights", "count_parameters", "flops_per_sequence",
           "HEAD_PARTS"]
