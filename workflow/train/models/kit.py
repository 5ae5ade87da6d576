"""The shared encoder kit: what every family's model uses alike.

API:
    ACTIVATIONS                     HF's activation names -> functions ("gelu" exact, "gelu_new" / "gelu_pytorch_tanh")
    read_config_json(path) -> dict  a config.json / bert_config.json (an unreadable file refused in one line)
    RowAttention, row_attention(attention_mask, packed, mask_needed)   SDPA over rows with the rows' mask
    VarlenAttention(offsets, min_seqlen, max_seqlen)   attention within each sequence of tokens laid end to end
    Unpadded, unpad(attention_mask, sequences_per_row), UNPADDED_KEYS, unpadded_of(batch)   rows laid end to end
                                    for VarlenAttention (one graph under torch.compile)
    host_indices(batch) -> batch    the indices a forward would read back from the device, computed on the host
    gather_positions(x, positions), at_positions(hidden, flat)   the encoder output at given positions
    pretraining_loss(...), next_sentence_terms(...)   the MLM (+ NSP) loss and accuracies
    load_weights(model, state), count_parameters(model)

VARLEN_DEVICE_TYPES: the devices where packed rows run as sequences laid end to end (CUDA); FLASH_VARLEN: 16-bit
CUDA (and CPU, its exact reference) takes workflow.train.models.flash_varlen's custom ops, which torch.compile traces
(False: nested SDPA, benchmarks/train_step.py's comparison).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from workflow.cli import UserError
from workflow.train import accelerator
from workflow.train.models import kernels
from workflow.train.models.flash_varlen import flash_varlen, runs_flash_varlen


def read_config_json(path: str | os.PathLike) -> dict:
    """The fields of a bert_config.json or config.json, as written (an unreadable file refused in one line)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise UserError(f"{path}: cannot read a bert config: {error}") from None


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


# Hugging Face's names: "gelu" is the exact (erf) GELU, "gelu_pytorch_tanh" and "gelu_new" its tanh approximation.
ACTIVATIONS = {"gelu": F.gelu, "gelu_new": _gelu_tanh, "gelu_pytorch_tanh": _gelu_tanh, "relu": F.relu,
                "swish": F.silu, "tanh": torch.tanh}


VARLEN_DEVICE_TYPES = ("cuda",)  # packed batches run unpadded there; elsewhere with a block-diagonal mask on rows


FLASH_VARLEN = True  # 16-bit CUDA: flash_varlen (False: nested SDPA, benchmarks/train_step.py's comparison)


class RowAttention:
    """SDPA over rows ([B, L, heads, head_size] q, k, v), with a boolean mask (True = attend) or none."""

    def __init__(self, mask=None):
        self.mask = mask

    def __call__(self, q, k, v, dropout_p):
        context = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=self.mask, dropout_p=dropout_p)
        return context.transpose(1, 2)


class VarlenAttention:
    """Attention within each sequence of tokens laid end to end ([T, heads, head_size] q, k, v; sequence i is
    tokens offsets[i]..offsets[i+1], possibly empty), with dropout: on CUDA in 16-bit torch's variable-length flash
    kernels called once per layer, on CPU their exact reference (workflow.train.models.flash_varlen's custom ops,
    while FLASH_VARLEN); otherwise, the exact path (CUDA fp32, a GPU or torch below the flash floor: kernels.py),
    nested jagged tensors' SDPA in eager (its fused kernels take no empty sequence, so with the padded offsets it falls
    back to its math kernel: train in 16-bit) and, under torch.compile, where nested tensors break the graph and
    recompile for every packing, SDPA over the rows the tokens come from with a block-diagonal mask."""

    def __init__(self, offsets, min_seqlen: int, max_seqlen: int):
        self.offsets, self.min_seqlen, self.max_seqlen = offsets, min_seqlen, max_seqlen
        self.offsets32 = offsets.to(torch.int32)  # the flash kernels' cu_seqlens
        self._row_attention = None  # compiled exact path: the rows' block-diagonal attention, made once for the layers

    def _nested(self, x):
        return accelerator.jagged(x, self.offsets, self.min_seqlen, self.max_seqlen).transpose(1, 2)

    def __call__(self, q, k, v, dropout_p):
        if FLASH_VARLEN and runs_flash_varlen(q) and (kernel := kernels.bert_flash_kernel(q.device, flash_varlen)):
            return kernel(q, k, v, self.offsets32, self.max_seqlen, dropout_p)
        if torch.compiler.is_compiling():
            return self._rows(q, k, v, dropout_p)
        context = F.scaled_dot_product_attention(self._nested(q), self._nested(k), self._nested(v),
                                                 dropout_p=dropout_p)
        return context.transpose(1, 2).values()

    def _rows(self, q, k, v, dropout_p):
        """The same attention on the rows of max_seqlen tokens that unpad laid end to end, each token seeing its own
        sequence (padding runs are sequences of their own): static shapes, one graph for every packing."""
        length = self.max_seqlen
        if self._row_attention is None:
            tokens = torch.arange(q.shape[0], device=q.device)
            sequence = torch.searchsorted(self.offsets, tokens, right=True).view(-1, length)
            self._row_attention = RowAttention((sequence[:, :, None] == sequence[:, None, :])[:, None])
        return self._row_attention(*(x.unflatten(0, (-1, length)) for x in (q, k, v)), dropout_p).flatten(0, 1)


