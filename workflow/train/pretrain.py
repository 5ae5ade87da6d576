"""Pretraining (one phase) of the configured model family: the pretraining task (data, heads, loss) plugged into the training engine.

API:
    TrainSettings.from_config(config, phase, **paths)   the phase's settings, read once from the workflow config
                           (validated, the schema's defaults filled in) into workflow/train/settings.py's objects
    pretrain(settings)     train (resuming from `run_dir/checkpoints`), evaluate on the fixed held-out set
                           (workflow/train/evaluation.py) every `eval_every` steps and at the end, export;
                           returns the summary dict
    family(s.model.family) the model family's build, fingerprint, FLOPs and export (workflow/train/models/family.py:
                           BERT from a preset / bert_config.json / HF directory / DLE checkpoint; ModernBERT)
    PretrainingTask        the engine's Task: global sequence order, MLM + NSP loss normalised over the global batch

    python -m workflow.train.pretrain --phase phase1 --config '{"seed": .., "model": {..}, "pretrain": {..}}' \
        --data-dir data/hdf5_seq128 --vocab data/vocab.txt [--no-lowercase ...] --run-dir runs/pretrain/phase1 \
        --out-dir results/...     (the out dir's model/ loads with HF's from_pretrained and AutoTokenizer)
    python -m workflow.train.pretrain --phase phase1 --configfile config.yaml --data-dir ... (the same, outside
        Snakemake: the config file validated against config.schema.yaml with its defaults, as the workflow does)

Loss: MLM cross-entropy summed over the masked tokens of the global batch / their number, plus NSP summed over its
sequences / their number (one token-weighted mean per step, whatever the micro-batch split or packing).
Data: NVIDIA-schema or packed shards (workflow.data.pack); `global_batch_size` counts sequences either way, as in
NVIDIA's recipe: step k trains on sequences [k*G, (k+1)*G) of the global order, packed rows carrying them (a row
straddling a step's or micro-batch's edge is carried by both sides, each with its own sequences only; see
workflow/train/pretraining_data.py), so a packed step has fewer rows and the same loss. `micro_batch_size` counts
rows of the data file (sequences when unpacked): each rank's share of a step's rows goes in micro-batches of exactly
that many rows, the last one filled up with empty rows, so every micro-batch has one shape (compiled graphs are
reused) and the number of micro-batches per step varies with the rows the step's sequences fill.
Metrics: seq_per_s; tokens_per_s counts sequences x sequence length (padding included), as NVIDIA reports it;
real_tokens_per_s counts the tokens that are not padding (what packing raises). Optimizer: `pretrain.optimizer`, LAMB
(the default; gradient clipping is its global-norm pre-normalisation, max_grad_norm, as in NVIDIA's recipe), AdamW
(torch clipping to max_grad_norm) or StableAdamW (torch-optimi's; clipping only where max_grad_norm is set;
workflow/train/optim/optimizers.py). Phase 2 starts from phase 1's weights and, unless `pretrain.carry_optimizer_state` is
false, phase 1's optimizer moments with step and learning rate reset (a StableAdamW's step count continues:
optimizers.carry_optimizer_state).
Schedules (workflow/train/optim/schedules.py): a phase's learning rate follows `schedule` (poly: NVIDIA's; wsd:
warm-up-stable-decay), and with `batch_size_warmup` its global batch grows from start_size to global_batch_size over
the first `sequences` sequences (step k then trains on sequences [sequences_before(k), sequences_before(k) +
batch_at(k)) of the global order); both count optimizer steps, total_steps included.

Held-out evaluation: `eval_max_sequences` sequences of the test shards chosen by `eval_seed` (the same set for any
world size and any run on the same data); every `eval_every` steps the metrics line of that step adds test_mlm_accuracy
etc. and train_time_s (training time so far, summed over resumed attempts, evaluations and checkpoints excluded): the
accuracy curve. The final evaluation (summary.json) is the same set's.
Run directory (`--run-dir`, not a rule output): checkpoints/step_*.pt, metrics.jsonl, gpu_telemetry.csv. See
workflow/train/engine.py for resume (elastic), refusals, stop signals and SNAKEBERT_FAIL_AT_STEP.
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import h5py
import torch

from workflow.train import accelerator
from workflow.train import checkpoint as ckpt
from workflow.train import distributed
from workflow.atomic import atomic_path, write_json
from workflow.cli import UserError, config_sections, run
from workflow.config import PHASES, load_config, phase_forms, pretrain_config_error, validate_config
from workflow.data.tokenizer import Vocabulary
from workflow.data.vocab import Normalization, vocab_file_type
from workflow.train.engine import LoopSettings, set_threads, train
from workflow.train.evaluation import EvaluationSet
from workflow.train.float8 import convert_to_float8, float8_error
from workflow.train.models import kernels
from workflow.train.models.family import ModelSettings, family
from workflow.train.optim.optimizers import (HYPER_PARAMETERS, carry_optimizer_state, engine_clip, make_optimizer,
                                       state_to_carry)
from workflow.train.optim.schedules import BatchRamp, make_scheduler
from workflow.train.models.fused_loss import fused_mlm_loss_reason, summed_mlm_loss
from workflow.train.models.kit import (count_parameters, host_indices, next_sentence_terms, pretraining_loss,
                                       unpadded_of)
from workflow.train.precision import autocast, resolve_precision
from workflow.train.pretraining_data import (ORDER, PretrainingSequences, data_identity, datasets, list_shards,
                                            row_tokens_per_sequence)
from workflow.train.settings import PhaseSettings, PretrainSettings
from workflow.train.telemetry import merge_node_files

# A stop signal after the last checkpoint: the job is minutes from done, and a rerun would redo this part anyway.
FINISH_AFTER_TRAINING = "the last checkpoint is written; finishing the evaluation and export first"
log = logging.getLogger("pretrain")
LAMB_KEYS = HYPER_PARAMETERS  # of pretrain.lamb, pretrain.adamw and pretrain.stable_adamw alike


@dataclass(frozen=True)
class TrainSettings:
    """One phase's settings: the config's sections as typed objects (workflow/train/settings.py, family.ModelSettings),
    built once by from_config, and the job's paths and process values (not config keys)."""

    phase: PhaseSettings                # config pretrain.<phase>
    pretrain: PretrainSettings          # config pretrain (its optimizer included)
    model: ModelSettings                # config model, as this phase starts (init_from, global_rope_theta)
    seed: int                           # config seed
    data_dir: str
    vocab: str
    run_dir: str
    out_model: str
    out_metrics: str
    out_summary: str
    init_optimizer: str | None = None   # phase 1's optimizer moments (phase 2 of NVIDIA's recipe)
    out_optimizer: str | None = None    # where this phase's final optimizer moments go
    out_telemetry: str | None = None
    normalization: Normalization = Normalization()  # how the vocab was built and the data tokenized (config
                                                    # vocab): the exported tokenizer's
    device: str = "auto"
    threads: int | None = None
    deterministic: bool = False

    @classmethod
    def from_config(cls, config: dict, phase: str, init_from: str | None = None, **paths) -> "TrainSettings":
        """Settings of `phase` from the config sections seed, model and pretrain, validated against the schema (its
        defaults filled in: the only defaults) and checked by the Snakefile's own pretrain_config_error;
        `init_from`: where the phase starts (else model.init_from)."""
        config = validate_config(copy.deepcopy(config))
        error = pretrain_config_error(config["pretrain"])
        if error:
            raise UserError(error)
        section = config["pretrain"][phase]
        counts = phase_in_sequences(section, f"pretrain.{phase}", paths.get("data_dir"))
        phase_settings = PhaseSettings.from_config(phase, {**section, **counts})
        model = ModelSettings.from_config(config["model"], init_from=init_from,
                                          global_rope_theta=phase_settings.global_rope_theta, phase=phase)
        settings = cls(phase=phase_settings, pretrain=PretrainSettings.from_config(config["pretrain"]), model=model,
                       seed=config["seed"], **paths)
        settings.batch_ramp  # a start size above the global batch: refused here
        return settings

    @property
    def batch_ramp(self) -> BatchRamp | None:
        """The phase's batch-size warm-up (None: every step global_batch_size sequences, NVIDIA's)."""
        ramp, batch = self.phase.batch_size_warmup, self.phase.global_batch_size
        if not ramp:
            return None
        if ramp["start_size"] > batch:
            raise UserError(f"config {self.phase.key}.batch_size_warmup.start_size ({ramp['start_size']}) exceeds "
                            f"{self.phase.key}.global_batch_size ({batch})")
        return BatchRamp(batch, ramp["start_size"], ramp["sequences"])


