"""The training engine: one loop for pretraining, SQuAD and GLUE, which plug in a `Task` (data, head, loss).

API:
    LoopSettings        what the loop needs: batch sizes, steps, precision, cadence, run directory
    Task                protocol: read(start, count) sequences of the task's global order, count(batch) the loss
                        normalisers, loss(model, batch, totals), metrics(sums) for a log line
    train(env, model, optimizer, scheduler, task, settings, fingerprint) -> Outcome
        gradient accumulation (DDP no_sync on all but the last micro-batch), autocast, optional grad clipping,
        metrics.jsonl and TensorBoard scalars (tensorboard/) in the run directory, a log line with seq/s and the
        ETA every log_every steps, checkpoints every `checkpoint_every` steps, resume, stop signals; every
        `eval_every` steps the held-out evaluation (`evaluate`), added to that step's metrics line.
    compiled(model, compile_mode, device)   the model under torch.compile(mode=compile_mode, dynamic=False), as
                        training compiles it (on CPU, dropout's random numbers from aten's kernels)
    refuse_changes(old, new, run_dir)   UserError naming each changed key old -> new and how to start over
    set_threads(threads)  this rank's share of the job's CPU threads

Elastic resume: the data position is the number of sequences consumed. Step k reads sequences
[k*G, (k+1)*G) of the task's global order (G = global batch size) and rank r takes its share of them: the task's
micro_batches (pretraining: the step's rows split into contiguous parts, micro-batches of micro_batch_size rows, as
many on every rank, ramped steps too: a rank short of rows fills up with all-padding ones), or
the micro-batches r*A .. r*A+A-1 of micro_batch_size sequences (A = accumulation steps), so a run checkpointed on 2
ranks continues on 1 or 4 with exactly the next sequences. The loss is normalised by global counts (masked tokens,
sequences) summed over the whole step, so the gradient does not depend on how the global batch is split into ranks and micro-batches either: world size,
micro-batch size, threads, cadence and max_steps may change between runs; a change of the math refuses to resume.
With a batch-size warm-up (LoopSettings.batch_ramp, workflow/train/optim/schedules.py) step k reads sequences
[sequences_before(k), sequences_before(k) + batch_at(k)) instead: the same functions of the step on every rank and
every resume, for tasks that split a step by rows (pretraining); its metrics lines add window_sequences, the
sequences of the steps since the line before.

Input pipeline: `loader_workers` processes (a torch DataLoader over the steps' positions) read each step's
micro-batches `prefetch_steps` steps ahead of the training thread, into pinned memory on CUDA.

Optimizer step: the module's zero_grad (apex FusedLAMB's own takes no argument): gradients set to None, or under DDP
zeroed in place so they stay views of its buckets (gradient_as_bucket_view). Each rank's checkpointed RNG state holds
the CUDA generator of its own device only (workflow/train/accelerator.py), so a resume may see fewer GPUs per node.
fp32 on a GPU with TF32 tensor cores runs its matmuls in TF32 (precision.configure_matmuls; the start line says so).

Skipped steps (fp16): when GradScaler finds an inf/nan gradient it skips the optimizer step and lowers its scale. The
learning-rate schedule then does not advance (it counts the optimizer steps that happened, known on the host from the
optimizer's step hook: the scaler has read found_inf already), the metrics line counts the window's `skipped_steps`,
and its `grad_norm` averages the finite norms only. The checkpoint holds the run's skipped total beside the schedule's
and the scaler's state, so a resumed run continues exactly.

Host syncs: none on a step without a log line, a checkpoint or an evaluation (fp16: GradScaler's own one, which
decides whether the optimizer steps). The step's sums (losses, counts, gradient norms) stay on the device until a log
line reads them once; the stop-signal vote is all-reduced on the device each step and read one step later from host
memory (at once at a boundary), so every rank still stops after the same step. measured_host_syncs() counts them per
step (accelerator.counting_host_syncs); cluster_check reports them.

Held-out evaluation: LoopSettings.evaluate(model) (every rank calls it; it returns the all-reduced metrics) runs
every `eval_every` steps, before that step's checkpoint; its metrics and train_time_s (the training time so far, the
checkpointed sum over resumed attempts, evaluation and checkpoint time excluded) join that step's metrics line, so
the curve is truncated and recomputed on resume like every other metric. It draws no random numbers: training is the
same with or without it.

Checkpoints: `run_dir/checkpoints/step_*.pt` (never deleted on a settings change; only the newest
`keep_checkpoints` of the run are kept). Rank 0 chooses the newest valid one and every rank loads that one.
A stop signal (SIGTERM, SIGUSR1) on any rank: every rank finishes the step, the checkpoint is written, all ranks meet
at a barrier, and train() returns the signal's exit code.
"""
from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from workflow.atomic import atomic_path
from workflow.cli import UserError
from workflow.train import accelerator
from workflow.train import checkpoint as ckpt
from workflow.train import distributed
from workflow.train.precision import autocast, configure_matmuls, grad_scaler
from workflow.train.telemetry import GpuTelemetry

