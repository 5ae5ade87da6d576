"""Variable-length flash attention with dropout and an optional window: both families' unpadded attention, as
`torch.library` custom ops that torch.compile traces without a graph break.

torch's public `torch.nn.attention.varlen.varlen_attn` has no dropout, and BERT's recipe trains with attention dropout
0.1. Nested jagged tensors' SDPA reaches the same flash kernel with dropout, but each of its ops goes through Python
dispatch: on an H200, BERT-large's packed micro-batches ran at 0.25x (seq 128) and 0.31x (seq 512) of the padded ones
(docs/gpu.md). On CUDA this calls the kernels those two paths call, `aten._flash_attention_forward` and
`aten._flash_attention_backward`, once each per layer, as varlen_attn does (torch/nn/attention/varlen.py), with the
dropout probability and the window handed through: the backward regenerates the forward's dropout mask from the RNG
state the forward returns. On CPU the same ops run an exact reference (a dense block-diagonal, banded mask built
from the offsets inside the op), so that the unpadded path runs, compiles and is tested on CPU.

The ops take zero-length sequences (repeated offsets) and a max_seqlen at least the longest sequence: callers pad
cu_seqlens with empty sequences to a power of two (its length marked dynamic) and pass the row length, so that
a compiled graph is one (kit.unpad).

API:
    flash_varlen(q, k, v, offsets, max_seqlen, dropout_p=0.0, window=None) -> [T, heads, head_size]
        q, k, v [T, heads, head_size] (CUDA: 16-bit, see runs_flash_varlen; CPU: any float dtype); sequence i is
        tokens offsets[i]..offsets[i+1] (on q's device); window: keys at most that many tokens away on each side
        (None: the whole sequence); no host sync on CUDA
    runs_flash_varlen(q) -> bool   whether flash_varlen takes these tensors: CPU (the reference), or CUDA in fp16/bf16
        with a head size <= 256 and a multiple of 8; the caller runs nested SDPA otherwise (CUDA fp32)
    torch.ops.snakebert.flash_varlen_forward / flash_varlen_backward   the custom ops (fake and autograd registered)
"""
# no `from __future__ import annotations`: torch 2.4's custom_op reads the annotations below as types, not strings

import torch

FLASH_DTYPES = (torch.float16, torch.bfloat16)


def runs_flash_varlen(q: torch.Tensor) -> bool:
    if q.device.type == "cpu":
        return True
    return q.is_cuda and q.dtype in FLASH_DTYPES and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0


@torch.library.custom_op("snakebert::flash_varlen_forward", mutates_args=())
def flash_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, max_seqlen: int,
                         dropout_p: float, window_left: int, window_right: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [T, heads, head_size], logsumexp [heads, T] float32, rng_state [2] uint64); window -1: unbounded."""
    raise NotImplementedError(f"flash_varlen_forward on {q.device.type}")


@torch.library.custom_op("snakebert::flash_varlen_backward", mutates_args=())
def flash_varlen_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor, offsets: torch.Tensor, max_seqlen: int,
                          dropout_p: float, window_left: int, window_right: int, rng_state: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of flash_varlen_forward, its dropout mask regenerated from `rng_state`."""
    raise NotImplementedError(f"flash_varlen_backward on {q.device.type}")


def _window(window_left: int, window_right: int) -> dict:
    """The flash kernels' window arguments, only where a window is set: BERT's unwindowed call stays the one torch
    2.7-2.10 take (workflow.train.models.kernels: the windowed call's floor is 2.11)."""
    if window_left < 0 and window_right < 0:
        return {}
    return {"window_size_left": window_left, "window_size_right": window_right}


@flash_varlen_forward.register_kernel("cuda")
def _forward_cuda(q, k, v, offsets, max_seqlen, dropout_p, window_left, window_right):
    out, lse, rng_state, _, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, offsets, offsets, max_seqlen, max_seqlen, dropout_p, False, False, **_window(window_left, window_right))
    return out, lse, rng_state


@flash_varlen_backward.register_kernel("cuda")
def _backward_cuda(grad_out, q, k, v, out, lse, offsets, max_seqlen, dropout_p, window_left, window_right, rng_state):
    unused = torch.empty(0, device=q.device)  # the philox offset travels inside rng_state
    return torch.ops.aten._flash_attention_backward(
        grad_out, q, k, v, out, lse, offsets, offsets, max_seqlen, max_seqlen, dropout_p, False, rng_state, unused,
        **_window(window_left, window_right))


