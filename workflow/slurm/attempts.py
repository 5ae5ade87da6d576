"""Retries by cause for a Slurm training job, inside its own allocation, with every attempt's log kept.

The launcher (`python -m workflow.slurm.launch --run-dir DIR --`) runs the ranks with srun and then decides here from
how they ended, where the cause is still known (Snakemake only sees "failed"):
    exit 0                               done
    128+SIGUSR1 (Slurm's time-limit      `scontrol requeue` this job (same job id, fresh time limit) when the newest
    warning: the trainers checkpointed)  checkpoint is newer than at the start of the run; else stop: no progress
    any other failure                    requeue once per job; a second failure stops
    scancel                              nothing runs here: the job is gone, the profile gives it no retry
    node failure (job no longer RUNNING) nothing: Slurm requeues the job itself (`slurm-requeue: true`)
The next run resumes from the newest checkpoint either way.

Every run hard-links the rule's log (its stderr) to `<log dir>/attempts/<log stem>.job<id>.run<n>.log` before
starting, so the next run's fresh `2> {log}` cannot erase it, and appends one JSON line per run to
`<log dir>/attempts/<log stem>.history.jsonl` (job, run, checkpoint step at start, exit status, decision).
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

TIME_LIMIT_EXIT = 128 + signal.SIGUSR1  # the trainers' exit status after checkpointing on SIGUSR1
# A trainer's exits after a stop signal (SIGUSR1, SIGTERM: workflow/train/checkpoint.py StopSignals): every rank
# wrote the checkpoint and met the others at a barrier first, so the step must not be cut short.
STOP_EXITS = (TIME_LIMIT_EXIT, 128 + signal.SIGTERM)
REQUEUE_WAIT_S = 600  # how long a requeued run waits for Slurm to end it


@dataclass(frozen=True)
class Decision:
    requeue: bool
    why: str


def decide(exit_status: int, start_step: int | None, end_step: int | None, earlier_failures: int,
           job_state: str = "RUNNING") -> Decision:
    """What to do with a run of this job that ended with `exit_status` (the highest rank exit status), the job
    being in `job_state` (RUNNING while this run is its own; else Slurm is ending or requeueing it)."""
    if job_state != "RUNNING":
        return Decision(False, f"interrupted by Slurm (job state {job_state}): Slurm requeues or ends it")
    if exit_status == 0:
        return Decision(False, "completed")
    if exit_status == TIME_LIMIT_EXIT:
        if end_step is not None and (start_step is None or end_step > start_step):
            return Decision(True, f"stopped by the time-limit signal at checkpoint step {end_step}: requeued")
        return Decision(False, f"stopped by the time-limit signal with no checkpoint newer than step {start_step}: "
                               "not requeued (raise `runtime` in the profile)")
    if earlier_failures == 0:
        return Decision(True, f"failed with exit status {exit_status}: requeued once")
    return Decision(False, f"failed with exit status {exit_status} again: not requeued")


def newest_step(run_dir: str | Path | None) -> int | None:
    """The step of the newest checkpoint of the run directory, if it has one (None without a run directory)."""
    from workflow.train.checkpoint import list_checkpoints

    if run_dir is None:
        return None
    found = list_checkpoints(Path(run_dir) / "checkpoints")
    return int(found[-1].stem.split("_")[1]) if found else None


def job_state(job_id: str) -> str:
    """The job's state from slurmctld (RUNNING, or e.g. NODE_FAIL / REQUEUED / PENDING when Slurm took over)."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    except OSError:  # scontrol cannot start here (e.g. not on a container's PATH)
        out = ""
    match = re.search(r"\bJobState=(\S+)", out)
    return match.group(1) if match else "RUNNING"  # no answer: judge by the exit status alone


def _wait_for_slurm(job_id: str, seconds: float) -> None:
    """Wait (quietly) while Slurm ends this run of a requeued job; return early once it no longer runs as ours."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and job_state(job_id) == "RUNNING":
        time.sleep(2)


def rule_log() -> Path | None:
    """The file our stderr goes to (the rule's `2> {log}`), if it is a regular file."""
    try:
        target = Path(os.readlink("/proc/self/fd/2"))
    except OSError:
        return None
    return target if target.is_file() else None


def keep_log(log_file: Path, job_id: str, run: int) -> Path:
    attempts = log_file.parent / "attempts"
    attempts.mkdir(exist_ok=True)
    kept = attempts / f"{log_file.stem}.job{job_id}.run{run}.log"
    kept.unlink(missing_ok=True)
    os.link(log_file, kept)  # the same file: what this run writes stays readable after the next run's `2> {log}`
    return kept


def history(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_attempt(job, command: list[str], rendezvous: dict, run_dir: str | Path | None = None) -> None:
    """Run `command` (srun ...) in this Slurm job, then exit 0 or requeue the job or exit with its status; progress
    is judged by the checkpoints of `run_dir`."""
    log_file = rule_log()
    record_path = None
    earlier_failures = 0
    if log_file is not None:
        try:
            keep_log(log_file, job.job_id, job.restarts)
        except OSError as error:  # a filesystem without hard links: the run goes on, its log is not kept
            log.warning("cannot keep %s under %s/attempts: %s", log_file, log_file.parent, error)
        record_path = log_file.parent / "attempts" / f"{log_file.stem}.history.jsonl"
        earlier_failures = sum(1 for r in history(record_path) if r["job"] == job.job_id and r["cause"] == "failure")
    start_step = newest_step(run_dir)
    log.info("Slurm job %s run %s (rule %s), %s rank(s) on %s node(s), newest checkpoint step %s: %s", job.job_id,
             job.restarts, job.rule, job.tasks, job.nodes, start_step, " ".join(command))
    status = subprocess.run(command, env={**os.environ, **rendezvous}).returncode
    status = 128 - status if status < 0 else status
    end_step = newest_step(run_dir)
    state = job_state(job.job_id)
    decision = decide(status, start_step, end_step, earlier_failures, state)
    cause = ("slurm" if state != "RUNNING" else "ok" if status == 0 else "time-limit" if status == TIME_LIMIT_EXIT
             else "failure")
    if record_path is not None:
        with record_path.open("a") as out:
            out.write(json.dumps({"job": job.job_id, "run": job.restarts, "run_id": job.name, "start_step": start_step,
                                  "end_step": end_step, "exit": status, "cause": cause,
                                  "requeue": decision.requeue}) + "\n")
    log.info("Slurm job %s run %s %s", job.job_id, job.restarts, decision.why)
    if decision.requeue:
        try:
            requeue = subprocess.run(["scontrol", "requeue", job.job_id], capture_output=True, text=True)
            failure = requeue.stderr.strip() if requeue.returncode != 0 else None
        except OSError as error:
            failure = str(error)
        if failure is not None:
            print(f"error: `scontrol requeue {job.job_id}` failed ({failure}): is `slurm-requeue: true` in the "
                  "profile? Run snakemake again to resume", file=sys.stderr, flush=True)
        else:  # Slurm ends this run now; exiting first would race the requeue with a job failure
            _wait_for_slurm(job.job_id, REQUEUE_WAIT_S)
    sys.exit(status if status < 256 else 1)