def phase_in_sequences(phase: dict, key: str, data_dir: str | None) -> dict:
    """A phase section's global_batch_size, total_steps and batch_size_warmup in sequences and steps, each given so or
    in row tokens (global_batch_tokens, total_tokens, batch_size_warmup.start_tokens and .tokens: rows x
    max_seq_length, ModernBERT's count), converted here once with the training data's row tokens per sequence
    (pretraining_data.row_tokens_per_sequence); `phase` gives each in one form (config.pretrain_config_error)."""
    ramp = phase.get("batch_size_warmup") or {}
    in_tokens = [f"{where}.{tokens}" for section, where, _, tokens in phase_forms(phase, key)
                 if section.get(tokens) is not None]
    if not in_tokens:
        return {}
    try:
        per_sequence = row_tokens_per_sequence(data_dir)
    except UserError as error:
        raise UserError(f"config {in_tokens[0]}: tokens become sequences by the training data's rows: "
                        f"{error}") from None

    def sequences(section: dict, counted: str, tokens: str) -> int:
        return section[counted] if section.get(counted) is not None else max(1, round(section[tokens] / per_sequence))

    batch = sequences(phase, "global_batch_size", "global_batch_tokens")
    warmup = {"start_size": sequences(ramp, "start_size", "start_tokens"),
              "sequences": sequences(ramp, "sequences", "tokens")} if ramp else None
    steps = phase["total_steps"] if phase.get("total_steps") is not None else BatchRamp(
        batch, **(warmup or {})).steps_for(phase["total_tokens"] / per_sequence)
    log.info("%s: %s in tokens at %.1f row tokens a sequence: %d sequences a step, %d steps", key,
             ", ".join(in_tokens), per_sequence, batch, steps)
    return {"global_batch_size": batch, "total_steps": steps, "batch_size_warmup": warmup}


