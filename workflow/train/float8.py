"""Float8 training, opt-in (config pretrain.float8): torchao's Float8Linear for the encoder's matmuls.

API:
    float8_error(device) -> str | None   None where float8 training can run on `device`, else one line naming
        pretrain.float8 and why not (not CUDA, compute capability below 8.9, torchao not importable)
    float8_module_filter(module, fqn) -> bool   whether torchao converts this nn.Linear (see below)
    convert_to_float8(model) -> model   torchao.float8.convert_to_float8_training with that filter: the picked
        nn.Linear become Float8Linear in place (same parameters, so state dicts and checkpoints keep their keys)

Converted: every nn.Linear whose in and out features are multiples of 16 (float8 matmuls need it), but none under
the embeddings or the MLM decoder (HF's names, both families': `embeddings`, `decoder`), which stay in the
autocast dtype for their accuracy. So in BERT the attention, feed-forward, pooler and MLM transform matrices are
float8; the next-sentence classifier (2 outputs) and the tied decoder (F.linear on the word embeddings) are not.
torchao's default recipe (tensorwise scales, computed each step) is used; its speed needs torch.compile.

Where it is called (workflow/train/pretrain.py, `pretrain`): the check beside refuse_compile, with the other config
refusals before any work; the conversion right after `model.to(env.device)` and before make_optimizer, so before the
checkpoint is loaded into the model and before the engine wraps it in DDP and torch.compile (Float8Linear keeps the
nn.Linear's own weight and bias Parameters, so the optimizer, DDP's buckets and checkpoints see the same tensors):
    error = float8_error(env.device) if s.float8 else None
    if error:
        raise UserError(error)
    ...
    model.to(env.device)
    if s.float8:
        convert_to_float8(model)
"""
from __future__ import annotations

import torch
from torch import nn

FLOAT8_CAPABILITY = (8, 9)  # Ada and Hopper: the first with float8 tensor cores
DIMENSION_MULTIPLE = 16  # torch._scaled_mm's requirement on a float8 matmul's dimensions
UNCONVERTED_PARTS = ("embeddings", "decoder")  # module names, as HF's, of the parts kept in the autocast dtype


def float8_error(device: torch.device) -> str | None:
    """None where float8 training can run on `device`, else why not, as one line naming pretrain.float8."""
    if device.type != "cuda":
        return (f"config pretrain.float8: float8 training needs a CUDA GPU (the model is on {device.type}); "
                f"set pretrain.float8: false")
    capability = torch.cuda.get_device_capability(device)
    if capability < FLOAT8_CAPABILITY:
        return (f"config pretrain.float8: float8 training needs a GPU of compute capability "
                f"{'.'.join(map(str, FLOAT8_CAPABILITY))} or newer (Ada, Hopper); this one has "
                f"{'.'.join(map(str, capability))}; set pretrain.float8: false")
    try:
        import torchao.float8  # noqa: F401
    except ImportError as error:
        return (f"config pretrain.float8: torchao is not importable ({error}); pip install torchao==0.18.0 or set "
                f"pretrain.float8: false")
    return None


def float8_module_filter(module: nn.Module, fqn: str) -> bool:
    """Whether torchao converts `module` (named `fqn` in the model): an nn.Linear with both dimensions multiples of
    16, outside the embeddings and the MLM decoder."""
    if not isinstance(module, nn.Linear):
        return False
    if any(part in UNCONVERTED_PARTS for part in fqn.split(".")):
        return False
    return module.in_features % DIMENSION_MULTIPLE == 0 and module.out_features % DIMENSION_MULTIPLE == 0


def convert_to_float8(model: nn.Module) -> nn.Module:
    """`model` with the nn.Linear that `float8_module_filter` picks swapped for torchao's Float8Linear (in place)."""
    from torchao.float8 import convert_to_float8_training

    return convert_to_float8_training(model, module_filter_fn=float8_module_filter)