log = logging.getLogger("engine")


@dataclass
class LoopSettings:
    config_key: str           # e.g. "pretrain.phase1" or "squad": names keys in error messages
    run_dir: str
    total_steps: int          # the schedule's length
    global_batch_size: int
    micro_batch_size: int
    max_steps: int | None = None   # stop early (smoke runs, benchmarks); None = total_steps
    precision: str = "fp32"        # resolved: fp32, bf16 or fp16
    clip_grad_norm: float | None = None  # torch clipping (AdamW); LAMB clips inside its step
    checkpoint_every: int = 200
    keep_checkpoints: int = 3
    log_every: int = 10
    seed: int = 12345
    compile: bool = False
    compile_mode: str = "default"  # torch.compile's mode ("max-autotune-no-cudagraphs", "reduce-overhead", ...)
    telemetry: bool = True
    global_batch_key: str = "global_batch_size"  # its config name (SQuAD: batch_size)
    loader_workers: int = 0   # processes reading micro-batches ahead (0: read on the training thread)
    prefetch_steps: int = 2   # steps read ahead by the workers
    eval_every: int = 0       # steps between held-out evaluations (0: none in the loop)
    evaluate: Callable[[torch.nn.Module], dict] | None = None  # the held-out metrics of a model (all ranks call it)
    batch_ramp: object | None = None  # schedules.BatchRamp: the global batch of each step (None: global_batch_size)


class Task(Protocol):
    def read(self, start: int, count: int) -> dict:
        """Sequences [start, start + count) of the task's global order (endless: epochs follow each other)."""

    # Optional: micro_batches(start, count, rank, world, size) -> [dict], this rank's micro-batches of the step of
    # sequences [start, start + count) (pretraining: `size` rows each, in a constant shape); without it, the engine
    # splits the step into micro-batches of `size` sequences (sequence_micro_batches).

    def count(self, batch: dict) -> dict:
        """Loss normalisers of a micro-batch (e.g. masked tokens, sequences); summed over the step and all ranks."""

    def loss(self, model, batch: dict, totals: dict) -> dict:
        """"loss": this micro-batch's share of the step's loss (sums / totals); other entries: summed statistics."""

    def metrics(self, sums: dict, steps: int, sequences: int, elapsed: float, step: int) -> dict:
        """The task's part of a metrics line from the statistics summed over a window of steps (all ranks)."""


@dataclass
class Outcome:
    step: int
    train_time_s: float
    stopped: int | None = None    # exit code (128 + signal) when a signal stopped the run
    micro_batches_per_step: float | None = None  # this rank's mean over the steps this run trained
    skipped_steps: int = 0        # fp16 steps GradScaler skipped over the whole run (resumed attempts included)
    evaluation: dict | None = None  # the held-out metrics at `step`, when the loop evaluated there


def accumulation_steps(global_batch: int, micro_batch: int, world: int, config_key: str,
                       global_name: str = "global_batch_size") -> int:
    if global_batch % (micro_batch * world):
        raise UserError(f"config {config_key}.{global_name} ({global_batch}) is not divisible by "
                        f"{config_key}.micro_batch_size ({micro_batch}) x world size ({world})")
    return global_batch // (micro_batch * world)


