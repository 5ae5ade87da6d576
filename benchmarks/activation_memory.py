"""The activation memory of a training forward, measured on CPU: the memory half of the GPU projections
(modernbert_projection.py, bert_projection.py).

API:
    saved_bytes(model, rows, length, masking, fused_loss=False, varlen=False) -> int   bytes a bf16-autocast
        training forward of a pretraining model (either family's forward signature) keeps for its backward, on `rows`
        full rows of `length` tokens, round(masking * length) of each row's predicted, the MLM loss at those slots
        included, parameters left out, each storage counted once, dropout keeping CUDA's bool masks (cuda_dropout).
        The loss: fused_loss=False through the logits and an fp32 cross-entropy (the reference path); True as liger's
        fused linear cross-entropy keeps it on a GPU (pretrain.fused_loss), which does not run here: no logits, and
        the gradients it computes in its forward, of the head's hidden states (in their dtype) and of the decoder's
        weight and bias (fp32), counted from their shapes (fused_loss_bytes). The attention: varlen=False the CPU's
        rows with dense masks; True the path CUDA trains (gpu_attention)
    activation_fit(model, lengths, rows, masking, fused_loss=False, varlen=False) -> (saved bytes at each of three
        lengths, (c, a, b))   the fit c + a * N + b * N * L of the saved bytes for N tokens in rows of L: c is kept
        once per forward (autocast's bf16 copy of the weights; the fused loss's decoder gradient), a per token, b
        per token per token of row: the dense CPU attention's probabilities, which a flash kernel does not keep (it
        recomputes them from its log-sum-exp); on the varlen path b is ~0
    fused_loss_bytes(hidden, weight, bias) -> int   what liger's kernel keeps from its forward to its backward
    cuda_dropout(), gpu_attention()   the contexts that make a CPU forward keep what a CUDA one keeps
    saved_storages(excluded) -> {data_ptr: bytes}   a context: the storages autograd saves inside it
    most_rows(static, per_token, length) -> [int]   the most rows of `length` tokens whose kept bytes fit beside
        `static` bytes in USABLE of each of MEMORY_GB (eager: the backward's transients live in the rest)
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from workflow.train.models import kit

MEMORY_GB = (40, 80, 141)  # A100 40GB; A100 80GB, H100; H200
USABLE = 0.9  # of a GPU's memory; the rest for the allocator's fragments, CUDA's context and workspaces


def saved_bytes(model, rows: int, length: int, masking: float, fused_loss: bool = False, varlen: bool = False) -> int:
    """See the module docstring."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    input_ids = torch.randint(5, vocab, (rows, length), generator=generator)
    count = round(masking * length)  # the same count in every row: the fit sees no sampling noise
    positions = [torch.randperm(length, generator=generator)[:count].sort().values for _ in range(rows)]
    masked_lm_positions = torch.stack(positions)
    valid = torch.ones_like(masked_lm_positions, dtype=torch.bool)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    packed = {"position_ids": torch.arange(length).expand(rows, length),
              "cls_positions": torch.zeros(rows, 1, dtype=torch.long)} if varlen else {}
    with saved_storages(parameters) as storages, torch.autocast("cpu", dtype=torch.bfloat16), cuda_dropout(), \
            gpu_attention() if varlen else contextlib.nullcontext():
        output, _ = model(input_ids, torch.zeros_like(input_ids), torch.ones_like(input_ids), masked_lm_positions,
                          masked_lm_valid=valid, return_hidden=fused_loss, **packed)
        if fused_loss:
            kept = fused_loss_bytes(output, *model.mlm_decoder())
        else:
            F.cross_entropy(output.float(), input_ids.gather(1, masked_lm_positions)[valid])  # counted as it runs
            kept = 0
    return sum(storages.values()) + kept


@contextlib.contextmanager
def saved_storages(excluded=frozenset()):
    """{data_ptr: bytes} of the storages autograd saves for the backward inside the context, each once, those whose
    data_ptr is in `excluded` left out."""
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield storages


@contextlib.contextmanager
def cuda_dropout():
    """Dropout as CUDA runs it, aten's native_dropout, which keeps a bool mask for the backward (on CPU F.dropout
    keeps its scaled noise in the input's dtype: 2-4x the bytes)."""
    saved = F.dropout

    def native(input, p=0.5, training=True, inplace=False):
        return torch.native_dropout(input, p, training)[0] if training and 0.0 < p < 1.0 else input

    F.dropout = native
    try:
        yield
    finally:
        F.dropout = saved


@contextlib.contextmanager
def gpu_attention():
    """CPU rows on the path CUDA takes: laid end to end through flash_varlen's custom ops (its exact CPU reference
    keeps for the backward what the flash kernels keep: q, k, v, the output and the log-sum-exp)."""
    saved = kit.VARLEN_DEVICE_TYPES
    kit.VARLEN_DEVICE_TYPES = (*saved, "cpu")
    try:
        yield
    finally:
        kit.VARLEN_DEVICE_TYPES = saved


def fused_loss_bytes(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """See the module docstring (liger-kernel 0.8.5, reduction "sum": grad_input like the hidden states, grad_weight
    and grad_bias accumulated in fp32, as fused_loss.py calls it, then cast to the parameters' fp32)."""
    fp32_parameters = weight.numel() + (0 if bias is None else bias.numel())
    return hidden.numel() * hidden.element_size() + 4 * fp32_parameters


def activation_fit(model, lengths, rows: int, masking: float, fused_loss: bool = False, varlen: bool = False
                   ) -> tuple[list[int], tuple[float, ...]]:
    """See the module docstring."""
    measured = [saved_bytes(model, rows, length, masking, fused_loss, varlen) for length in lengths]
    design = torch.tensor([[1.0, rows * length, rows * length * length] for length in lengths], dtype=torch.float64)
    fit = torch.linalg.solve(design, torch.tensor(measured, dtype=torch.float64)).tolist()
    return measured, tuple(fit)


def most_rows(static: float, per_token: float, length: int) -> list[int]:
    """See the module docstring."""
    return [int((gb * 1e9 * USABLE - static) // (per_token * length)) for gb in MEMORY_GB]
