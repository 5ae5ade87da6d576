"""Which attention kernel trains, and the torch and GPU each needs (docs/gpu.md's table). Below a path's floor the
next one trains, with one warning naming what to upgrade; nothing crashes at the first step.

    BERT, packed rows, CUDA, 16-bit (kit.VarlenAttention):
        flash_varlen            torch's varlen flash kernels with dropout (workflow.train.models.flash_varlen): torch
                                >= 2.7, whose aten._flash_attention_backward takes the forward's rng_state (before,
                                philox_seed and philox_offset: pytorch commit 3ecfe6b, 2025-02-25); compute capability
                                >= 8.0
        flash_attn_varlen_func  the flash-attn package's varlen kernel (NGC containers ship it), where importable;
                                compute capability >= 8.0 (flash-attn 2)
        nested SDPA             exact, ~4x slower (SDPA's memory-efficient kernel; any GPU)
    ModernBERT, CUDA, 16-bit (modernbert.WindowedVarlenAttention; every batch unpadded):
        flash_varlen (windowed) torch's varlen flash kernels with a window (aten._flash_attention_forward's
                                window_size_left/right, as torch's own varlen_attn(..., window_size=) calls them from
                                2.11: the floor taken; 2.9 and 2.10 have varlen_attn without window_size);
                                compute capability >= 8.0
        flash_attn_varlen_func  the flash-attn package's, with its window_size, where importable
        rows (SDPA with a mask) exact, slower (padding computed, dense masks)
    fp32, or off CUDA: the exact path of the family (BERT nested SDPA, ModernBERT rows).

API:
    attention_path(family, torch_version, device_type, capability, dtype, flash_attn) -> name   the kernel that
        trains for these facts (family "bert" | "modernbert"; capability (major, minor) or None; flash_attn: the
        package importable)
    trained_path(family, device, dtype) -> name   attention_path of this process and `device`
    fast_kernel(family, device) -> name   where the family's fast path is asked for (16-bit on a varlen device): that
        path, flash_attn_varlen_func or the exact one, warning once below the floor
    bert_flash_kernel(device, flash_varlen) -> callable | None   kit's 16-bit kernel: `flash_varlen` itself,
        flash-attn's with its signature, or None (nested SDPA)
    windowed_varlen_kernel(device, windowed_flash_varlen) -> callable | None   ModernBERT's: flash_varlen itself (its
        windowed call), flash-attn's
        with its signature, or None (rows with masks)
    forget()   drop what this process found (tests change torch.__version__ and flash-attn between cases)
Each path's floor, the fallback rule and the warning's words are workflow/train/models/floors.py's (torch-free: the
Snakefile checks the floor at parse time).
"""
from __future__ import annotations

import functools
import logging

import torch

from workflow.train import accelerator
from workflow.train.models.floors import (  # noqa: F401 (the paths' names: kernels' API too)
    FAST_PATHS, FLASH_ATTN, FLASH_VARLEN, NESTED_SDPA, ROWS, SLOWER, WINDOWED_FLASH_VARLEN, fallback, floor_warning,
    major_minor, no_flash_gpu)

log = logging.getLogger(__name__)

FLASH_DTYPES = (torch.float16, torch.bfloat16)


def attention_path(family: str, torch_version: tuple, device_type: str, capability: tuple | None,
                   dtype: torch.dtype, flash_attn: bool) -> str:
    """See the module docstring."""
    fast, floor, exact, _ = FAST_PATHS[family]
    if device_type != "cuda" or dtype not in FLASH_DTYPES:
        return exact
    return fallback(fast, floor, exact, capability, torch_version, flash_attn)


@functools.cache
def torch_version() -> tuple[int, int]:
    """(major, minor) of the torch imported (torch.__version__, e.g. "2.10.0+cu128" -> (2, 10))."""
    return major_minor(str(torch.__version__))


@functools.cache
def flash_attn_varlen_func():
    """The flash-attn package's flash_attn_varlen_func, None where it does not import (absent, or built for another
    torch or CUDA)."""
    try:
        from flash_attn import flash_attn_varlen_func as function
    except (ImportError, OSError):
        return None
    return function


_warned: set = set()


def forget() -> None:
    torch_version.cache_clear()
    flash_attn_varlen_func.cache_clear()
    _warned.clear()


@torch.compiler.assume_constant_result  # a compiled forward takes it as the constant it is (no import traced)
def fast_kernel(family: str, device: torch.device) -> str:
    """See the module docstring."""
    fast, floor, exact, _ = FAST_PATHS[family]
    version, capability = torch_version(), accelerator.compute_capability(device)
    name = fallback(fast, floor, exact, capability, version, flash_attn_varlen_func() is not None)
    if name != fast and (family, name) not in _warned:
        _warned.add((family, name))
        if no_flash_gpu(capability):
            log.warning("%s", floor_warning(family, name, f"this GPU (compute capability {capability[0]}."
                                             f"{capability[1]}) has no flash kernels",
                                             "a GPU of compute capability >= 8.0 (A100, L4, H100 or newer) runs it"))
        else:
            log.warning("%s", floor_warning(family, name, f"torch {torch.__version__} lacks it",
                                             f"upgrade torch to >= {floor[0]}.{floor[1]}",
                                             "" if name == FLASH_ATTN else " (or pip install flash-attn)"))
    return name


def trained_path(family: str, device: torch.device, dtype: torch.dtype) -> str:
    """See the module docstring."""
    if device.type != "cuda" or dtype not in FLASH_DTYPES:
        return FAST_PATHS[family][2]
    return fast_kernel(family, device)


def bert_flash_kernel(device: torch.device, flash_varlen):
    """See the module docstring."""
    return {FLASH_VARLEN: flash_varlen, FLASH_ATTN: _flash_attn_as_flash_varlen}.get(fast_kernel("bert", device))


def windowed_varlen_kernel(device: torch.device, windowed_flash_varlen):
    """See the module docstring."""
    return {WINDOWED_FLASH_VARLEN: windowed_flash_varlen, FLASH_ATTN: _flash_attn_as_windowed_varlen}.get(
        fast_kernel("modernbert", device))


def _flash_attn_as_flash_varlen(q, k, v, offsets, max_seqlen: int, dropout_p: float = 0.0):
    """flash_varlen's call through flash-attn (its own dropout RNG and backward)."""
    return flash_attn_varlen_func()(q, k, v, offsets, offsets, max_seqlen, max_seqlen, dropout_p=dropout_p)


def _flash_attn_as_windowed_varlen(q, k, v, offsets, max_seqlen: int, dropout_p: float = 0.0,
                                   window: int | None = None):
    """flash_varlen's windowed call (as ModernBERT makes it) through flash-attn, whose window_size means the same."""
    reach = -1 if window is None else window
    return flash_attn_varlen_func()(q, k, v, offsets, offsets, max_seqlen, max_seqlen, dropout_p=dropout_p,
                                    window_size=(reach, reach))
