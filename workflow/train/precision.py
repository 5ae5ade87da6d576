"""Mixed precision shared by every training stage: choosing fp32/bf16/fp16, autocast, and fp16's GradScaler.

The CUDA-only calls of training live here (and in distributed.setup): everything else runs on CPU in tests.
"""
import contextlib

import torch

from workflow.cli import UserError


def resolve_precision(precision: str, device: torch.device, config_key: str) -> str:
    """`auto` -> bf16 where the GPU has it natively, else fp32; fp16 off CUDA is an error naming `config_key`."""
    if precision == "auto":
        # Not emulated bf16 (V100 "supports" it at a fraction of fp32 speed): native on compute capability >= 8.
        native = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
        return "bf16" if native else "fp32"
    if precision == "fp16" and device.type != "cuda":
        raise UserError(f"config {config_key}: fp16 needs a CUDA device (use fp32 or bf16 on CPU)")
    return precision


def autocast(device: torch.device, precision: str):
    """The autocast context of `precision` on `device` (none for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def grad_scaler(precision: str, device: torch.device):
    """fp16's dynamic loss scaler, None for fp32/bf16 (bf16 has fp32's exponent range)."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None
