"""LAMB as NVIDIA trains BERT with it, and the poly-warmup learning-rate schedule.

API:
    Lamb(params, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, max_grad_norm=1.0)
        torch optimizer (multi-tensor `torch._foreach_*` ops), same arithmetic as apex FusedLAMB
        (adam_w_mode, bias_correction, grad_averaging, use_nvlamb=False). `.last_grad_norm` = pre-clip global norm.
    param_groups(model, weight_decay=0.01)   no decay on biases and normalisation layers (NVIDIA's split)
    make_optimizer(model, lr, weight_decay=0.01, max_grad_norm=1.0, betas=(0.9, 0.999), eps=1e-6, fused=True)
        -> (optimizer, name): apex FusedLAMB where it runs (accelerator.fused_lamb: CUDA, apex importable, its
        constructor finds apex's CUDA extensions) unless `fused` is False (config pretrain.lamb.fused), else Lamb; the
        reason for the torch Lamb is logged. Both keep the same state (exp_avg, exp_avg_sq per parameter, the step
        count in each param group) and take the same engine calls (zero_grad() without arguments, step()).
    PolyWarmup(total_steps, warmup_proportion, degree=0.5)   callable for torch.optim.lr_scheduler.LambdaLR
    make_scheduler(optimizer, total_steps, warmup_proportion) -> LambdaLR

The LAMB step, for the gradients g of all parameters:
    n = ||g||_2 (global); g <- g / max(1, n / max_grad_norm)
    m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g²;  m^ = m / (1 - b1^t);  v^ = v / (1 - b2^t)
    u = m^ / (sqrt(v^) + eps) + wd p
    r = ||p|| / ||u|| if wd != 0 and both norms > 0, else 1
    p <- p - lr r u
"""
from __future__ import annotations

import logging

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from workflow.train import accelerator

log = logging.getLogger(__name__)


class Lamb(Optimizer):
    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 max_grad_norm: float = 1.0):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, step=0)
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        norm = lamb_update(self, self.max_grad_norm)
        if norm is not None:
            self.last_grad_norm = norm
        return loss


@torch.no_grad()
def lamb_update(optimizer: Optimizer, max_grad_norm: float) -> torch.Tensor | None:
    """One LAMB step of `optimizer`'s parameters with gradients (its param_groups and state, apex FusedLAMB's keys);
    returns the pre-clip global gradient norm (None without gradients)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return None
    norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads])
    global_norm = torch.linalg.vector_norm(torch.stack(norms))
    # Global-norm pre-normalisation: divide by max(1, n / max_grad_norm).
    clip = torch.clamp(global_norm / max_grad_norm, min=1.0) if max_grad_norm > 0 else None

    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        group["step"] = group.get("step", 0) + 1  # apex's group has no "step" until its first step
        t = group["step"]
        beta1, beta2 = group["betas"]
        wd, eps, lr = group["weight_decay"], group["eps"], group["lr"]
        grads = [p.grad for p in params]
        if clip is not None:
            grads = torch._foreach_div(grads, clip)
        exp_avg, exp_avg_sq = [], []
        for p in params:
            state = optimizer.state[p]
            if not state:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avg.append(state["exp_avg"])
            exp_avg_sq.append(state["exp_avg_sq"])
        torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sq, beta2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, 1 - beta2)

        denominator = torch._foreach_div(exp_avg_sq, 1 - beta2 ** t)
        torch._foreach_sqrt_(denominator)
        torch._foreach_add_(denominator, eps)
        update = torch._foreach_div(exp_avg, 1 - beta1 ** t)
        torch._foreach_div_(update, denominator)
        del denominator
        if wd != 0:
            torch._foreach_add_(update, params, alpha=wd)
            param_norms = torch.stack(torch._foreach_norm(params))
            update_norms = torch.stack(torch._foreach_norm(update))
            ratio = torch.where((param_norms > 0) & (update_norms > 0), param_norms / update_norms,
                                torch.ones_like(param_norms))
            torch._foreach_mul_(update, list((ratio * -lr).unbind()))
            torch._foreach_add_(params, update)
        else:
            torch._foreach_add_(params, update, alpha=-lr)
    return global_norm


NORMALISATIONS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)


def param_groups(model: nn.Module, weight_decay: float = 0.01) -> list[dict]:
    """[decayed, exempt]: every optimizer's and every stage's weight-decay groups, by what a parameter is. Exempt are
    the parameters of normalisation layers and every bias (for BERT exactly NVIDIA's split, biases and LayerNorm; for
    ModernBERT its recipe's, norms and biases); decayed are the rest (matrices, embeddings). Frozen parameters are
    left out."""
    exempt = {id(parameter) for module in model.modules() for name, parameter in module.named_parameters(recurse=False)
              if isinstance(module, NORMALISATIONS) or name == "bias"}
    decay, no_decay = [], []
    for parameter in model.parameters():
        if parameter.requires_grad:
            (no_decay if id(parameter) in exempt else decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.01, max_grad_norm: float = 1.0,
                   betas=(0.9, 0.999), eps: float = 1e-6, fused: bool = True):
    """(optimizer, name): apex FusedLAMB where it runs and `fused`, else the torch Lamb (the reason logged)."""
    groups = param_groups(model, weight_decay)
    fused_lamb, reason = accelerator.fused_lamb(next(model.parameters()).device) if fused else (
        None, "config pretrain.lamb.fused is false")
    if fused_lamb is not None:
        try:
            return fused_lamb(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                              max_grad_norm=max_grad_norm), "apex.FusedLAMB"
        except RuntimeError as error:  # apex built without its CUDA extensions ("requires cuda extensions")
            reason = f"apex FusedLAMB cannot start ({error})"
    log.info("LAMB: the torch Lamb (workflow.train.optim.lamb): %s", reason)
    return Lamb(groups, lr=lr, betas=betas, eps=eps, max_grad_norm=max_grad_norm), "torch.Lamb"


class PolyWarmup:
    """lr multiplier for the optimizer step number `index + 1`: linear warmup, then (1 - progress)^degree."""

    def __init__(self, total_steps: int, warmup_proportion: float, degree: float = 0.5):
        self.total_steps = total_steps
        self.warmup_proportion = warmup_proportion
        self.degree = degree

    def __call__(self, index: int) -> float:
        progress = min((index + 1) / self.total_steps, 1.0)
        if progress < self.warmup_proportion:
            return progress / self.warmup_proportion
        return max(1.0 - progress, 0.0) ** self.degree


def make_scheduler(optimizer: Optimizer, total_steps: int, warmup_proportion: float) -> LambdaLR:
    return LambdaLR(optimizer, PolyWarmup(total_steps, warmup_proportion))