def read_vocab_size(path: str) -> int:
    """The ids of a vocab.txt (its non-empty lines) or a tokenizer.json."""
    if vocab_file_type(path) == "bpe":
        return Vocabulary.load(path).size
    try:
        with open(path, encoding="utf-8") as handle:
            size = sum(1 for line in handle if line.rstrip("\n"))
    except OSError as error:
        raise UserError(f"{path}: cannot read the vocabulary ({error})") from None
    if size == 0:
        raise UserError(f"{path}: empty vocabulary")
    return size


class PretrainingTask:
    """Masked LM + next sentence prediction on the shards' global sequence order (the engine's Task); without
    `next_sentence_prediction` (full-sentences data), masked LM only: the NSP loss is 0 (kept in the graph with zero
    gradients, so every parameter takes part in each step, as DDP requires)."""

    def __init__(self, sequences: PretrainingSequences, seq_length: int, next_sentence_prediction: bool = True,
                 host_indices=host_indices, fused_loss: bool = False):
        self.sequences = sequences
        self.seq_length = seq_length
        self.next_sentence_prediction = next_sentence_prediction
        self.host_indices = host_indices  # the model family's (ModernBERT unpads every row on the GPU)
        self.fused_loss = fused_loss  # liger's kernel where it runs (workflow.train.models.fused_loss)

    def read(self, start: int, count: int) -> dict:
        return self.sequences.read(start, count)

    def micro_batches(self, start: int, count: int, rank: int, world: int, rows: int) -> list[dict]:
        # In the loader's worker: the indices the forward needs are computed here, so it never waits on the device.
        return [self.host_indices(batch) for batch in self.sequences.micro_batches(start, count, rank, world, rows)]

    def count(self, batch: dict) -> dict:
        return {"masked": (batch["masked_lm_labels"] >= 0).sum(), "sequences": (batch["next_sentence_labels"] >= 0).sum()}

    def loss(self, model, batch: dict, totals: dict) -> dict:
        # The head's hidden states and the tied decoder: the (fused) loss makes the logits, or none at all.
        hidden, nsp_logits, labels = forward(model, batch, return_hidden=True)
        summed, correct = summed_mlm_loss(hidden, *unwrapped(model).mlm_decoder(), labels, fused=self.fused_loss)
        mlm_loss = summed / totals["masked"]
        nsp = next_sentence_terms(nsp_logits, batch["next_sentence_labels"].flatten(), mlm_loss, totals["sequences"])
        if not self.next_sentence_prediction:
            nsp["nsp_loss"] = nsp["nsp_loss"] * 0.0
        with torch.no_grad():
            stats = {"mlm_correct": correct, "mlm_count": (labels >= 0).sum(), "real_tokens": count_real_tokens(batch)}
        return {"loss": mlm_loss + nsp["nsp_loss"], "mlm_loss": mlm_loss, **nsp, **stats}

    def metrics(self, sums: dict, steps: int, sequences: int, elapsed: float, step: int) -> dict:
        nsp = {"nsp_loss": sums["nsp_loss"] / steps, "nsp_accuracy": sums["nsp_correct"] / max(sums["nsp_count"], 1)}
        return {"loss": sums["loss"] / steps, "mlm_loss": sums["mlm_loss"] / steps,
                "mlm_accuracy": sums["mlm_correct"] / max(sums["mlm_count"], 1),
                **(nsp if self.next_sentence_prediction else {}),  # no NSP objective, no NSP figure
                "tokens_per_s": sequences * self.seq_length / max(elapsed, 1e-9),
                "real_tokens": int(sums["real_tokens"]), "real_tokens_per_s": sums["real_tokens"] / max(elapsed, 1e-9)}


