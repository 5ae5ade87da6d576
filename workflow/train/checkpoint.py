"""Resumable training state: atomic checkpoints in a run directory, newest-valid loading, stop signals.

API (generic: pretraining and SQuAD fine-tuning both use it):
    save_checkpoint(directory, step, state, keep) -> Path
        torch.save(state) to `directory/step_{step:08d}.pt` atomically (temp + fsync + rename) with a sha256 sidecar,
        then delete all but the newest `keep` of this run (a settings change never deletes: the engine refuses). `state` must hold only tensors and plain Python values.
    load_latest_checkpoint(directory) -> (state, path) | (None, None)
        newest checkpoint that loads (weights_only=True, sha256 matches); a corrupt one -> warning, next older.
    load_checkpoint(path) -> state      one checkpoint, verified (raises when unusable)
    flat_tensors(state) -> {path: tensor}   every tensor of a nested state (to compare a save with its load)
    rng_state(device) -> dict / set_rng_state(dict, device)   python, numpy, torch CPU and the CUDA generator of
                    `device` (this rank's own: a resume may see fewer GPUs than the run that saved it)
    StopSignals()   context manager: SIGTERM/SIGUSR1 set `.received` (the signal number) instead of killing us;
                    the engine checks it after each step, checkpoints, and returns 128 + signal as the exit code.
    fail_at_step(step)   fault injection: SIGKILL ourselves right after `step` when SNAKEBERT_FAIL_AT_STEP == step.
"""
from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import signal
from pathlib import Path

import numpy as np
import torch

from workflow.atomic import atomic_path
from workflow.train import accelerator

log = logging.getLogger(__name__)
_NAME = re.compile(r"^step_(\d{8})\.pt$")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Checkpoints in `directory`, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _NAME.match(p.name))


def save_checkpoint(directory: str | os.PathLike, step: int, state: dict, keep: int) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step_{step:08d}.pt"
    with atomic_path(final) as temporary:
        torch.save(state, temporary)
        _fsync(temporary)
        digest = file_sha256(temporary)
    with atomic_path(final.with_name(final.name + ".sha256")) as temporary:
        temporary.write_text(digest + "\n")
    for old in list_checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
        old.with_name(old.name + ".sha256").unlink(missing_ok=True)
    log.info("checkpoint %s", final)
    return final


def load_checkpoint(path: Path, map_location="cpu") -> dict:
    """One checkpoint, verified against its sha256 sidecar; ValueError/OSError when unusable."""
    sidecar = path.with_name(path.name + ".sha256")
    if not sidecar.is_file():
        raise ValueError("no sha256 sidecar (the write did not finish)")
    if sidecar.read_text().strip() != file_sha256(path):
        raise ValueError("sha256 mismatch")
    state = torch.load(path, map_location=map_location, weights_only=True)
    if not isinstance(state, dict):
        raise ValueError("not a checkpoint dictionary")
    return state


def load_latest_checkpoint(directory: str | os.PathLike, map_location="cpu") -> tuple[dict | None, Path | None]:
    for path in reversed(list_checkpoints(directory)):
        try:
            return load_checkpoint(path, map_location), path
        except Exception as error:  # any failure to read means: not usable, try the previous one
            log.warning("checkpoint %s is unreadable (%s); falling back to the previous one", path, error)
    return None, None


def flat_tensors(state, prefix: str = "") -> dict:
    """Every tensor of a nested state (dicts, lists) by its path, e.g. "optimizer.state.3.exp_avg"."""
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else ()
    return {path: tensor for key, value in items for path, tensor in flat_tensors(value, f"{prefix}{key}.").items()}


def rng_state(device: torch.device = torch.device("cpu")) -> dict:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    cuda = accelerator.rng_state(device)
    if cuda is not None:
        state["cuda"] = cuda
    return state


def set_rng_state(state: dict, device: torch.device = torch.device("cpu")) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    accelerator.set_rng_state(state.get("cuda"), device)


class StopSignals:
    """Turn SIGTERM/SIGUSR1 (Slurm's time-limit warning) into a flag the training loop polls; `then` says in the log
    what the process does about it (after the last step: finish the evaluation and export, whose outputs are
    written atomically, rather than die half way with the default action)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, then: str = "will checkpoint after the current step and exit"):
        self.received: int | None = None
        self.then = then
        self._previous = {}

    def _handle(self, signum, frame):
        log.warning("received %s: %s", signal.Signals(signum).name, self.then)
        self.received = signum

    def __enter__(self):
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


def signal_at(stage: str) -> None:
    """Simulate Slurm's stop signal arriving at `stage` for tests: SNAKEBERT_SIGNAL_AT=<stage> sends SIGTERM."""
    if os.environ.get("SNAKEBERT_SIGNAL_AT") == stage:
        os.kill(os.getpid(), signal.SIGTERM)


def fail_at_step(step: int) -> None:
    """Simulate a hard crash (node failure, OOM kill) for tests: SNAKEBERT_FAIL_AT_STEP=N kills after step N."""
    value = os.environ.get("SNAKEBERT_FAIL_AT_STEP")
    if value and int(value) == step:
        log.warning("SNAKEBERT_FAIL_AT_STEP=%s: killing this process with SIGKILL", value)
        os.kill(os.getpid(), signal.SIGKILL)
