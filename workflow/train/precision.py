"""Mixed precision shared by every training stage: choosing fp32/bf16/fp16, the matmuls' math (TF32 for fp32 on GPUs
that have it), autocast, and fp16's GradScaler.

Its CUDA-only call (is bf16 native?) goes through workflow/train/accelerator.py, as every other one does.
"""
import contextlib

import torch

from workflow.cli import UserError
from workflow.train import accelerator


def resolve_precision(precision: str, device: torch.device, config_key: str) -> str:
    """`auto` -> bf16 where the GPU has it natively, else fp32; fp16 off CUDA is an error naming `config_key`."""
    if precision == "auto":
        return "bf16" if accelerator.bf16_native(device) else "fp32"
    if precision == "fp16" and device.type != "cuda":
        raise UserError(f"config {config_key}: fp16 needs a CUDA device (use fp32 or bf16 on CPU)")
    return precision


def matmul_math(precision: str, device: torch.device) -> str:
    """What the matmuls of `precision` run in on `device`: tf32 for fp32 on TF32 tensor cores (compute capability
    >= 8.0), else `precision` itself; its datasheet peak is the one MFU is measured against."""
    return "tf32" if precision == "fp32" and accelerator.tf32_native(device) else precision


def configure_matmuls(precision: str, device: torch.device) -> str:
    """fp32 matmuls and convolutions on TF32 tensor cores where the GPU has them (fp32's range, a 10-bit mantissa; an
    A100's datasheet: 156 TFLOP/s against 19.5 in fp32); returns matmul_math for the run's log."""
    math = matmul_math(precision, device)
    if math == "tf32":
        accelerator.allow_tf32(True)
    return math


def autocast_dtype(precision: str) -> torch.dtype:
    """The dtype the matmuls of `precision` run in."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def autocast(device: torch.device, precision: str):
    """The autocast context of `precision` on `device` (none for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=autocast_dtype(precision))


def grad_scaler(precision: str, device: torch.device):
    """fp16's dynamic loss scaler, None for fp32/bf16 (bf16 has fp32's exponent range)."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None
