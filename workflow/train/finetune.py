"""What every fine-tuning (SQuAD, GLUE) shares: its settings, command line, feature checks, data order, AdamW with
warm-up and the driver that runs a task on the training engine (workflow/train/engine.py) and exports the result.

API:
    FinetuneSettings                    BERT fine-tuning's keys and defaults; from_section(config, section, overrides)
    finetune_parser(...)                the command line both stages share; each adds its own arguments
    check_features_fit(features, path, config, positions)   ids within the model's vocab, rows within its positions
    load_head(directory, head, num_labels, require_head) -> (model, config)   the task's head (a FamilyHead class:
                                        workflow/train/models/heads.py) on the directory's family's encoder
    adamw_with_warmup(model, settings, total_steps) -> (optimizer, scheduler)
    FeatureTask                         an engine Task over feature arrays: a permutation per epoch; inputs(batch):
                                        what a head's forward takes
    FinetuneJob                         what a task hands the driver (its data, model, names)
    finetune(job, init, features, output, run_dir, settings, ...) -> exit code (0, or 128+signal)
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from workflow.atomic import atomic_path, write_text
from workflow.cli import UserError, config_sections
from workflow.data.features import load_features, tokenizer_settings
from workflow.data.vocab import Normalization
from workflow.train import checkpoint, distributed
from workflow.train.engine import LoopSettings, accumulation_steps, set_threads, train
from workflow.train.optim.lamb import param_groups
from workflow.train.models.family import directory_family, own_vocab
from workflow.train.models.kit import load_weights, unpadded_of
from workflow.train.precision import resolve_precision

log = logging.getLogger(__name__)
# The settings that change the fine-tuned model (its fingerprint: a change refuses to resume).
RECIPE_KEYS = ("learning_rate", "epochs", "batch_size", "warmup_proportion", "weight_decay", "max_grad_norm")
COMPILE_KEYS = ("compile", "compile_mode")  # as pretrain's: speed only, so outside the fingerprint


@dataclass
class FinetuneSettings:
    learning_rate: float = 3e-5
    epochs: float = 2.0
    batch_size: int = 32
    micro_batch_size: int = 8
    warmup_proportion: float = 0.1
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    precision: str = "auto"
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    log_every: int = 10
    compile: bool = False               # torch.compile through the engine (config <section>.compile)
    compile_mode: str = "default"
    seed: int = 12345

    @classmethod
    def from_section(cls, config: dict, section: str, overrides: dict | None = None):
        """From the config's seed and `section` (as validated by the schema), `overrides` applied on top."""
        names = [f.name for f in fields(cls) if f.name not in ("seed", *COMPILE_KEYS)]
        try:
            merged = {**{key: config[section][key] for key in names},
                      **{key: config[section].get(key, getattr(cls, key)) for key in COMPILE_KEYS},
                      **(overrides or {})}
            return cls(seed=config["seed"], **{key: merged[key] for key in (*names, *COMPILE_KEYS)})
        except (KeyError, TypeError) as error:
            raise UserError(f"config: missing key {section}.{error.args[0] if error.args else error} "
                            "(see config.schema.yaml)") from None


