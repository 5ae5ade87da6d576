"""A pretraining phase's schedules as functions of the optimizer step: the learning rate's (NVIDIA's poly-warmup, or
warm-up-stable-decay) and the global batch size's (a linear batch-size warm-up, ModernBERT's).

API:
    LR_SCHEDULES = ("poly", "wsd")          config pretrain.<phase>.schedule
    DECAY_SHAPES = ("linear", "1-sqrt")     config pretrain.<phase>.decay_shape (wsd)
    WarmupStableDecay(total_steps, warmup_proportion, decay_proportion, decay_shape, final_lr_fraction)
        callable for LambdaLR: the multiplier of the peak rate at optimizer step `index + 1` (as lamb.PolyWarmup)
    make_scheduler(optimizer, total_steps, warmup_proportion, schedule="poly", **wsd) -> LambdaLR
        poly: lamb.make_scheduler (NVIDIA's, unchanged); wsd: WarmupStableDecay
    (a wsd key under schedule poly, or warm-up plus decay longer than the phase: workflow/config.py's
    pretrain_config_error, at the Snakefile's parse time and the phase's start)
    BatchRamp(global_batch_size, start_size=None, sequences=0)   the global batch of each step:
        batch_at(step) sequences in step `step` (0-based), sequences_before(step) their offset in the global order
        (the sum of the earlier steps' batches); without a ramp batch_at is global_batch_size and sequences_before
        step x global_batch_size, NVIDIA's; steps_for(sequences) the fewest steps holding that many.

Warm-up-stable-decay at step t = index + 1 of T steps (W = warmup_proportion x T, D = decay_proportion x T):
    t < W: t / W;  W <= t <= T - D: 1;  t > T - D: f + (1 - f) x shape(x), x = (t - (T - D)) / D,
    shape linear: 1 - x;  1-sqrt: 1 - sqrt(x) (Hägele et al. 2024, ModernBERT's decay); f = final_lr_fraction.
A phase with decay_proportion 0 stays at its peak after the warm-up (ModernBERT's first phase); one with
warmup_proportion 0 starts at its peak (the next phase carrying on).

The batch ramp: batch_at(k) = start + (G - start) x s_k // S while s_k = sequences_before(k) < S, then G: linear in
the sequences trained on, in whole sequences, so it is the same integer on every rank and every resume. The
learning-rate schedule counts steps, not sequences: total_steps is a number of steps, and a phase with a ramp trains
on sequences_before(total_steps) sequences, fewer than total_steps x G.
"""
from __future__ import annotations

import math

import numpy as np
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from workflow.config import WSD_KEYS
from workflow.train.optim import lamb

LR_SCHEDULES = ("poly", "wsd")
DECAY_SHAPES = ("linear", "1-sqrt")
WSD_DEFAULTS = dict(zip(WSD_KEYS, (0.0, "1-sqrt", 0.0)))  # decay_proportion, decay_shape, final_lr_fraction


class WarmupStableDecay:
    """lr multiplier for the optimizer step number `index + 1` (see the module docstring)."""

    def __init__(self, total_steps: int, warmup_proportion: float, decay_proportion: float = 0.0,
                 decay_shape: str = "1-sqrt", final_lr_fraction: float = 0.0):
        self.total_steps = total_steps
        self.warmup_proportion = warmup_proportion
        self.decay_proportion = decay_proportion
        self.decay_shape = decay_shape
        self.final_lr_fraction = final_lr_fraction

    def __call__(self, index: int) -> float:
        t, total = index + 1, self.total_steps
        progress = min(t / total, 1.0)
        if progress < self.warmup_proportion:
            return progress / self.warmup_proportion
        decay_start = total * (1.0 - self.decay_proportion)
        if self.decay_proportion <= 0 or t <= decay_start:
            return 1.0
        x = min((t - decay_start) / (total * self.decay_proportion), 1.0)
        shape = 1.0 - x if self.decay_shape == "linear" else 1.0 - math.sqrt(x)
        return self.final_lr_fraction + (1.0 - self.final_lr_fraction) * shape


def make_scheduler(optimizer: Optimizer, total_steps: int, warmup_proportion: float, schedule: str = "poly",
                   **wsd) -> LambdaLR:
    if schedule == "poly":
        return lamb.make_scheduler(optimizer, total_steps, warmup_proportion)
    return LambdaLR(optimizer, WarmupStableDecay(total_steps, warmup_proportion, **{**WSD_DEFAULTS, **wsd}))


class BatchRamp:
    """The global batch of each step (see the module docstring): batch_at(step), sequences_before(step)."""

    def __init__(self, global_batch_size: int, start_size: int | None = None, sequences: int = 0):
        self.global_batch_size = global_batch_size
        self.start_size, self.sequences = (start_size, sequences) if start_size and sequences else (None, 0)
        sizes, seen = [], 0
        while self.start_size and seen < self.sequences:  # the ramp's steps: at most sequences / start_size
            size = self.start_size + (global_batch_size - self.start_size) * seen // self.sequences
            sizes.append(size)
            seen += size
        self._sizes = np.array(sizes, dtype=np.int64)
        self._before = np.concatenate([[0], np.cumsum(self._sizes)]).astype(np.int64)  # offsets of steps 0..R

    @property
    def ramp_steps(self) -> int:
        """Steps before the batch reaches global_batch_size."""
        return len(self._sizes)

    def batch_at(self, step: int) -> int:
        return int(self._sizes[step]) if step < len(self._sizes) else self.global_batch_size

    def sequences_before(self, step: int) -> int:
        ramp = len(self._sizes)
        if step <= ramp:
            return int(self._before[step])
        return int(self._before[ramp]) + (step - ramp) * self.global_batch_size

    def steps_for(self, sequences: float) -> int:
        """The fewest steps that train on at least `sequences` sequences (a phase given in tokens)."""
        ramp = len(self._sizes)
        if sequences <= self._before[ramp]:
            return int(np.searchsorted(self._before, sequences, side="left"))
        return ramp + math.ceil((sequences - int(self._before[ramp])) / self.global_batch_size)