def set_threads(threads: int | None) -> None:
    """Give this rank its share of the job's threads: ranks on one node must not oversubscribe its cores."""
    if threads:
        torch.set_num_threads(max(1, threads // distributed.local_world_size()))


def _show(value) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def _flatten(fingerprint: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in fingerprint.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def refuse_changes(old: dict, new: dict, run_dir) -> None:
    """One UserError naming every key whose value changed (keys the old run did not record are ignored)."""
    old, new = _flatten(old), _flatten(new)
    changed = [f"{key} {_show(old[key])} -> {_show(new[key])}" for key in new if key in old and old[key] != new[key]]
    if changed:
        raise UserError(f"{run_dir}: its checkpoints belong to a run with other settings ({'; '.join(changed)}); "
                        f"to start over, move or delete {run_dir} (nothing was deleted)")


def choose_checkpoint(directory: Path, env) -> tuple[dict | None, Path | None]:
    """Rank 0 picks the newest valid checkpoint; every rank loads that same file, or all stop with an error."""
    state, path = ckpt.load_latest_checkpoint(directory, map_location="cpu") if env.is_main else (None, None)
    chosen = distributed.broadcast_object(str(path) if path else None)
    if chosen is None:
        return None, None
    error = None
    if not env.is_main:
        try:
            state, path = ckpt.load_checkpoint(Path(chosen), map_location="cpu"), Path(chosen)
        except Exception as failure:  # any unreadable file: nobody may train on (or wait for) a diverged rank
            error = failure
    failed = distributed.all_reduce_(torch.tensor(float(error is not None), device=env.device))
    if failed.item():
        raise UserError(f"{chosen}: {int(failed.item())} rank(s) cannot read the checkpoint rank 0 chose"
                        + (f" ({error})" if error else ""))
    return state, path


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines past `step` (they are about to be recomputed after a resume)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    with atomic_path(path) as temporary:
        temporary.write_text("".join(line + "\n" for line in kept))


def _gather_rng(env) -> list:
    state = ckpt.rng_state(env.device)
    if not env.distributed:
        return [state]
    gathered = [None] * env.world_size
    torch.distributed.all_gather_object(gathered, state)
    return gathered


def _restore_rng(states: list, env, seed: int, step: int) -> None:
    if env.rank < len(states):
        ckpt.set_rng_state(states[env.rank], env.device)
    else:  # the run grew: a new rank draws its own stream, reproducibly
        torch.manual_seed(hash((seed, env.rank, step)) % 2**63)


class StopVote:
    """The signal number any rank received (0: none), agreed by all ranks without a host sync per step: each step's
    vote is all-reduced on the device and copied into host memory behind the step's work; previous() reads the last
    step's (waiting for that copy only, not for the work queued after it), current() this step's (where the loop
    waits for the device anyway: a log line, a checkpoint). Every rank reads the same votes at the same steps, so all
    stop after the same step with the same code."""

    def __init__(self, device: torch.device):
        self.device, self.flag = device, torch.zeros((), device=device)
        self.buffers = [accelerator.host_buffer(device) for _ in range(2)]  # this step's vote and the last one's
        self.values = [buffer.numpy() for buffer in self.buffers]  # reading a numpy view reads host memory only
        self.events, self.cast_at, self.slot = [None, None], [False, False], 0

    def cast(self, received: int | None) -> None:
        self.flag.fill_(float(received or 0))  # a kernel argument: no copy from pageable memory
        distributed.all_reduce_(self.flag, op="max")
        self.slot ^= 1
        self.buffers[self.slot].copy_(self.flag, non_blocking=True)
        self.events[self.slot], self.cast_at[self.slot] = accelerator.record_event(self.device), True

    def _read(self, slot: int) -> int:
        if not self.cast_at[slot]:
            return 0
        accelerator.wait_event(self.events[slot])
        return int(self.values[slot])

    def previous(self) -> int:
        return self._read(self.slot ^ 1)

    def current(self) -> int:
        return self._read(self.slot)


_MEASURED: list[dict] = []  # the records of the measured_host_syncs() blocks open now


@contextlib.contextmanager
def measured_host_syncs():
    """Within it, train() counts each step's host syncs into the yielded dict: between_steps / between_syncs (steps
    with no log line, checkpoint or evaluation), boundary_steps / boundary_syncs, and calls (each step's list)."""
    record: dict = {}
    _MEASURED.append(record)
    try:
        yield record
    finally:
        _MEASURED.remove(record)


class _StepSyncs(contextlib.ExitStack):
    """The host syncs of each step into the open measured_host_syncs() record (nothing without one)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device, self.record, self.calls = device, _MEASURED[-1] if _MEASURED else None, None

    def begin(self) -> None:
        if self.record is not None:
            self.calls = self.enter_context(accelerator.counting_host_syncs(self.device))

    def end(self, boundary: bool) -> None:
        if self.record is None:
            return
        self.close()  # counting_host_syncs fills `calls` as it exits
        kind = "boundary" if boundary else "between"
        self.record[f"{kind}_steps"] = self.record.get(f"{kind}_steps", 0) + 1
        self.record[f"{kind}_syncs"] = self.record.get(f"{kind}_syncs", 0) + len(self.calls)
        self.record.setdefault("calls", []).append(self.calls)


def _to_device(batch: dict, device: torch.device) -> dict:
    """Tensors to `device`; plain values (lengths the task computed on the host) stay host values."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def sequence_micro_batches(task: Task, start: int, count: int, rank: int, world: int, size: int) -> list[dict]:
    """Rank `rank`'s micro-batches of the step of sequences [start, start + count): micro-batches rank*A .. rank*A+A-1
    of `size` sequences each (A = count / (size x world), accumulation_steps)."""
    accumulation = count // (size * world)
    first = start + rank * accumulation * size
    return [task.read(first + i * size, size) for i in range(accumulation)]


def stack_micro_batches(batches: list[dict]) -> dict:
    """A step's micro-batches as one tensor per field ("stacked": their rows concatenated, "rows": each one's), a
    field that cannot be concatenated as a list ("others"): a loader worker sends each tensor's storage as its own
    file descriptor, so 128 micro-batches x 9 fields (BERT-large phase 1 on 8 ranks) would pass 1,152 per step.
    (Dicts and lists: pin_memory turns tuples into lists.)"""
    step = {"names": list(batches[0]), "stacked": {}, "rows": {}, "others": {}}
    for name in step["names"]:
        values = [batch[name] for batch in batches]
        first = values[0]
        if all(isinstance(v, torch.Tensor) and v.dim() and v.shape[1:] == first.shape[1:] and v.dtype == first.dtype
               for v in values):
            step["stacked"][name], step["rows"][name] = torch.cat(values), [len(v) for v in values]
        else:
            step["others"][name] = values
    return step


def unstack_micro_batches(step: dict) -> list[dict]:
    """The micro-batches of stack_micro_batches again, their tensors views of the stacked ones (no copy)."""
    fields = {**{name: values.split(step["rows"][name]) for name, values in step["stacked"].items()},
              **step["others"]}
    count = len(next(iter(fields.values()))) if fields else 0
    return [{name: fields[name][k] for name in step["names"]} for k in range(count)]


class _Steps(torch.utils.data.Dataset):
    """Item `start` (or `(start, count)`, a step of a batch ramp) = this rank's micro-batches of the step of sequences
    [start, start + count), stacked (stack_micro_batches): what a DataLoader worker computes."""

    def __init__(self, task: Task, count: int, rank: int, world: int, size: int):
        self.task, self.count, self.rank, self.world, self.size = task, count, rank, world, size

    def micro_batches(self, start) -> list[dict]:
        start, count = start if isinstance(start, tuple) else (start, self.count)
        split = getattr(self.task, "micro_batches", None)
        if split is None:
            return sequence_micro_batches(self.task, start, count, self.rank, self.world, self.size)
        return split(start, count, self.rank, self.world, self.size)

    def __getitem__(self, start: int) -> dict:
        return stack_micro_batches(self.micro_batches(start))


def _start_loader_worker(_worker: int) -> None:
    """A loader worker ignores stop signals: they are the rank's to handle (finish the step, checkpoint), and its
    readers must outlive them. It ends with its rank, however the rank ends. torch's own check, that getppid()
    changed, misses a rank that SIGKILL or the out-of-memory killer took when the workers are not its children:
    under forkserver (Python 3.14's default start method on Linux) their parent is the fork server, which they keep
    alive, so they would outlive the rank forever, holding its memory and its output pipes."""
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    threading.Thread(target=_exit_with, args=(multiprocessing.parent_process(),), name="exit with the rank",
                     daemon=True).start()


def _exit_with(rank: multiprocessing.process.BaseProcess) -> None:
    rank.join()  # its sentinel, a pipe that only the rank holds open, under every start method
    os._exit(1)


def step_batches(task: Task, starts, s: LoopSettings, env):
    """Iterator of this rank's micro-batches (a list per step) of the steps at `starts` (sequence positions of steps
    of global_batch_size sequences, or (position, sequences) pairs: a batch ramp's), read by
    `s.loader_workers` processes `s.prefetch_steps` steps ahead, in pinned memory on CUDA (so copies to the GPU overlap
    compute); a step crosses from its worker as one tensor per field (stack_micro_batches). Reads are pure functions
    of the position, so reading ahead changes nothing: resume stays exact.

    The workers start here, before the caller starts its own threads. The result is a generator that shuts its
    workers down when it ends: closed (train does, also when a step raises), exhausted, or when a worker's error
    leaves it (a damaged shard, a worker the out-of-memory killer took), whose traceback would otherwise hold the
    DataLoader's iterator alive. The workers ignore SIGTERM (_start_loader_worker), so left to Python's exit they
    would be terminated in vain and joined forever: a rank that failed would hang, not exit."""
    workers = s.loader_workers
    loader = torch.utils.data.DataLoader(
        _Steps(task, s.global_batch_size, env.rank, env.world_size, s.micro_batch_size), batch_size=None,
        sampler=starts, num_workers=workers,
        prefetch_factor=max(1, -(-s.prefetch_steps // workers)) if workers else None,
        pin_memory=env.device.type == "cuda", worker_init_fn=_start_loader_worker if workers else None,
        generator=torch.Generator())  # its own seed draw: the global RNG (dropout) must not move
    return _unstacked(iter(loader))


def _unstacked(steps):
    try:
        for step in steps:
            yield unstack_micro_batches(step)
    finally:
        _shut_down(steps)


def _shut_down(steps) -> None:
    # What the iterator's own __del__ does (torch has no public call): tell the workers to finish, join them (5 s
    # each), then SIGKILL any still there, since they ignore SIGTERM.
    shut_down = getattr(steps, "_shutdown_workers", None)
    if shut_down is None:  # no workers (loader_workers: 0)
        return
    shut_down()
    for worker in getattr(steps, "_workers", []):
        if worker.is_alive():
            worker.kill()
            worker.join()


def compiled(model, compile_mode: str, device: torch.device):
    """`model` under torch.compile with `compile_mode`, as training compiles it. dynamic=False: every micro-batch of a
    run has one shape but packed rows' sequence offsets, marked dynamic (kit.unpadded_of), so one graph is compiled
    and reused. On CPU, dropout draws through aten's kernels (inductor's fallback_random), as eager does: inductor's
    own per-element generator made a compiled CPU step slower than eager (benchmarks/compile_cpu.py); on a GPU its
    generator fuses into the kernels and stays."""
    if device.type == "cpu":
        from torch._inductor import config as inductor

        inductor.fallback_random = True
    return torch.compile(model, mode=compile_mode, dynamic=False)


def train(env, model, optimizer, scheduler, task: Task, s: LoopSettings, fingerprint: dict) -> Outcome:
    """Train `model` on `task` until max_steps (resuming from the run directory); see the module docstring."""
    by_rows = hasattr(task, "micro_batches")  # else micro-batches of micro_batch_size sequences, which must divide
    accumulation = None if by_rows else accumulation_steps(s.global_batch_size, s.micro_batch_size, env.world_size,
                                                           s.config_key, s.global_batch_key)
    if s.batch_ramp is not None and not by_rows:
        raise UserError(f"config {s.config_key}: a batch-size warm-up needs a task that splits a step by rows")
    max_steps = s.max_steps or s.total_steps
    if max_steps > s.total_steps:
        raise UserError(f"config {s.config_key}.max_steps ({max_steps}) exceeds total_steps ({s.total_steps})")
    run_dir = Path(s.run_dir)
    checkpoint_dir, metrics_path = run_dir / "checkpoints", run_dir / "metrics.jsonl"
    scaler = grad_scaler(s.precision, env.device)
    matmuls = configure_matmuls(s.precision, env.device)

    step, consumed, train_time, skipped = 0, 0, 0.0, 0
    state, path = choose_checkpoint(checkpoint_dir, env)
    if state is not None:
        if "consumed" not in state:
            raise UserError(f"{path}: written by an older snakebert (no data position in sequences); to start over, "
                            f"move or delete {run_dir} (nothing was deleted)")
        refuse_changes(state.get("fingerprint", {}), fingerprint, run_dir)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        step, consumed, train_time = state["step"], state["consumed"], state["train_time_s"]
        skipped = state.get("skipped_steps", 0)
        _restore_rng(state["rng"], env, s.seed, step)
        log.info("resumed from %s at step %d/%d (%d sequences consumed, %d ranks then, %d now)", path, step,
                 s.total_steps, consumed, len(state["rng"]), env.world_size)
    if env.is_main:
        if state is None:
            metrics_path.unlink(missing_ok=True)
        _truncate_metrics(metrics_path, step)
    del state

    train_model = model
    if env.distributed:
        # Gradients as views of DDP's buckets (no copy, one gradient's memory less), kept between steps: zeroed in
        # place rather than set to None, which would drop the views and make DDP rebuild them every step.
        train_model = DistributedDataParallel(model, device_ids=[env.device.index] if env.device.type == "cuda"
                                              else None, gradient_as_bucket_view=True)
    if s.compile:
        train_model = compiled(train_model, s.compile_mode, env.device)
    ddp = getattr(train_model, "_orig_mod", train_model)  # under torch.compile, no_sync lives on the DDP module
    split = (f"micro-batches of {s.micro_batch_size} rows" if by_rows else
             f"{s.micro_batch_size} micro x {accumulation} accumulation") + f" x {env.world_size} ranks"
    log.info("%s: global batch %d sequences, %s, %s%s, steps %d/%d", s.config_key, s.global_batch_size, split,
             s.precision, " (matmuls in TF32)" if matmuls == "tf32" else "", max_steps, s.total_steps)

    def save():
        rng = _gather_rng(env)
        if env.is_main:
            ckpt.save_checkpoint(checkpoint_dir, step, {
                "step": step, "consumed": consumed, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict() if scaler else {},
                "rng": rng, "train_time_s": train_time, "fingerprint": fingerprint, "skipped_steps": skipped,
            }, s.keep_checkpoints)
        distributed.barrier()  # no rank leaves (or exits) before the checkpoint is on disk

    window, window_steps, window_sequences, window_start = {}, 0, 0, time.perf_counter()
    vote = StopVote(env.device)
    ramp = s.batch_ramp
    loader = step_batches(task, [consumed + k * s.global_batch_size for k in range(max_steps - step)] if ramp is None
                          else [(consumed + ramp.sequences_before(k) - ramp.sequences_before(step), ramp.batch_at(k))
                                for k in range(step, max_steps)], s, env)
    model.train()
    first_step, micro_batches, evaluation = step, 0, None
    with (contextlib.closing(loader), ckpt.StopSignals() as stop,
          GpuTelemetry(run_dir / "gpu_telemetry.csv", enabled=env.local_rank == 0 and s.telemetry,  # every node's
                       merge=env.is_main),
          _scalars(run_dir / "tensorboard", step, env.is_main) as scalars, _StepSyncs(env.device) as syncs):
        # A bar on a terminal; in a log file (logs/), the periodic metrics lines alone (no carriage returns).
        progress = tqdm(total=max_steps, initial=step, desc=s.config_key, file=sys.stderr,
                        disable=not env.is_main or not sys.stderr.isatty())
        while step < max_steps:
            started = time.perf_counter()
            batches = [_to_device(batch, env.device) for batch in next(loader)]
            syncs.begin()  # from here (the batch read on the host) to the step's end
            micro_batches += len(batches)
            totals = _sum_counts(task, batches, env)
            for index, batch in enumerate(batches):
                last = index == len(batches) - 1
                sync = contextlib.nullcontext() if last or not env.distributed else ddp.no_sync()
                with sync:
                    with autocast(env.device, s.precision):
                        out = task.loss(train_model, batch, totals)
                    loss = out["loss"] * env.world_size  # DDP averages gradients over ranks; totals are global
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                for key, value in out.items():
                    window[key] = window.get(key, 0) + value.detach().float()
            grad_norm, stepped = _optimizer_step(model, optimizer, scaler, s.clip_grad_norm,
                                                 keep_grads=env.distributed)
            if stepped:
                scheduler.step()  # the schedule counts optimizer steps: a skipped one does not advance it
            else:
                skipped += 1
                window["skipped_steps"] = window.get("skipped_steps", 0) + 1
            window_sequences += s.global_batch_size if ramp is None else ramp.batch_at(step)
            consumed += s.global_batch_size if ramp is None else ramp.batch_at(step)
            step += 1
            window_steps += 1
            finite = torch.isfinite(grad_norm)  # an overflow's inf/nan norm stays out of the mean
            window["grad_norm"] = window.get("grad_norm", 0) + torch.where(finite, grad_norm, 0.0)
            window["finite_grad_norms"] = window.get("finite_grad_norms", 0) + finite.float()
            evaluation, line = None, {}
            if s.evaluate is not None and s.eval_every and step % s.eval_every == 0:
                evaluated = time.perf_counter()
                evaluation = s.evaluate(model)
                line = {**evaluation, "train_time_s": train_time + evaluated - started}
                spent = time.perf_counter() - evaluated
                started, window_start = started + spent, window_start + spent  # training time and throughput only
                if env.is_main:
                    log.info("step %d held-out %s", step, ", ".join(f"{k} {v:.4g}" for k, v in evaluation.items()))
            logged = step % s.log_every == 0 or step == max_steps or bool(line)
            if logged:
                _log_metrics(task, window, window_steps, window_sequences, time.perf_counter() - window_start, step,
                             max_steps, scheduler, scaler, s, env, metrics_path, scalars, line)
                window, window_steps, window_sequences, window_start = {}, 0, 0, time.perf_counter()
            train_time += time.perf_counter() - started
            progress.update(1)
            vote.cast(stop.received)
            boundary = logged or step % s.checkpoint_every == 0
            stop_now = vote.current() if boundary else vote.previous()
            syncs.end(boundary)
            if step % s.checkpoint_every == 0 or step == max_steps or stop_now:
                if scalars is not None:
                    scalars.flush()  # the scalars up to a checkpoint outlive a crash after it
                save()
            ckpt.fail_at_step(step)
            if stop_now:
                progress.close()
                log.warning("stopped by signal at step %d; rerun to resume", step)
                return Outcome(step, train_time, 128 + stop_now, skipped_steps=skipped)
        progress.close()
    return Outcome(step, train_time, micro_batches_per_step=micro_batches / (step - first_step) if step > first_step
                   else None, evaluation=evaluation, skipped_steps=skipped)


def _sum_counts(task: Task, batches: list, env) -> dict:
    counts = [task.count(batch) for batch in batches]
    keys = sorted(counts[0])
    values = torch.stack([sum(c[k] for c in counts).double() for k in keys])
    distributed.all_reduce_(values)
    return {k: v.clamp(min=1).float() for k, v in zip(keys, values)}  # exact in fp32 up to 2^24


def _optimizer_step(model, optimizer, scaler, clip: float | None,
                    keep_grads: bool = False) -> tuple[torch.Tensor, bool]:
    """Unscale (fp16), clip, step, zero the gradients (in place with `keep_grads`: DDP's bucket views, else None);
    returns this step's pre-clip global gradient norm (also when fp16's scaler skips the step: inf or nan then) and
    whether the optimizer stepped (False: the scaler skipped it)."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = None
    if clip:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    elif scaler is not None or not hasattr(optimizer, "last_grad_norm"):
        # LAMB's own norm is last step's when the scaler skips this one; apex FusedLAMB does not expose its norm.
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        grad_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    stepped = scaler is None
    if scaler is not None:
        # Whether the scaler stepped, without reading found_inf once more: the optimizer's own step hook (every
        # torch.optim.Optimizer, apex's included, runs it) fires only when it steps. An optimizer that skips on the
        # device itself (_step_supports_amp_scaling: torch's fused AdamW) is always called, with found_inf set during
        # its step: its verdict is read there (a host sync such an optimizer costs).
        calls = []
        hook = optimizer.register_step_post_hook(lambda opt, *_: calls.append(getattr(opt, "found_inf", None)))
        try:
            scaler.step(optimizer)
        finally:
            hook.remove()
        scaler.update()
        stepped = bool(calls) and (calls[0] is None or not calls[0].item())
    else:
        optimizer.step()
    if grad_norm is None:  # LAMB's own (None only if it never saw a gradient)
        grad_norm = optimizer.last_grad_norm if optimizer.last_grad_norm is not None else torch.tensor(float("nan"))
    # The module's zero_grad, not the optimizer's: apex FusedLAMB.zero_grad() takes no argument.
    model.zero_grad(set_to_none=not keep_grads)
    return grad_norm.detach().float().to(next(model.parameters()).device), stepped


@contextlib.contextmanager
def _scalars(directory: Path, step: int, enabled: bool):
    """A TensorBoard SummaryWriter (None off rank 0); a resumed run first purges the events past its step."""
    if not enabled:
        yield None
        return
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(directory), purge_step=step + 1 if step else None)
    try:
        yield writer
    finally:
        writer.close()


def _eta(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}"


def _log_metrics(task, window, steps, sequences, elapsed, step, max_steps, scheduler, scaler, s, env, path: Path,
                 scalars, evaluation: dict) -> None:
    skipped = window.pop("skipped_steps", 0)  # a host count, the same on every rank (the gradients are all-reduced)
    keys = sorted(window)
    values = distributed.all_reduce_(torch.stack([window[k].float() for k in keys]))
    sums = dict(zip(keys, values.tolist()))  # the window's one read of the device
    finite = sums.pop("finite_grad_norms")
    record = {"step": step, **task.metrics(sums, steps, sequences, elapsed, step), "lr": scheduler.get_last_lr()[0],
              "grad_norm": sums["grad_norm"] / finite if finite else None,  # None: every step skipped
              **({"skipped_steps": skipped} if scaler is not None else {}),
              "seq_per_s": sequences / max(elapsed, 1e-9),
              **({"window_sequences": sequences} if s.batch_ramp is not None else {}),  # a ramp's steps differ
              **evaluation}
    if env.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if key != "step" and value is not None:
                scalars.add_scalar(key, value, step)
        log.info("step %d/%d loss %.4f lr %.3g %.0f seq/s ETA %s%s", step, max_steps,
                 record.get("loss", float("nan")), record["lr"], record["seq_per_s"],
                 _eta((max_steps - step) * elapsed / steps),
                 f"; {skipped} step(s) skipped by fp16's loss scaler (inf/nan gradients)" if skipped else "")
