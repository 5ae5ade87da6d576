"""The pretraining optimizer: LAMB (NVIDIA's recipe, the default) or AdamW (RoBERTa's, MosaicBERT's, ModernBERT's),
and its state carried from one phase to the next.

API:
    OPTIMIZERS = ("lamb", "adamw")    config pretrain.optimizer; each reads its own section (pretrain.lamb,
                                      pretrain.adamw) of HYPER_PARAMETERS and `fused`
    make_optimizer(kind, model, lr, weight_decay, max_grad_norm, betas, eps, fused) -> (optimizer, name)
        lamb: workflow.train.lamb.make_optimizer (apex FusedLAMB or the torch Lamb, clipping inside its step).
        adamw: torch.optim.AdamW (decoupled weight decay, bias correction) on weight_decay_groups (no decay on
        biases and normalisation layers, either family), fused on CUDA where torch has it and `fused`.
    weight_decay_groups(model, weight_decay)   two groups by what a parameter is: decayed (matrices, embeddings),
        and without decay the parameters of normalisation layers and every bias; for BERT exactly lamb.param_groups
        (the same parameters in the same order), for ModernBERT its recipe's split (norms and biases exempt)
    engine_clip(kind, max_grad_norm)   the engine's torch clipping norm before the step: AdamW's max_grad_norm (as
        Hugging Face's Trainer clips), None for LAMB (its step clips) and for 0
    refuse_other_optimizer_keys(section)   config pretrain: a key of the section of the optimizer not chosen, set to
        other than its default, would do nothing: one error line naming it
    carry_optimizer_state(optimizer, path)   phase 1's moments (exp_avg, exp_avg_sq) into this phase's fresh
        optimizer, either kind from either kind; step and learning rate stay this phase's own. A state key neither
        optimizer has (e.g. AdamW's amsgrad max_exp_avg_sq) is one error line naming it.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from workflow.cli import UserError
from workflow.config import optimizer_config_error
from workflow.train import lamb

log = logging.getLogger(__name__)
OPTIMIZERS = ("lamb", "adamw")
HYPER_PARAMETERS = ("weight_decay", "beta1", "beta2", "eps", "max_grad_norm")
MOMENTS = ("exp_avg", "exp_avg_sq")  # both optimizers' per-parameter state; AdamW adds its step count


def make_optimizer(kind: str, model: nn.Module, lr: float, weight_decay: float = 0.01, max_grad_norm: float = 1.0,
                   betas=(0.9, 0.999), eps: float = 1e-6, fused: bool = True):
    """(optimizer, name): see the module docstring."""
    if kind == "lamb":
        return lamb.make_optimizer(model, lr, weight_decay, max_grad_norm, betas, eps, fused)
    if kind != "adamw":
        raise UserError(f"config pretrain.optimizer: {kind!r} is none of {', '.join(OPTIMIZERS)}")
    device = next(model.parameters()).device
    # torch's fused AdamW: one kernel for all parameters, and fp16 overflow steps skipped on the device itself.
    use_fused = fused and device.type == "cuda"
    optimizer = torch.optim.AdamW(weight_decay_groups(model, weight_decay), lr=lr, betas=betas, eps=eps,
                                  weight_decay=weight_decay, fused=True if use_fused else None)
    return optimizer, "torch.AdamW (fused)" if use_fused else "torch.AdamW"


NORMALISATIONS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """[decayed, exempt] parameter groups (see the module docstring); frozen parameters are left out."""
    exempt = {id(parameter) for module in model.modules() for name, parameter in module.named_parameters(recurse=False)
              if isinstance(module, NORMALISATIONS) or name == "bias"}
    decay, no_decay = [], []
    for parameter in model.parameters():
        if parameter.requires_grad:
            (no_decay if id(parameter) in exempt else decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def engine_clip(kind: str, max_grad_norm: float) -> float | None:
    return (max_grad_norm or None) if kind == "adamw" else None


def refuse_other_optimizer_keys(section: dict) -> None:
    """See the module docstring; `section` is the config's pretrain section with its defaults filled in. The same
    check stops the Snakefile at parse time (rules/common.smk)."""
    error = optimizer_config_error(section)
    if error:
        raise UserError(error)


def carry_optimizer_state(optimizer, path: str) -> None:
    """Phase 1's moments into this phase's fresh optimizer; step and learning rate stay this phase's own."""
    carried = torch.load(path, map_location="cpu", weights_only=True)
    fresh = optimizer.state_dict()
    shapes = [tuple(p.shape) for group in optimizer.param_groups for p in group["params"]]
    if carried.get("shapes") != [list(s) for s in shapes]:
        raise UserError(f"{path}: optimizer state of another model (parameter shapes differ)")
    adamw = isinstance(optimizer, torch.optim.AdamW)
    state = {}
    for index, moments in carried["state"].items():
        other = sorted(set(moments) - set(MOMENTS) - {"step"})
        if other:
            raise UserError(f"{path}: optimizer state key {other[0]!r} is not one of LAMB's and AdamW's "
                            f"({', '.join(MOMENTS)}); start this phase without it (pretrain.carry_optimizer_state: "
                            f"false)")
        state[index] = {key: moments[key] for key in MOMENTS}
        if adamw:  # AdamW counts steps per parameter: this phase's own count starts at 0, as LAMB's group count
            state[index]["step"] = torch.zeros((), dtype=torch.float32)
    fresh["state"] = state
    optimizer.load_state_dict(fresh)