def row_attention(attention_mask, packed: bool, mask_needed: bool | None = None) -> RowAttention:
    """The rows' attention: no mask when no token is padding and each row is one sequence (`mask_needed`: whether
    some is, as host_indices found; else read from the mask, a host sync on CUDA)."""
    if mask_needed is None and attention_mask is not None:
        mask_needed = not bool((attention_mask == 1).all())
    if not mask_needed:
        return RowAttention()
    if packed:
        # Block diagonal: a token sees its own sequence only; padding (0) sees padding only, so no row is empty.
        return RowAttention((attention_mask[:, :, None] == attention_mask[:, None, :])[:, None])
    # [B, 1, 1, L]: padding queries still attend to real keys (as in HF).
    return RowAttention(attention_mask.bool()[:, None, None, :])


class Unpadded(NamedTuple):
    """Rows laid end to end for the varlen attention: every row-major position [B * L] of the rows (`tokens`, a static
    shape; padding runs form sequences of their own, so padding attends to padding only), the offsets of their
    sequences (cu_seqlens: the rows' runs padded with empty sequences to the next power of two, at most B * (S + 1) for
    rows of at most S sequences) and the kernels' bounds on a sequence's length, 0 and L (host ints, the same for
    every micro-batch: never read from the data, so no host sync happens).
    The offsets' length is the one shape that varies, marked dynamic for torch.compile (unpadded_of): one graph. It
    is tight because the flash kernels' cost follows it: their grid is ceil(L/128) x sequences x heads blocks and
    the varlen backward allocates (T + 128 x sequences) x heads x head_size fp32 for dQ. At 8,192 with auto's 2,730
    slots a row, 16 rows of 95-token documents hold ~1,392 runs: 2,048 sequences, where all 43,696 slots would
    launch 34 M blocks a call and allocate 17.6 GB (ModernBERT-base's 12 heads of 64)."""
    tokens: torch.Tensor
    offsets: torch.Tensor
    min_seqlen: int
    max_seqlen: int


def unpad(attention_mask, sequences_per_row: int | None = None) -> Unpadded:
    """Rows of sequence numbers (0 = padding; 1/0 for rows of one sequence) laid end to end (see Unpadded), for rows
    of at most `sequences_per_row` sequences (packed rows: cls_positions' width; None: the mask's largest number,
    read from it). Reads the mask's values: on the host where the batch is built (host_indices), or, given a device's
    mask, with host syncs."""
    batch, length = attention_mask.shape
    if sequences_per_row is None:
        sequences_per_row = max(int(attention_mask.max()), 1) if attention_mask.numel() else 1
    flat = attention_mask.flatten()
    positions = torch.arange(batch * length, device=flat.device)
    sequence = positions // length * (length + 1) + flat  # unique per (row, sequence number); a padding run too
    first = torch.ones_like(sequence, dtype=torch.bool)
    first[1:] = sequence[1:] != sequence[:-1]
    starts = first.nonzero().squeeze(1)
    capacity = batch * (sequences_per_row + 1)  # each row's sequences and its padding run
    if len(starts) > capacity:
        raise ValueError(f"rows hold {len(starts)} runs of sequences and padding, more than {sequences_per_row} "
                         "sequences and one padding run per row")
    count = min(capacity, 1 << (len(starts) - 1).bit_length())  # a few lengths a phase (CUDA graphs record each)
    offsets = torch.cat([starts, starts.new_full((count + 1 - len(starts),), batch * length)])
    return Unpadded(positions, offsets, 0, length)


UNPADDED_KEYS = ("unpadded_tokens", "cu_seqlens", "min_seqlen", "max_seqlen")  # host_indices' entries of Unpadded


