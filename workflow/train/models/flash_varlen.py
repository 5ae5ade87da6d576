"""Variable-length flash attention with dropout: BERT's unpadded attention on CUDA in 16-bit.

torch's public `torch.nn.attention.varlen.varlen_attn` (ModernBERT's path) has no dropout, and BERT's recipe trains
with attention dropout 0.1. Nested jagged tensors' SDPA reaches the same flash kernel with dropout, but each of its
ops goes through Python dispatch: on an H200, BERT-large's packed micro-batches ran at 0.25x (seq 128) and 0.31x
(seq 512) of the padded ones (docs/gpu.md). This calls the kernels those two paths call,
`aten._flash_attention_forward` and `aten._flash_attention_backward`, once each per layer, as varlen_attn does
(torch/nn/attention/varlen.py), with the dropout probability handed through: the backward regenerates the forward's
dropout mask from the RNG state the forward returns.

API:
    flash_varlen(q, k, v, offsets, max_seqlen, dropout_p) -> [T, heads, head_size]   q, k, v [T, heads, head_size]
        (16-bit, CUDA), sequence i is tokens offsets[i]..offsets[i+1] (int32, on the device); no host sync
    runs_flash_varlen(q) -> bool   whether flash_varlen takes these tensors (CUDA, fp16/bf16, head size <= 256 and a
        multiple of 8); the caller runs nested SDPA otherwise (fp32: the memory-efficient kernel)
"""
from __future__ import annotations

import torch

FLASH_DTYPES = (torch.float16, torch.bfloat16)


def runs_flash_varlen(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in FLASH_DTYPES and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0


class _FlashVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, offsets, max_seqlen: int, dropout_p: float):
        out, lse, rng_state, _, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, offsets, offsets, max_seqlen, max_seqlen, dropout_p, False, False)
        ctx.save_for_backward(q, k, v, offsets, out, lse, rng_state)
        ctx.max_seqlen, ctx.dropout_p = max_seqlen, dropout_p
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, offsets, out, lse, rng_state = ctx.saved_tensors
        unused = torch.empty(0, device=q.device)  # the philox offset travels inside rng_state
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, offsets, offsets, ctx.max_seqlen, ctx.max_seqlen,
            ctx.dropout_p, False, rng_state, unused)
        return dq, dk, dv, None, None, None


def flash_varlen(q, k, v, offsets, max_seqlen: int, dropout_p: float = 0.0):
    """See the module docstring."""
    offsets = offsets.to(torch.int32)
    return _FlashVarlen.apply(q.contiguous(), k.contiguous(), v.contiguous(), offsets, max_seqlen, dropout_p)