def _exact(x):
    """x in float32 at least: the reference's compute dtype (16-bit inputs are computed as flash does, in float32)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _masked_scores(q, k, offsets, window_left: int, window_right: int):
    """The CPU reference's attention scores [heads, T, T] (float32), -inf outside a query's sequence and window."""
    index = torch.arange(q.shape[0], device=q.device)
    sequence = torch.searchsorted(offsets[1:].to(index.dtype), index, right=True)  # zero-length sequences hold none
    allowed = sequence[:, None] == sequence[None, :]
    distance = index[None, :] - index[:, None]  # key - query
    if window_left >= 0:
        allowed &= distance >= -window_left
    if window_right >= 0:
        allowed &= distance <= window_right
    scores = torch.einsum("qhd,khd->hqk", _exact(q), _exact(k)) * q.shape[-1] ** -0.5
    return scores.masked_fill(~allowed, float("-inf"))


def _dropped(probabilities, dropout_p: float, rng_state):
    """The attention weights after dropout (kept ones rescaled), its mask drawn from the seed in rng_state."""
    if not dropout_p:
        return probabilities
    generator = torch.Generator(device=probabilities.device).manual_seed(int(rng_state[0]))
    kept = torch.rand(probabilities.shape, generator=generator, device=probabilities.device) >= dropout_p
    return probabilities * kept / (1.0 - dropout_p)


@flash_varlen_forward.register_kernel("cpu")
def _forward_cpu(q, k, v, offsets, max_seqlen, dropout_p, window_left, window_right):
    seed = torch.randint(0, 2 ** 62, (1,)) if dropout_p else torch.zeros(1, dtype=torch.long)
    rng_state = torch.cat([seed, torch.zeros(1, dtype=torch.long)]).to(torch.uint64)
    scores = _masked_scores(q, k, offsets, window_left, window_right)
    weights = _dropped(scores.softmax(-1), dropout_p, rng_state)
    out = torch.einsum("hqk,khd->qhd", weights, _exact(v)).to(q.dtype).contiguous()
    return out, scores.logsumexp(-1).float(), rng_state


@flash_varlen_backward.register_kernel("cpu")
def _backward_cpu(grad_out, q, k, v, out, lse, offsets, max_seqlen, dropout_p, window_left, window_right, rng_state):
    probabilities = (_masked_scores(q, k, offsets, window_left, window_right) - lse.unsqueeze(-1)).exp()
    grad_out = _exact(grad_out)
    grad_v = torch.einsum("hqk,qhd->khd", _dropped(probabilities, dropout_p, rng_state), grad_out)
    grad_weights = _dropped(torch.einsum("qhd,khd->hqk", grad_out, _exact(v)), dropout_p, rng_state)
    grad_scores = probabilities * (grad_weights - (grad_weights * probabilities).sum(-1, keepdim=True))
    scale = q.shape[-1] ** -0.5
    grad_q = torch.einsum("hqk,khd->qhd", grad_scores, _exact(k)) * scale
    grad_k = torch.einsum("hqk,qhd->khd", grad_scores, _exact(q)) * scale
    return tuple(grad.to(x.dtype).contiguous() for grad, x in ((grad_q, q), (grad_k, k), (grad_v, v)))


@flash_varlen_forward.register_fake
def _forward_fake(q, k, v, offsets, max_seqlen, dropout_p, window_left, window_right):
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return torch.empty_like(q), lse, q.new_empty((2,), dtype=torch.uint64)


@flash_varlen_backward.register_fake
def _backward_fake(grad_out, q, k, v, out, lse, offsets, max_seqlen, dropout_p, window_left, window_right, rng_state):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, offsets, max_seqlen, dropout_p, window_left, window_right = inputs
    out, lse, rng_state = output
    ctx.save_for_backward(q, k, v, offsets, out, lse, rng_state)
    ctx.arguments = max_seqlen, dropout_p, window_left, window_right


def _backward(ctx, grad_out, _grad_lse, _grad_rng_state):
    q, k, v, offsets, out, lse, rng_state = ctx.saved_tensors
    max_seqlen, dropout_p, window_left, window_right = ctx.arguments
    dq, dk, dv = flash_varlen_backward(grad_out.contiguous(), q, k, v, out, lse, offsets, max_seqlen, dropout_p,
                                       window_left, window_right, rng_state)
    return dq, dk, dv, None, None, None, None, None


flash_varlen_forward.register_autograd(_backward, setup_context=_setup_context)


def flash_varlen(q, k, v, offsets, max_seqlen: int, dropout_p: float = 0.0, window: int | None = None):
    """See the module docstring."""
    reach = -1 if window is None else window
    out, _, _ = flash_varlen_forward(q.contiguous(), k.contiguous(), v.contiguous(), offsets.to(torch.int32),
                                     max_seqlen, dropout_p, reach, reach)
    return out