def host_indices(batch: dict) -> dict:
    """`batch` (on the host, as the loader builds it) plus every index its forward would otherwise read back from the
    device, so that no host sync remains in the forward of a micro-batch, all in shapes fixed by the batch's: 
    masked_lm_index [B * P] (row-major positions of every prediction slot in the [B, L] rows) and masked_lm_targets
    [B * P] (their labels, -1 at empty slots); for packed rows also Unpadded's fields (UNPADDED_KEYS; min_seqlen and
    max_seqlen as ints); mask_needed (a bool): whether some token is padding or some row holds several sequences (else
    attention runs without a mask: SDPA may pick flash)."""
    labels = batch["masked_lm_labels"]
    length = batch["input_ids"].shape[1]
    rows = torch.arange(len(labels)).unsqueeze(1) * length
    extra = {"masked_lm_index": (batch["masked_lm_positions"].long() + rows).flatten(),
             "masked_lm_targets": labels.flatten(), "mask_needed": not bool((batch["attention_mask"] == 1).all())}
    if "cls_positions" in batch:
        extra.update(zip(UNPADDED_KEYS, unpad(batch["attention_mask"], batch["cls_positions"].shape[1])))
    return {**batch, **extra}


def unpadded_of(batch: dict) -> Unpadded | None:
    """The Unpadded that host_indices put into `batch` (None: not computed there), its offsets' length marked dynamic
    for torch.compile (one graph whatever the micro-batch's count of sequences; nothing in eager)."""
    if UNPADDED_KEYS[0] not in batch:
        return None
    unpadded = Unpadded(*(batch[key] for key in UNPADDED_KEYS))
    torch._dynamo.maybe_mark_dynamic(unpadded.offsets, 0)
    return unpadded


def gather_positions(x, positions):
    """x [B, L, H] at positions [B, P] -> [B, P, H]."""
    return torch.gather(x, 1, positions.long().unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def at_positions(hidden, flat):
    """The encoder output hidden [B, L, H] at row-major positions `flat` (any shape) of the rows -> [*flat.shape, H]."""
    return hidden.flatten(0, 1)[flat]


def pretraining_loss(mlm_logits, nsp_logits, masked_lm_labels, next_sentence_labels) -> dict:
    """Summed MLM + NSP loss (as in BERT), each the mean over its labelled items, and accuracies. Labels of -1
    (empty prediction slots, empty sequence slots of packed rows) are ignored."""
    mlm_logits = mlm_logits.float().flatten(0, -2)
    labels = masked_lm_labels.flatten()
    mlm_loss = F.cross_entropy(mlm_logits, labels, ignore_index=-1)
    with torch.no_grad():
        valid = labels >= 0
        mlm_correct = ((mlm_logits.argmax(-1) == labels) & valid).sum()
    nsp = next_sentence_terms(nsp_logits, next_sentence_labels.flatten().long(), mlm_loss)
    return {"loss": mlm_loss + nsp["nsp_loss"], "mlm_loss": mlm_loss, "mlm_correct": mlm_correct,
            "mlm_count": valid.sum(), **nsp}


def next_sentence_terms(nsp_logits, nsp_labels, mlm_loss, normaliser=None) -> dict:
    """nsp_loss (summed / `normaliser`, else the mean), nsp_correct and nsp_count over the labels that are not -1;
    a model without a next-sentence head (nsp_logits None: ModernBERT) has a zero loss and counts nothing."""
    if nsp_logits is None:
        zero = torch.zeros((), dtype=torch.long, device=mlm_loss.device)
        return {"nsp_loss": mlm_loss * 0.0, "nsp_correct": zero, "nsp_count": zero}
    nsp_logits = nsp_logits.float().flatten(0, -2)
    if normaliser is None:
        nsp_loss = F.cross_entropy(nsp_logits, nsp_labels, ignore_index=-1)
    else:
        nsp_loss = F.cross_entropy(nsp_logits, nsp_labels, ignore_index=-1, reduction="sum") / normaliser
    with torch.no_grad():
        nsp_valid = nsp_labels >= 0
        nsp_correct = ((nsp_logits.argmax(-1) == nsp_labels) & nsp_valid).sum()
    return {"nsp_loss": nsp_loss, "nsp_correct": nsp_correct, "nsp_count": nsp_valid.sum()}


def load_weights(model: nn.Module, state: dict) -> tuple[list[str], list[str]]:
    """Load matching entries into `model`; shapes must agree. Returns (missing, unexpected) keys."""
    own = model.state_dict()
    for key, value in state.items():
        if key in own and own[key].shape != value.shape:
            raise UserError(f"weights {key}: shape {tuple(value.shape)} does not match the model's "
                            f"{tuple(own[key].shape)}")
    result = model.load_state_dict(state, strict=False)
    return list(result.missing_keys), list(result.unexpected_keys)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
