"""One writer per run directory: a training job records itself in `<run dir>/owner.json` before its ranks start.
Two jobs would interleave their steps and delete each other's checkpoints: a second Slurm job on the directory
(a rerun's, after the Snakemake head that submitted the first died) takes it over: it cancels the first, whose
trainers write a checkpoint on Slurm's SIGTERM, waits until it is gone, and resumes from there. A job without Slurm
refuses while the owner lives.

An owner is a Slurm job (alive while Slurm lists it as pending, running, requeued, suspended or completing: a
requeued run of the same job is the same owner) or, without Slurm, a process (host, pid and its start time, so a
recycled pid is not taken for it; alive while that process is). A dead owner's directory is taken over, with a
log line; a Slurm owner whose state squeue cannot tell never is. Claims are atomic (a hard link that fails if the
file exists), so of two jobs starting at once one wins.

    claim(run_dir, me=this_owner())   raises UserError naming the live owner; returns the owner taken over
"""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import time
from pathlib import Path

from workflow.cli import UserError

log = logging.getLogger(__name__)

OWNER_FILE = "owner.json"
TAKEOVER_WAIT_S = 600  # for a cancelled job to end: Slurm's KillWait (30 s by default) and its epilog
SQUEUE_ATTEMPTS, SQUEUE_RETRY_S = 3, 5.0  # a controller that does not answer is asked again, then refused
SLURM_ALIVE = {"PENDING", "CONFIGURING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING",
               "SUSPENDED", "COMPLETING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"}


def _process_start(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (field 22 of /proc/PID/stat), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[19]


def this_owner(environ=os.environ) -> dict:
    """This job: its Slurm job id inside Slurm, else this host and process."""
    if environ.get("SLURM_JOB_ID"):
        return {"slurm_job": environ["SLURM_JOB_ID"], "host": socket.gethostname(), "pid": os.getpid()}
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _process_start(os.getpid())}


class SlurmUnanswered(Exception):
    """squeue could not tell a job's state: not installed here, or the controller did not answer."""


def slurm_job_state(job_id: str) -> str | None:
    """The job's state as squeue reports it, None when Slurm no longer lists it. Raises SlurmUnanswered when
    squeue cannot tell after SQUEUE_ATTEMPTS tries: a busy controller's timeout is no proof the job is gone."""
    for attempt in range(SQUEUE_ATTEMPTS):
        try:
            out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
        except OSError as error:  # e.g. a run directory from the cluster, rerun on a machine without Slurm
            raise SlurmUnanswered(f"`squeue` cannot run here ({error})") from None
        states = out.stdout.split()
        if out.returncode == 0:
            return states[0] if states else None
        if "Invalid job id specified" in out.stderr:  # squeue's answer for one job it no longer lists
            return None
        if attempt + 1 < SQUEUE_ATTEMPTS:
            time.sleep(SQUEUE_RETRY_S)
    raise SlurmUnanswered(f"`squeue -j {job_id}` failed {SQUEUE_ATTEMPTS} times ({out.stderr.strip()})")


def is_alive(owner: dict) -> bool:
    if owner.get("slurm_job"):
        return slurm_job_state(owner["slurm_job"]) in SLURM_ALIVE
    if owner.get("host") != socket.gethostname():
        # another machine without Slurm: nothing here can tell; refusing is the safe side
        return True
    return _process_start(int(owner["pid"])) == owner.get("start")


def describe(owner: dict) -> str:
    if owner.get("slurm_job"):
        return f"Slurm job {owner['slurm_job']} (started on {owner.get('host')})"
    return f"process {owner.get('pid')} on {owner.get('host')}"


def same_owner(a: dict, b: dict) -> bool:
    if a.get("slurm_job") or b.get("slurm_job"):
        return a.get("slurm_job") == b.get("slurm_job")
    return (a.get("host"), a.get("pid"), a.get("start")) == (b.get("host"), b.get("pid"), b.get("start"))


def claim(run_dir: str | Path, me: dict | None = None) -> dict | None:
    """Record `me` as the run directory's owner; UserError if another owner is alive. Returns the stale owner that
    was taken over, if any."""
    me = me or this_owner()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / OWNER_FILE
    mine = run_dir / f".{OWNER_FILE}.{os.getpid()}"
    mine.write_text(json.dumps(me) + "\n")
    try:
        try:
            os.link(mine, path)  # atomic: fails if an owner is recorded
            return None
        except FileExistsError:
            pass
        try:
            current = json.loads(path.read_text())
        except (OSError, ValueError):
            current = {}
        if same_owner(current, me):
            return None  # e.g. Slurm requeued this very job
        try:
            alive = bool(current) and is_alive(current)
        except SlurmUnanswered as error:
            raise UserError(f"{run_dir}: in use by {describe(current)}, and whether it is still alive cannot be told: "
                            f"{error}. Rerun when Slurm answers; if you know it is gone, delete {path} (nothing was "
                            "changed)") from None
        if alive and current.get("slurm_job") and me.get("slurm_job"):
            cancel(current, run_dir)
        elif alive:
            raise UserError(f"{run_dir}: in use by {describe(current)}, which is still alive; two jobs on one run "
                            f"directory would overwrite each other's checkpoints. Wait for it or cancel it, then "
                            f"rerun; if you know it is gone, delete {path} (nothing was changed)")
        os.replace(mine, path)
        if not same_owner(json.loads(path.read_text()), me):  # another job took it over at the same moment
            raise UserError(f"{run_dir}: taken over by another job at the same moment; rerun (nothing was changed)")
        log.warning("%s: its owner %s is gone; taking the run directory over", run_dir,
                    describe(current) if current else "(unreadable owner.json)")
        return current
    finally:
        mine.unlink(missing_ok=True)


def cancel(owner: dict, run_dir: Path, wait_s: float = TAKEOVER_WAIT_S) -> None:
    """scancel a live Slurm owner (its trainers checkpoint on the SIGTERM) and wait until Slurm lists it no more."""
    log.warning("%s: in use by %s, started by an earlier Snakemake run; cancelling it (its trainers write a "
                "checkpoint) to take the run directory over", run_dir, describe(owner))
    subprocess.run(["scancel", owner["slurm_job"]], capture_output=True, text=True)
    deadline = time.monotonic() + wait_s
    while _alive_or_unanswered(owner):
        if time.monotonic() > deadline:
            raise UserError(f"{run_dir}: {describe(owner)} is still alive (or Slurm does not answer) {wait_s:.0f} s "
                            "after `scancel`; cancel it, then rerun (nothing was changed)")
        time.sleep(2)


def _alive_or_unanswered(owner: dict) -> bool:
    try:
        return is_alive(owner)
    except SlurmUnanswered:
        return True


def release(run_dir: str | Path, me: dict | None = None) -> None:
    """Remove the owner record if it is `me` (a finished job)."""
    path = Path(run_dir) / OWNER_FILE
    try:
        if same_owner(json.loads(path.read_text()), me or this_owner()):
            path.unlink()
    except (OSError, ValueError):
        pass