def finetune_parser(description: str, sections: str, features: str, metrics: str) -> argparse.ArgumentParser:
    """The command line every fine-tuning stage shares (SQuAD, GLUE); each adds its own arguments."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, type=config_sections, help=f"JSON of the config sections {sections}")
    parser.add_argument("--init", required=True, help="HF model directory to start from (phase-2 export; any family's)")
    parser.add_argument("--features", required=True, help=f"training features .npz ({features})")
    parser.add_argument("--output", required=True, help="fine-tuned HF model directory")
    parser.add_argument("--run-dir", required=True, help="checkpoints (resumed automatically)")
    parser.add_argument("--vocab", default=None, help="vocab.txt or tokenizer.json copied into the output (default: "
                        "the init's)")
    parser.add_argument("--metrics", default=None, help=f"JSONL of {metrics}")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=None, help="CPU threads of the job (shared by its local ranks)")
    return parser


def check_features_fit(features: dict, features_path, config, positions: int) -> None:
    """Features a fine-tune can feed this model (any family's config): ids within its vocab, rows within the
    `positions` it takes (Family.positions: BERT's 512, ModernBERT's 8,192, RoBERTa's 512 past its padding index: the
    only limit on max_seq_length)."""
    if int(features["input_ids"].max()) >= config.vocab_size:
        raise UserError(f"{features_path}: token ids reach {int(features['input_ids'].max())}, beyond the model's "
                        f"vocab_size {config.vocab_size} (features made with another vocab?)")
    if features["input_ids"].shape[1] > positions:
        usable = "" if positions == config.max_position_embeddings else f" ({positions} past the padding index)"
        raise UserError(f"{features_path}: max_seq_length {features['input_ids'].shape[1]} exceeds the model's "
                        f"max_position_embeddings {config.max_position_embeddings}{usable}")


def load_head(directory, head: type, num_labels: int, require_head: bool = False):
    """(model, config): the `head` (a FamilyHead class: its kind) on the family of the HF directory's model type
    (family.directory_family), with the directory's weights. The task's output layer (the head's output_layer) is
    freshly initialised where absent or sized for another task, as are the other fresh_prefixes where absent;
    require_head: the output layer must be there, with `num_labels` outputs."""
    family = directory_family(directory)
    if head.kind not in family.heads:
        raise UserError(f"{directory}: a {family.display_name} model; {family.display_name} has no {head.kind} head "
                        f"(its heads: {', '.join(family.heads) or 'none'})")
    config, state = family.load_directory(directory)
    model = head(config, num_labels, family.head_parts)
    output, own = model.output_layer, model.state_dict()
    weight = state.get(output + "weight")
    if weight is not None and weight.shape != own[output + "weight"].shape:
        if require_head:
            raise UserError(f"{directory}: its {output.rstrip('.')} has {weight.shape[0]} outputs, the task "
                            f"{num_labels}")
        state = {k: v for k, v in state.items() if not k.startswith(output)}  # another task's head
    missing, _unexpected = load_weights(model, state)
    encoder_missing = [k for k in missing if not k.startswith(model.fresh_prefixes)]
    if encoder_missing:
        raise UserError(f"{directory}: weights lack {len(encoder_missing)} encoder tensors, e.g. {encoder_missing[0]}")
    if require_head and any(k.startswith(output) for k in missing):
        raise UserError(f"{directory}: no {output}* weights: not a fine-tuned {model.hf_class_name}")
    return model, config


def linear_warmup_decay(step: int, total_steps: int, warmup_proportion: float) -> float:
    """LR multiplier: linear 0 -> 1 over the warmup steps, then linear 1 -> 0 at total_steps."""
    warmup = warmup_proportion * total_steps
    if step < warmup:
        return min(1.0, (step + 1) / warmup)  # a fractional warmup must not overshoot the peak lr
    return max(0.0, (total_steps - step) / max(1.0, total_steps - warmup))


def adamw_with_warmup(model, s: FinetuneSettings, total_steps: int):
    """(optimizer, scheduler) of BERT fine-tuning: AdamW, linear warm-up then linear decay to 0."""
    # torch's fused AdamW (CPU and CUDA): one kernel, its step counts on the device; the foreach one reads each
    # parameter's step count on the host every step.
    fused = next(model.parameters()).device.type in ("cpu", "cuda")
    optimizer = torch.optim.AdamW(param_groups(model, s.weight_decay), lr=s.learning_rate, betas=(0.9, 0.999),
                                  eps=1e-6, fused=fused or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: linear_warmup_decay(step, total_steps, s.warmup_proportion))
    return optimizer, scheduler


class FeatureTask:
    """An engine Task over feature arrays; global order: a permutation per epoch of ceil(n / batch) batches.
    Subclasses give the loss and metrics. `token_keys` are widened to int64 per batch (kept compact: SQuAD train in
    int64 would take ~1 GB per rank), `other_keys` are passed as stored. A batch says whether its rows hold padding
    (`mask_needed`, read here on the host, by a loader worker), so the attention never reads the mask on the device;
    its row count is made on the device: no step waits for a host copy or a device read. `rows_host_indices`: the
    model family's (family.Family.rows_host_indices: what else its forward would read back), set by the driver."""

    rows_host_indices: Callable[[dict], dict] | None = None

    def __init__(self, features: dict, token_keys: tuple, other_keys: tuple, batch_size: int, seed: int):
        self.tensors = {k: torch.from_numpy(features[k]) for k in token_keys}
        self.others = {k: torch.from_numpy(features[k]) for k in other_keys}
        self.n = len(features["input_ids"])
        self.batch_size = batch_size
        self.steps_per_epoch = math.ceil(self.n / batch_size)
        self.seed = seed

    @staticmethod
    def order_of(positions: np.ndarray, n: int, batch_size: int, steps_per_epoch: int, seed: int) -> np.ndarray:
        epochs, within = np.divmod(positions, steps_per_epoch * batch_size)
        out = np.empty(len(positions), dtype=np.int64)
        for epoch in np.unique(epochs):
            order = np.random.default_rng([seed, int(epoch)]).permutation(n)
            out[epochs == epoch] = order[within[epochs == epoch] % n]
        return out

    def read(self, start: int, count: int) -> dict:
        rows = torch.from_numpy(self.order_of(np.arange(start, start + count), self.n, self.batch_size,
                                              self.steps_per_epoch, self.seed))
        batch = {**{k: v[rows].long() for k, v in self.tensors.items()}, **{k: v[rows] for k, v in self.others.items()}}
        batch = {**batch, "mask_needed": not bool(batch["attention_mask"].all())}
        return self.rows_host_indices(batch) if self.rows_host_indices else batch

    @staticmethod
    def inputs(batch: dict) -> tuple:
        """A head's forward arguments (any family's): input_ids, token_type_ids, attention_mask, mask_needed and
        the rows' sequences rows_host_indices found (None: not computed)."""
        return (batch["input_ids"], batch["token_type_ids"], batch["attention_mask"], batch["mask_needed"],
                unpadded_of(batch))

    def count(self, batch: dict) -> dict:
        return {"sequences": batch["input_ids"].new_full((), batch["input_ids"].shape[0])}  # a fill, not a copy


@dataclass
class FinetuneJob:
    """What a fine-tuning task hands the driver."""
    config_key: str       # names the run in logs and errors: "squad", "glue.MRPC"
    section: str          # its config section: "squad", "glue"
    batch_key: str        # where a batch-size fix goes: "squad", "glue.overrides.MRPC"
    unit: str             # what a training row is called in logs: "features", "examples"
    make_task: Callable[[dict, Path, FinetuneSettings], FeatureTask]   # checks the features are the task's
    load_model: Callable[[Path], tuple]                               # init directory -> (model, config)
    fingerprint: dict = field(default_factory=dict)   # the task's own entries (besides the recipe keys)
    config_json: dict = field(default_factory=dict)   # the export's config.json entries (architectures: the head's)


def _digest(path: Path) -> str:
    return checkpoint.file_sha256(path)[:16] if path.is_file() else str(path)


def finetune(job: FinetuneJob, init, features_path, output, run_dir, settings: FinetuneSettings, vocab=None,
             metrics_path=None, device: str = "auto", threads: int | None = None) -> int:
    """Fine-tune; write the HF directory `output` (rank 0). Returns 0, or 128+signal when stopped by a signal."""
    set_threads(threads)
    env = distributed.setup(device)
    try:
        return _finetune(env, job, Path(init), Path(features_path), Path(output), Path(run_dir), settings, vocab,
                         metrics_path)
    finally:
        distributed.cleanup()


def _finetune(env, job: FinetuneJob, init: Path, features_path: Path, output: Path, run_dir: Path,
              s: FinetuneSettings, vocab, metrics_path) -> int:
    accumulation_steps(s.batch_size, s.micro_batch_size, env.world_size, job.batch_key, "batch_size")
    features = load_features(features_path)
    task = job.make_task(features, features_path, s)
    total_steps = max(1, math.ceil(task.steps_per_epoch * s.epochs))

    torch.manual_seed(s.seed)
    model, config = job.load_model(init)
    family = directory_family(init)
    check_features_fit(features, features_path, config, family.positions(config))
    task.rows_host_indices = family.rows_host_indices
    model.to(env.device)
    if env.distributed:  # own dropout masks per rank; weights stay identical
        torch.manual_seed(s.seed + env.rank)
    precision = resolve_precision(s.precision, env.device, f"{job.section}.precision")
    optimizer, scheduler = adamw_with_warmup(model, s, total_steps)
    fingerprint = {**{f"{job.section}.{k}": getattr(s, k) for k in RECIPE_KEYS}, **job.fingerprint, "seed": s.seed,
                   "init weights": _digest(init / "model.safetensors"),
                   "training features": f"{task.n} {job.unit}, sha256 {_digest(features_path)}"}
    log.info("%s: fine-tuning on %d %s, %d steps (%d per epoch)", job.config_key, task.n, job.unit, total_steps,
             task.steps_per_epoch)
    loop = LoopSettings(config_key=job.config_key, run_dir=str(run_dir), total_steps=total_steps,
                        global_batch_size=s.batch_size, micro_batch_size=s.micro_batch_size, precision=precision,
                        clip_grad_norm=s.max_grad_norm, checkpoint_every=s.checkpoint_every,
                        keep_checkpoints=s.keep_checkpoints, log_every=s.log_every, seed=s.seed,
                        compile=s.compile, compile_mode=s.compile_mode, global_batch_key="batch_size")
    outcome = train(env, model, optimizer, scheduler, task, loop, fingerprint)
    if outcome.stopped:
        return outcome.stopped
    export_finetuned(env, model, config, init, vocab, output, metrics_path, run_dir, job.config_json)
    return 0


def export_finetuned(env, model, config, init: Path, vocab, output, metrics_path, run_dir: Path,
                     config_json_updates: dict) -> None:
    """The end of a fine-tune on rank 0: `output` as an HF directory (its config.json updated with
    `config_json_updates`), the run's metrics file, and the run directory removed (the finished model supersedes the
    checkpoints); every rank then waits, however long the export takes (a gloo barrier without a timeout, as the
    pretraining export's), so no rank leaves before the export is on disk."""
    exported = distributed.patient_group()
    with checkpoint.StopSignals(then="the last checkpoint is written; finishing the export first"):
        _export(env, model, config, init, vocab, output, metrics_path, run_dir, config_json_updates)
    distributed.patient_barrier(exported)


def _export(env, model, config, init: Path, vocab, output, metrics_path, run_dir: Path, config_json_updates: dict):
    if env.is_main:
        with atomic_path(output) as temporary:
            vocab_path = Path(vocab) if vocab else own_vocab(init)
            tokenizer = Path(init) / "tokenizer_config.json"  # the normalisation of the model it started from
            normalization = Normalization(**tokenizer_settings(tokenizer)) if tokenizer.is_file() else None
            vocab_path = vocab_path if vocab_path is not None and vocab_path.is_file() else None
            directory_family(init).save_directory(model, config, vocab_path, temporary, normalization)
            config_json = json.loads((temporary / "config.json").read_text())
            config_json.update({"architectures": [getattr(model, "module", model).hf_class_name],
                                **config_json_updates})
            write_text(temporary / "config.json", json.dumps(config_json, indent=2, sort_keys=True) + "\n")
        if metrics_path is not None:
            with atomic_path(metrics_path) as temporary:
                shutil.copyfile(run_dir / "metrics.jsonl", temporary)
        shutil.rmtree(run_dir, ignore_errors=True)
        log.info("fine-tuned model -> %s", output)