def count_real_tokens(batch: dict) -> torch.Tensor:
    """Tokens that are not padding (an unpacked empty row's one attended token is padding too)."""
    real = batch["attention_mask"] > 0
    if batch["next_sentence_labels"].dim() == 1:  # unpacked: one sequence per row
        real &= (batch["next_sentence_labels"] >= 0).unsqueeze(1)
    return real.sum()


def unwrapped(model):
    """The model under torch.compile's and DDP's wrappers."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model)


def forward(model, batch: dict, return_hidden: bool = False):
    """(mlm_logits [N, V] (with `return_hidden`: the MLM head's hidden states [N, H] before its decoder), nsp_logits,
    mlm_labels [N]) of a batch, packed (position_ids, cls_positions given) or
    not, at N prediction slots in row-major order (labels -1: empty slots, for the loss to ignore). A batch through
    model.host_indices (training's) carries every slot, N = B * P, and its rows' sequences: no host sync, and shapes
    fixed by the batch's (a compiled graph is reused); any other batch selects its M labelled slots here (a host sync
    on CUDA)."""
    if "masked_lm_index" not in batch:
        valid = batch["masked_lm_labels"] >= 0
        mlm_logits, nsp_logits = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
                                       batch["masked_lm_positions"], batch.get("position_ids"),
                                       batch.get("cls_positions"), masked_lm_valid=valid,
                                       return_hidden=return_hidden)
        return mlm_logits, nsp_logits, batch["masked_lm_labels"][valid]
    mlm_logits, nsp_logits = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
                                   batch["masked_lm_positions"], batch.get("position_ids"), batch.get("cls_positions"),
                                   masked_lm_index=batch["masked_lm_index"], unpadded=unpadded_of(batch),
                                   mask_needed=batch["mask_needed"], return_hidden=return_hidden)
    return mlm_logits, nsp_logits, batch["masked_lm_targets"]


def pretraining_forward(model, batch: dict) -> dict:
    mlm_logits, nsp_logits, labels = forward(model, batch)
    return pretraining_loss(mlm_logits, nsp_logits, labels, batch["next_sentence_labels"])


@torch.no_grad()
def evaluate(model, evaluation_set: EvaluationSet, env, precision, batch_size, next_sentence_prediction: bool = True,
             host_indices=host_indices) -> dict:
    """Held-out MLM/NSP accuracy and loss on the fixed evaluation set: each rank scores its share, the sums are
    all-reduced (the counts exactly: an accuracy does not depend on the world size). Every rank calls it.
    `test_sequences` counts the sequences scored; without `next_sentence_prediction` (the data's objective has none)
    the NSP figures are left out, not reported as 0 or as an untrained head's guesses."""
    model.eval()
    sums = torch.zeros(7, dtype=torch.float64, device=env.device)
    for batch in evaluation_set.batches(env.rank, env.world_size, batch_size):
        batch = {k: v.to(env.device) if isinstance(v, torch.Tensor) else v for k, v in host_indices(batch).items()}
        with autocast(env.device, precision):
            out = pretraining_forward(model, batch)
        sums += torch.stack([out["mlm_correct"], out["mlm_count"], out["nsp_correct"], out["nsp_count"],
                             out["mlm_loss"].float() * out["mlm_count"],
                             out["nsp_loss"].float() * out["nsp_count"],
                             (batch["next_sentence_labels"] >= 0).sum()]).double()
    distributed.all_reduce_(sums)
    model.train()
    mlm_correct, mlm_count, nsp_correct, nsp_count, mlm_loss, nsp_loss, sequences = sums.tolist()
    nsp = {"test_nsp_accuracy": nsp_correct / max(nsp_count, 1), "test_nsp_loss": nsp_loss / max(nsp_count, 1)}
    return {"test_mlm_accuracy": mlm_correct / max(mlm_count, 1), "test_mlm_loss": mlm_loss / max(mlm_count, 1),
            **(nsp if next_sentence_prediction else {}),
            "test_sequences": int(sequences), "test_predictions": int(mlm_count)}


def _fingerprint(s: TrainSettings, config, data: dict, optimizer_name: str) -> dict:
    """What defines the run's math, by config key: a change refuses to resume (world size, micro-batch size,
    threads, cadence, precision and max_steps may change). `data`: pretraining_data.data_identity."""
    phase, optimizer, key = s.phase, s.pretrain.optimizer, s.phase.key
    # The recipe's newer keys only where they differ from NVIDIA's: a BERT run's fingerprint keeps its bytes.
    recipe = {f"{key}.schedule": phase.schedule, **{f"{key}.{k}": v for k, v in phase.wsd.items()}} \
        if phase.schedule != "poly" else {}
    if phase.batch_size_warmup:
        recipe[f"{key}.batch_size_warmup"] = dict(phase.batch_size_warmup)
    if optimizer.name == "stable_adamw":
        recipe["pretrain.stable_adamw.decouple_lr"] = optimizer.decouple_lr
    return {f"{key}.learning_rate": phase.learning_rate, f"{key}.warmup_proportion": phase.warmup_proportion,
            f"{key}.total_steps": phase.total_steps, f"{key}.global_batch_size": phase.global_batch_size, **recipe,
            "seed": s.seed,
            **{f"pretrain.{optimizer.name}.{k}": getattr(optimizer, k) for k in LAMB_KEYS}, "optimizer": optimizer_name,
            **family(s.model.family).fingerprint(config), "init weights": _file_digest(s.model.init_from, (
                "model.safetensors", "pytorch_model.bin", "")),
            "init optimizer state": _file_digest(s.init_optimizer, ("",)), "vocab": _file_digest(s.vocab, ("",)),
            **data, "data order": ORDER}


def _file_digest(path: str | None, names) -> str | None:
    """sha256 of an input file (a retrained phase 1 invalidates phase 2's checkpoints)."""
    if not path:
        return None
    for name in names:
        candidate = Path(path) / name if name else Path(path)
        if candidate.is_file():
            return ckpt.file_sha256(candidate)[:16]
    return str(path)


def _real_tokens(metrics_path: Path) -> int:
    """Real tokens trained on so far: every step is in exactly one metrics line (a resume truncates later ones)."""
    lines = metrics_path.read_text().splitlines() if metrics_path.exists() else []
    return sum(json.loads(line).get("real_tokens", 0) for line in lines if line.strip())


def check_token_ids(shards, vocab: str, vocab_size: int) -> None:
    """Every token id of the shards < the model's vocab_size (on CUDA, a larger one is an opaque device-side assert
    hours later). Shards encoded with this very vocab file (their vocab_sha256 attribute) hold ids below its size by
    construction; others (another vocab, NVIDIA's own files) are read through once."""
    digest = ckpt.file_sha256(Path(vocab))
    for shard in shards:
        with h5py.File(shard.path, "r") as handle:
            if handle.attrs.get("vocab_sha256") == digest:
                continue
            arrays = datasets(handle, shard)
            for name in ("input_ids", "masked_lm_ids"):
                largest = max((int(arrays[name][a:a + 65536].max(initial=0)) for a in range(0, len(arrays[name]),
                                                                                              65536)), default=0)
                if largest >= vocab_size:
                    raise UserError(f"{shard.path}: {name} holds token id {largest}, beyond the model's vocab_size "
                                    f"{vocab_size}; encode the data with {vocab} (or use a model of that vocabulary)")


def pretrain(s: TrainSettings) -> dict:
    accelerator.configure_process(s.deterministic)
    set_threads(s.threads)
    env = distributed.setup(s.device)
    try:
        return train_phase(s, env)
    finally:
        distributed.cleanup()


def train_phase(s: TrainSettings, env) -> dict:
    """Train, evaluate and export one phase in the process group `env`; its summary."""
    train_shards = list_shards(s.data_dir, "training")
    test_shards = list_shards(s.data_dir, "test")
    seq_length = train_shards[0].seq_length
    phase, p, o = s.phase, s.pretrain, s.pretrain.optimizer
    precision = resolve_precision(p.precision, env.device, "pretrain.precision")

    if p.float8 and (error := float8_error(env.device)):
        raise UserError(error)
    torch.manual_seed(s.seed)  # identical initial weights on every rank
    model_family = family(s.model.family)
    model_family.check_objective(train_shards[0].objective)
    if model_family.trains_unpadded(env.device.type, train_shards[0].packed, precision):
        if precision != "fp32":
            kernels.fast_kernel(model_family.name, env.device)  # below its torch or GPU floor: one warning, here
        elif env.device.type == "cuda":  # flash kernels are 16-bit only: fp32 takes the family's exact path
            log.warning("pretrain.precision fp32: packed rows train with %s on CUDA, not the flash kernels of bf16 "
                        "and fp16; set pretrain.precision: bf16 to train faster",
                        kernels.SLOWER[kernels.trained_path(model_family.name, env.device, torch.float32)])
    config, model = model_family.build(s.model, s.vocab, read_vocab_size(s.vocab), seq_length)
    check_token_ids(train_shards + test_shards, s.vocab, config.vocab_size)
    model.to(env.device)
    if p.float8:  # before the optimizer, DDP and compile see the model (Float8Linear keeps its Parameters)
        convert_to_float8(model)
    fused_loss = p.fused_loss and fused_mlm_loss_reason(env.device) is None
    why = fused_mlm_loss_reason(env.device) if p.fused_loss else "pretrain.fused_loss: false"
    log.info("MLM loss: %s", "liger-kernel's fused linear cross-entropy (no logits)" if fused_loss else
             f"logits, then cross-entropy ({why})")
    if env.distributed:  # own dropout masks per rank (as NVIDIA seeds seed + rank); weights stay identical
        torch.manual_seed(s.seed + env.rank)
    optimizer, optimizer_name = make_optimizer(
        o.name, model, phase.learning_rate, o.weight_decay, o.max_grad_norm, (o.beta1, o.beta2), o.eps, o.fused,
        o.decouple_lr)
    if s.init_optimizer:
        carry_optimizer_state(optimizer, s.init_optimizer)
        log.info("%s moments carried over from %s (learning rate reset, step %s)",
                 {"lamb": "LAMB", "adamw": "AdamW", "stable_adamw": "StableAdamW"}[o.name], s.init_optimizer,
                 "continued" if o.name == "stable_adamw" else "reset")
    scheduler = make_scheduler(optimizer, phase.total_steps, phase.warmup_proportion, phase.schedule, **phase.wsd)
    log.info("%s: %s, %d parameters, %s, %s, seq %d", phase.name, env.device, count_parameters(model), precision,
             optimizer_name, seq_length)
    sequences = PretrainingSequences(train_shards, s.seed)
    evaluation_set = EvaluationSet(test_shards, p.eval_max_sequences, p.eval_seed)
    log.info("held-out evaluation set: %s", evaluation_set.identity)
    next_sentence_prediction = train_shards[0].objective == "nsp"
    held_out = functools.partial(evaluate, evaluation_set=evaluation_set, env=env, precision=precision,
                                 batch_size=phase.micro_batch_size * 2,
                                 next_sentence_prediction=next_sentence_prediction,
                                 host_indices=model_family.host_indices)
    loop = LoopSettings(config_key=phase.key, run_dir=s.run_dir, total_steps=phase.total_steps,
                        global_batch_size=phase.global_batch_size, micro_batch_size=phase.micro_batch_size,
                        max_steps=phase.max_steps, precision=precision, checkpoint_every=p.checkpoint_every,
                        clip_grad_norm=engine_clip(o.name, o.max_grad_norm),
                        keep_checkpoints=p.keep_checkpoints, log_every=p.log_every, seed=s.seed, compile=p.compile,
                        compile_mode=p.compile_mode, loader_workers=p.loader_workers, eval_every=p.eval_every,
                        evaluate=held_out, batch_ramp=s.batch_ramp)
    try:
        task = PretrainingTask(sequences, seq_length, next_sentence_prediction, model_family.host_indices,
                               fused_loss)
        outcome = train(env, model, optimizer, scheduler, task, loop,
                        _fingerprint(s, config, data_identity(s.data_dir, train_shards), optimizer_name))
    finally:
        sequences.close()
    if outcome.stopped:
        distributed.cleanup()
        raise SystemExit(outcome.stopped)

    with ckpt.StopSignals(then=FINISH_AFTER_TRAINING):
        ckpt.signal_at("evaluation")
        # The loop's own evaluation when it evaluated at its last step (the same set, the same weights).
        evaluation = outcome.evaluation if outcome.evaluation is not None else held_out(model)
        return _export(s, env, model, config, optimizer, optimizer_name, outcome, train_shards, evaluation,
                       evaluation_set.identity, precision)


def _export(s: TrainSettings, env, model, config, optimizer, optimizer_name, outcome, train_shards, evaluation: dict,
            evaluation_set: str, precision) -> dict:
    step, train_time, phase = outcome.step, outcome.train_time_s, s.phase
    seq_length = train_shards[0].seq_length
    sequences = s.batch_ramp.sequences_before(step) if s.batch_ramp else step * phase.global_batch_size
    real_tokens = _real_tokens(Path(s.run_dir) / "metrics.jsonl") if env.is_main else 0
    summary = {
        "phase": phase.name, "steps": step, "total_steps": phase.total_steps, "train_time_s": round(train_time, 3),
        "sequences": sequences, "seq_length": seq_length,
        "seq_per_s": sequences / max(train_time, 1e-9),
        "tokens_per_s": sequences * seq_length / max(train_time, 1e-9),
        "real_tokens_per_s": real_tokens / max(train_time, 1e-9), "packed": train_shards[0].packed,
        "world_size": env.world_size, "device": str(env.device.type), "precision": precision,
        "skipped_steps": outcome.skipped_steps,  # fp16 steps the loss scaler skipped (inf/nan gradients)
        # How far the learning-rate schedule got: a skipped step holds it, and the phase still ends after its steps.
        "schedule_steps": step - outcome.skipped_steps, "final_learning_rate": optimizer.param_groups[0]["lr"],
        "optimizer": optimizer_name, "parameters": count_parameters(model), "global_batch_size": phase.global_batch_size,
        "micro_batch_size": phase.micro_batch_size, "accumulation_steps": outcome.micro_batches_per_step,
        "train_flops_per_sequence": family(s.model.family).flops_per_sequence(config, seq_length,
                                                                              train_shards[0].max_predictions),
        "family": s.model.family, "model": config.to_dict(), **evaluation, "test_set": evaluation_set,
        "masking": "dynamic" if train_shards[0].dynamic else "static", "objective": train_shards[0].objective,
        "next_sentence_prediction": train_shards[0].objective == "nsp",
    }
    distributed.barrier()  # every node's telemetry sampler has stopped: its last rows are on disk
    # No rank leaves before rank 0's export is on disk, however long it takes (BERT-large: over 5 GB): srun kills
    # a step's last ranks RANK_EXIT_WAIT_S after its first one exits (workflow/slurm/launch.py).
    exported = distributed.patient_group()
    if env.is_main:
        if outcome.skipped_steps:
            log.warning("%d fp16 step(s) skipped: the learning-rate schedule ends at its step %d of %d (lr %.3g, not "
                        "0); the phase ends with its data", outcome.skipped_steps, summary["schedule_steps"],
                        phase.total_steps, summary["final_learning_rate"])
        run_dir = Path(s.run_dir)
        merge_node_files(run_dir / "gpu_telemetry.csv")  # again: rank 0 merged on its own stop, before the others'
        with atomic_path(s.out_model) as temporary:
            family(s.model.family).export(model, config, s.vocab, temporary, s.normalization,
                                          summary["next_sentence_prediction"], s.model.dle_gelu)
        _slow_storage()
        with atomic_path(s.out_metrics) as temporary:
            shutil.copyfile(run_dir / "metrics.jsonl", temporary)
        if s.out_telemetry and (run_dir / "gpu_telemetry.csv").exists():
            with atomic_path(s.out_telemetry) as temporary:
                shutil.copyfile(run_dir / "gpu_telemetry.csv", temporary)
        if s.out_optimizer:
            with atomic_path(s.out_optimizer) as temporary:
                torch.save(state_to_carry(optimizer), temporary)
        write_json(s.out_summary, summary)
        log.info("%s done: %s", phase.name, {k: summary[k] for k in ("steps", "seq_per_s", "test_mlm_accuracy",
                                                                   "test_nsp_accuracy") if k in summary})
    distributed.patient_barrier(exported)
    return summary


def _slow_storage() -> None:
    """Simulate slow shared storage for tests: SNAKEBERT_EXPORT_DELAY_S=N makes rank 0's export N s longer."""
    delay = float(os.environ.get("SNAKEBERT_EXPORT_DELAY_S") or 0)
    if delay:
        log.warning("SNAKEBERT_EXPORT_DELAY_S=%s: the export waits that long (slow storage)", delay)
        time.sleep(delay)


def parse_args(argv=None) -> TrainSettings:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--phase", required=True, choices=PHASES)
    config = p.add_mutually_exclusive_group(required=True)
    config.add_argument("--config", type=config_sections, help="JSON of the config sections seed, model and pretrain "
                        "(as the rule hands them over)")
    config.add_argument("--configfile", type=load_config, help="the workflow's config file (config.yaml), validated "
                        "against config.schema.yaml as Snakemake does: to run a phase outside Snakemake")
    p.add_argument("--data-dir", required=True, help="data/hdf5_seqN (training/ and test/ shards)")
    p.add_argument("--vocab", required=True)
    p.add_argument("--run-dir", required=True, help="checkpoints and live metrics (kept across reruns)")
    p.add_argument("--out-dir", required=True, help="model/, metrics.jsonl, summary.json, optimizer_state.pt, "
                   "gpu_telemetry.csv (when a GPU exists)")
    p.add_argument("--init-from", default=None, help="HF BERT directory to start from (else config model.init_from)")
    p.add_argument("--init-optimizer", default=None, help="phase 1's optimizer_state.pt to carry over")
    p.add_argument("--lowercase", action=argparse.BooleanOptionalAction, default=None,
                   help="the vocab is uncased: the exported tokenizer lower-cases (default: --configfile's "
                   "vocab section, else yes); --[no-]strip-accents and --[no-]tokenize-chinese-chars with it")
    p.add_argument("--strip-accents", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--tokenize-chinese-chars", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None, help="CPU threads of the job (shared by its local ranks)")
    p.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms(True)")
    args = p.parse_args(argv)
    config = args.config or args.configfile  # --configfile: validated; --config: by from_config
    if args.lowercase is not None or "vocab" not in config:  # the flags, as the rule passes them
        normalization = Normalization(True if args.lowercase is None else args.lowercase, args.strip_accents,
                                      args.tokenize_chinese_chars)
    else:
        normalization = Normalization.from_config(config["vocab"])
    out = Path(args.out_dir)
    return TrainSettings.from_config(
        config, args.phase, data_dir=args.data_dir, vocab=args.vocab, run_dir=args.run_dir,
        out_model=str(out / "model"), out_metrics=str(out / "metrics.jsonl"), out_summary=str(out / "summary.json"),
        out_telemetry=str(out / "gpu_telemetry.csv"), out_optimizer=str(out / "optimizer_state.pt"),
        init_from=args.init_from, init_optimizer=args.init_optimizer,
        normalization=normalization, device=args.device, threads=args.threads, deterministic=args.deterministic)


def main(argv=None) -> None:
    pretrain(parse_args(argv))


if __name__ == "__main__":
    run(main)
