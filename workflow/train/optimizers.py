"""The pretraining optimizer's state carried from one phase to the next.

API:
    carry_optimizer_state(optimizer, path)   phase 1's moments into this phase's fresh optimizer
"""
from __future__ import annotations

import torch

from workflow.cli import UserError


def carry_optimizer_state(optimizer, path: str) -> None:
    """Phase 1's LAMB moments into this phase's fresh optimizer; step and learning rate stay this phase's own."""
    carried = torch.load(path, map_location="cpu", weights_only=True)
    fresh = optimizer.state_dict()
    shapes = [tuple(p.shape) for group in optimizer.param_groups for p in group["params"]]
    if carried.get("shapes") != [list(s) for s in shapes]:
        raise UserError(f"{path}: optimizer state of another model (parameter shapes differ)")
    fresh["state"] = carried["state"]
    optimizer.load_state_dict(fresh)
