"""The pretraining sections of the config, read once into frozen, typed objects that the trainer hands down.

Each is built from the validated config (workflow/config.py: the schema's defaults filled in), so no field has a
default of its own: the schema is the only one (tests/test_settings.py). Torch-free, like workflow/config.py.

API:
    PhaseSettings.from_config(name, section)   pretrain.<name> (its counts in sequences and steps)
    OptimizerSettings.from_config(pretrain)    pretrain.optimizer and that optimizer's own section
    PretrainSettings.from_config(pretrain)     the pretrain section's own keys, with its optimizer
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from workflow.config import DEFAULT_SCHEDULE, WSD_KEYS


@dataclass(frozen=True)
class PhaseSettings:
    """pretrain.<phase>: global_batch_size, total_steps and batch_size_warmup in sequences and steps, given so or
    converted from row tokens (pretrain.phase_in_sequences); a key the section leaves out is None."""

    name: str                       # phase1, phase2 (config.PHASES)
    learning_rate: float
    warmup_proportion: float
    total_steps: int
    max_steps: int | None
    global_batch_size: int
    micro_batch_size: int
    schedule: str                   # poly (NVIDIA's, when the section leaves it out) or wsd
    decay_proportion: float | None  # wsd's keys (None: schedules.WSD_DEFAULTS)
    decay_shape: str | None
    final_lr_fraction: float | None
    batch_size_warmup: dict | None  # {start_size, sequences}
    global_rope_theta: float | None  # ModernBERT's context extension

    @classmethod
    def from_config(cls, name: str, section: dict) -> "PhaseSettings":
        values = {field.name: section.get(field.name) for field in fields(cls)}
        return cls(**{**values, "name": name, "schedule": section.get("schedule") or DEFAULT_SCHEDULE})

    @property
    def key(self) -> str:
        """The section's dotted config key, as messages name it."""
        return f"pretrain.{self.name}"

    @property
    def wsd(self) -> dict:
        """The wsd keys that are set (the others take schedules.WSD_DEFAULTS)."""
        return {key: getattr(self, key) for key in WSD_KEYS if getattr(self, key) is not None}


@dataclass(frozen=True)
class OptimizerSettings:
    """pretrain.optimizer and the keys of its own section (pretrain.lamb, .adamw or .stable_adamw)."""

    name: str
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    max_grad_norm: float | None
    fused: bool
    decouple_lr: bool | None        # stable_adamw's (None: the optimizer has no such key)

    @classmethod
    def from_config(cls, pretrain: dict) -> "OptimizerSettings":
        name = pretrain["optimizer"]
        return cls(name=name, **{field.name: pretrain[name].get(field.name) for field in fields(cls)[1:]})


@dataclass(frozen=True)
class PretrainSettings:
    """The pretrain section's keys the trainer reads (both phases alike), with its optimizer."""

    precision: str
    checkpoint_every: int
    keep_checkpoints: int
    log_every: int
    loader_workers: int
    compile: bool
    compile_mode: str
    fused_loss: bool
    float8: bool
    eval_max_sequences: int | None
    eval_seed: int
    eval_every: int
    optimizer: OptimizerSettings

    @classmethod
    def from_config(cls, pretrain: dict) -> "PretrainSettings":
        own = {field.name: pretrain[field.name] for field in fields(cls) if field.name != "optimizer"}
        return cls(**own, optimizer=OptimizerSettings.from_config(pretrain))
