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
    head_floor_warning(family, precision, packed, conda_env) -> str | None   at parse time (`snakemake -n`, rules/
        pretrain.smk): the warning a pretraining job would log at its start about its torch floor, where the head
        knows the job's torch; the GPU is not known there
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import re
import sys

import torch

from workflow.train import accelerator

log = logging.getLogger(__name__)

FLASH_VARLEN, WINDOWED_FLASH_VARLEN, FLASH_ATTN = "flash_varlen", "flash_varlen (windowed)", "flash_attn_varlen_func"
NESTED_SDPA, ROWS = "nested SDPA", "rows (SDPA with a mask)"
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_CAPABILITY = (8, 0)  # flash kernels (torch's and flash-attn 2's): Ampere and newer; T4 / RTX 20xx are (7, 5)
# family: (its fast path, the torch it needs, its exact path, what the fast path is)
FAST_PATHS = {
    "bert": (FLASH_VARLEN, (2, 7), NESTED_SDPA, "BERT's varlen flash attention with dropout"),
    "modernbert": (WINDOWED_FLASH_VARLEN, (2, 11), ROWS, "ModernBERT's windowed varlen flash attention"),
}
FAST_PATHS["roberta"] = FAST_PATHS["bert"]  # RoBERTa trains BERT's encoder (kit.VarlenAttention)
SLOWER = {NESTED_SDPA: "nested SDPA (exact, ~4x slower)", ROWS: "rows with masks (exact, slower)",
          FLASH_ATTN: "flash-attn's flash_attn_varlen_func"}


def attention_path(family: str, torch_version: tuple, device_type: str, capability: tuple | None,
                   dtype: torch.dtype, flash_attn: bool) -> str:
    """See the module docstring."""
    fast, floor, exact, _ = FAST_PATHS[family]
    if device_type != "cuda" or dtype not in FLASH_DTYPES:
        return exact
    return _fallback(fast, floor, exact, capability, torch_version, flash_attn)


def _no_flash_gpu(capability) -> bool:
    return capability is not None and tuple(capability) < FLASH_CAPABILITY


def _fallback(fast: str, floor: tuple, exact: str, capability, torch_version: tuple, flash_attn: bool) -> str:
    if _no_flash_gpu(capability):
        return exact
    if tuple(torch_version) >= floor:
        return fast
    return FLASH_ATTN if flash_attn else exact


@functools.cache
def torch_version() -> tuple[int, int]:
    """(major, minor) of the torch imported (torch.__version__, e.g. "2.10.0+cu128" -> (2, 10))."""
    return _major_minor(str(torch.__version__))


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
    name = _fallback(fast, floor, exact, capability, version, flash_attn_varlen_func() is not None)
    if name != fast and (family, name) not in _warned:
        _warned.add((family, name))
        if _no_flash_gpu(capability):
            log.warning("%s", _floor_warning(family, name, f"this GPU (compute capability {capability[0]}."
                                             f"{capability[1]}) has no flash kernels",
                                             "a GPU of compute capability >= 8.0 (A100, L4, H100 or newer) runs it"))
        else:
            log.warning("%s", _floor_warning(family, name, f"torch {torch.__version__} lacks it",
                                             f"upgrade torch to >= {floor[0]}.{floor[1]}",
                                             "" if name == FLASH_ATTN else " (or pip install flash-attn)"))
    return name


def _floor_warning(family: str, name: str, why: str, upgrade: str, or_flash_attn: str = "") -> str:
    """The one line a job below its fast path's floor logs, training with `name` instead."""
    _, floor, _, what = FAST_PATHS[family]
    return (f"{what} needs torch >= {floor[0]}.{floor[1]} and compute capability >= 8.0; {why}: training with "
            f"{SLOWER[name]} instead; {upgrade}{or_flash_attn}")


def head_floor_warning(family: str, precision: str, packed: bool, conda_env: str | None) -> str | None:
    """At parse time on the Snakemake head: the warning a pretraining job (model.family `family`, pretrain.precision
    `precision`, packed rows or not) will log at its start on a GPU of compute capability >= 8.0, about its fast
    path's torch floor; None when that torch meets it, the job's precision is fp32 or its family trains no fast path
    there. The job's torch is the pin of the conda env file `conda_env` (its `torch==` line) when given, else this
    interpreter's (a job without a deployment method runs the python active at submission). The GPU is not known
    here: below compute capability 8.0 the job takes its exact path whatever torch it has, and says so there."""
    from workflow.train.models.family import family as model_family

    if precision == "fp32" or not model_family(family).trains_unpadded("cuda", packed, "bf16"):
        return None  # auto: bf16 on a GPU that has it, every GPU with flash kernels does
    fast, floor, exact, _ = FAST_PATHS[family]
    if conda_env is None:
        version_text, where = str(torch.__version__), f"this interpreter's, {sys.executable}"
        flash_attn = importlib.util.find_spec("flash_attn") is not None  # installed; imported only on a GPU node
        upgrade, or_flash_attn = f"upgrade torch to >= {floor[0]}.{floor[1]}", " (or pip install flash-attn)"
    else:
        pins = _pip_pins(conda_env)
        if "torch" not in pins:
            return None  # no exact pin: the version conda resolves is not known here
        version_text, where, flash_attn = pins["torch"], f"{conda_env}'s pin", "flash-attn" in pins
        upgrade, or_flash_attn = f"pin torch >= {floor[0]}.{floor[1]} in {conda_env}", " (or add flash-attn to it)"
    version = _major_minor(version_text)
    trains = _fallback(fast, floor, exact, None, version, flash_attn)
    if trains == fast:
        return None
    return _floor_warning(family, trains, f"torch {version_text} lacks it (the jobs' torch: {where})", upgrade,
                          "" if trains == FLASH_ATTN else or_flash_attn)


def _pip_pins(conda_env: str) -> dict[str, str]:
    """{package (lower case, `_` as `-`): version} of the `name==version` lines of a conda env file's pip list."""
    import yaml

    with open(conda_env) as file:
        dependencies = yaml.safe_load(file).get("dependencies") or []
    pip = next((entry["pip"] for entry in dependencies if isinstance(entry, dict) and "pip" in entry), [])
    pins = (re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", str(line).strip()) for line in pip)
    return {pin[1].lower().replace("_", "-"): pin[2] for pin in pins if pin}


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


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
