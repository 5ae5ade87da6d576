"""The pretraining optimizer: LAMB (NVIDIA's recipe, the default), AdamW (RoBERTa's, MosaicBERT's) or StableAdamW
(ModernBERT's), and its state carried from one phase to the next.

API:
    OPTIMIZERS = ("lamb", "adamw", "stable_adamw")   config pretrain.optimizer; each reads its own section
                                      (pretrain.lamb, pretrain.adamw, pretrain.stable_adamw) of HYPER_PARAMETERS and
                                      `fused` (stable_adamw: and decouple_lr)
    make_optimizer(kind, model, lr, weight_decay, max_grad_norm, betas, eps, fused, decouple_lr) -> (optimizer, name)
        lamb: workflow.train.optim.lamb.make_optimizer (apex FusedLAMB or the torch Lamb, clipping inside its step).
        adamw: torch.optim.AdamW (decoupled weight decay, bias correction) on lamb.param_groups (no decay on
        biases and normalisation layers, either family), fused on CUDA where torch has it and `fused`.
        stable_adamw: torch-optimi's StableAdamW (the library, not a copy: AdamW with per-tensor update clipping,
        decoupled weight decay, with decouple_lr fully decoupled: p <- p (1 - wd lr / peak lr)) on
        lamb.param_groups; `fused`: its Triton kernel on CUDA where Triton imports (one step of a throwaway
        parameter first: a kernel that cannot compile or run is one error line naming pretrain.stable_adamw.fused),
        else, and under deterministic algorithms (--deterministic: the kernel's atomic adds sum in any order), its
        foreach path; not `fused`: its for-loop. Clipping by the engine only where max_grad_norm is set (ModernBERT's:
        none).
    lamb.param_groups(model, weight_decay)   every optimizer's two groups, by what a parameter is: decayed
        (matrices, embeddings), and without decay the parameters of normalisation layers and every bias
    engine_clip(kind, max_grad_norm)   the engine's torch clipping norm before the step: AdamW's and StableAdamW's
        max_grad_norm (as Hugging Face's Trainer clips), None for LAMB (its step clips) and for 0 or null
    state_to_carry(optimizer) -> dict   what a phase saves for the next (optimizer_state.pt): each parameter's state
        and the parameters' shapes; a StableAdamW adds its groups' step counts ("steps")
    carry_optimizer_state(optimizer, path)   phase 1's moments (exp_avg, exp_avg_sq) into this phase's fresh
        optimizer, any kind from any kind; the learning rate stays this phase's own, and so does the step count
        (NVIDIA's reset) except from a StableAdamW into a StableAdamW, which continues phase 1's count: torch-optimi's
        debiased betas are 0 at a step 1, which would replace the carried moments by that step's gradient (so from
        LAMB's or AdamW's moments a StableAdamW keeps nothing after its first step). StableAdamW's own state (eps_sq,
        from this phase's eps; kahan_comp, the Kahan compensation of bf16/fp16 parameters, carried when present;
        Triton's mean_square scratch) is made by the library as at its first step. A state key none of them has
        (e.g. AdamW's amsgrad max_exp_avg_sq) is one error line naming it.
"""
from __future__ import annotations

import logging
import warnings

import torch
from torch import nn

from workflow.cli import UserError
from workflow.train.optim import lamb

log = logging.getLogger(__name__)
OPTIMIZERS = ("lamb", "adamw", "stable_adamw")
HYPER_PARAMETERS = ("weight_decay", "beta1", "beta2", "eps", "max_grad_norm")
MOMENTS = ("exp_avg", "exp_avg_sq")  # every optimizer's per-parameter state; AdamW adds its step count
STABLE_ADAMW_STATE = ("eps_sq", "kahan_comp", "mean_square")  # StableAdamW's own, beside the moments
OPTIMI = "torch-optimi==0.3.3"  # requirements.txt, envs/train.yaml
TRITON_DEVICE_TYPES = ("cuda",)  # torch-optimi's Triton kernel; a test adds "cpu" beside a stand-in StableAdamW


def make_optimizer(kind: str, model: nn.Module, lr: float, weight_decay: float = 0.01, max_grad_norm: float = 1.0,
                   betas=(0.9, 0.999), eps: float = 1e-6, fused: bool = True, decouple_lr: bool = True):
    """(optimizer, name): see the module docstring."""
    if kind == "lamb":
        return lamb.make_optimizer(model, lr, weight_decay, max_grad_norm, betas, eps, fused)
    if kind == "stable_adamw":
        return make_stable_adamw(model, lr, weight_decay, betas, eps, fused, decouple_lr)
    if kind != "adamw":
        raise UserError(f"config pretrain.optimizer: {kind!r} is none of {', '.join(OPTIMIZERS)}")
    device = next(model.parameters()).device
    # torch's fused AdamW: one kernel for all parameters, and fp16 overflow steps skipped on the device itself.
    use_fused = fused and device.type == "cuda"
    optimizer = torch.optim.AdamW(lamb.param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps,
                                  weight_decay=weight_decay, fused=True if use_fused else None)
    return optimizer, "torch.AdamW (fused)" if use_fused else "torch.AdamW"


def make_stable_adamw(model: nn.Module, lr: float, weight_decay: float, betas, eps: float, fused: bool,
                      decouple_lr: bool):
    """(torch-optimi's StableAdamW on lamb.param_groups, name); its path chosen here, never left to the library's
    own choice at the first step, so that a carried state is made for the path that steps."""
    try:
        import optimi
        from optimi.utils import HAS_TRITON
    except ImportError:
        raise UserError(f"config pretrain.optimizer: stable_adamw needs torch-optimi (pip install {OPTIMI})") from None
    device = next(model.parameters()).device
    triton = (fused and HAS_TRITON and device.type in TRITON_DEVICE_TYPES
              and not torch.are_deterministic_algorithms_enabled())
    if triton:
        check_triton_step(optimi.StableAdamW, device)
    with warnings.catch_warnings():  # optimi deprecates foreach for its Triton kernel, which the CPU lacks
        warnings.simplefilter("ignore", DeprecationWarning)
        optimizer = optimi.StableAdamW(lamb.param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps,
                                       weight_decay=weight_decay, decouple_lr=decouple_lr, triton=triton,
                                       foreach=fused and not triton)
    path = "triton" if triton else "foreach" if fused else "for-loop"
    return optimizer, f"optimi.StableAdamW ({path}{', decouple_lr' if decouple_lr else ''})"


def check_triton_step(stable_adamw, device: torch.device) -> None:
    """One Triton step of a throwaway parameter on `device`: the kernel compiles (Triton builds its launcher with a C
    compiler and links libcuda the first time) and runs here, else one error line naming the key."""
    parameter = torch.zeros(16, device=device, requires_grad=True)
    parameter.grad = torch.ones_like(parameter)
    try:
        stable_adamw([parameter], lr=1e-3, triton=True, foreach=False).step()
    except Exception as error:  # Triton's failures are of many kinds (RuntimeError, CalledProcessError, ImportError)
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise UserError(f"config pretrain.stable_adamw.fused: torch-optimi's Triton kernel does not compile or run "
                        f"here ({reason}); give the job a C compiler (CC) and libcuda, or set "
                        f"pretrain.stable_adamw.fused: false") from None


def is_stable_adamw(optimizer) -> bool:
    return type(optimizer).__name__ == "StableAdamW" and type(optimizer).__module__.startswith("optimi")


def engine_clip(kind: str, max_grad_norm: float | None) -> float | None:
    return (max_grad_norm or None) if kind in ("adamw", "stable_adamw") else None


def state_to_carry(optimizer) -> dict:
    """optimizer_state.pt's content (see the module docstring)."""
    carried = {"state": optimizer.state_dict()["state"],
               "shapes": [list(p.shape) for group in optimizer.param_groups for p in group["params"]]}
    if is_stable_adamw(optimizer):
        carried["steps"] = [int(group.get("step", 0)) for group in optimizer.param_groups]
    return carried


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
        other = sorted(set(moments) - set(MOMENTS) - set(STABLE_ADAMW_STATE) - {"step"})
        if other:
            raise UserError(f"{path}: optimizer state key {other[0]!r} is not one of LAMB's and AdamW's "
                            f"({', '.join(MOMENTS)}) nor StableAdamW's own ({', '.join(STABLE_ADAMW_STATE)}); start "
                            f"this phase without it (pretrain.carry_optimizer_state: false)")
        state[index] = {key: moments[key] for key in MOMENTS}
        if moments.get("kahan_comp") is not None and moments["kahan_comp"].shape == moments["exp_avg"].shape:
            state[index]["kahan_comp"] = moments["kahan_comp"]
        if adamw:  # AdamW counts steps per parameter: this phase's own count starts at 0, as LAMB's group count
            state[index]["step"] = torch.zeros((), dtype=torch.float32)
    if is_stable_adamw(optimizer):
        _carry_into_stable_adamw(optimizer, state, carried.get("steps"))
        return
    for moments in state.values():
        moments.pop("kahan_comp", None)  # LAMB and AdamW keep no compensation
    fresh["state"] = state
    optimizer.load_state_dict(fresh)


@torch.no_grad()
def _carry_into_stable_adamw(optimizer, state: dict, steps: list[int] | None) -> None:
    """The library makes each parameter's whole state (its _init_state, as at its first step: eps_sq from this
    phase's eps, Triton's scratch), then the carried moments (and compensation) replace its zeros; a StableAdamW's
    step counts continue (its group set up as its first step would, the path already chosen at construction)."""
    if steps is not None and len(steps) == len(optimizer.param_groups):
        for group, step in zip(optimizer.param_groups, steps):
            group["setup"], group["step"] = True, torch.tensor(step, dtype=torch.int32)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    groups = [group for group in optimizer.param_groups for _ in group["params"]]
    for index, carried in state.items():
        p = params[int(index)]
        own = optimizer.state[p]
        optimizer._init_state(groups[int(index)], own, p)
        for key, value in carried.items():
            if key == "kahan_comp" and not (isinstance(own.get(key), torch.Tensor) and own[key].shape == value.shape):
                continue  # fp32 parameters keep no compensation
            own[key].copy_(value.to(own[key].device, own[key].dtype))
