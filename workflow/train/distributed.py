"""One code path for 1 process, torchrun and srun: rank/world/master from the environment.

API:
    env = setup(device="auto")   -> DistEnv(rank, world_size, local_rank, device, backend, is_main)
        torchrun's RANK/WORLD_SIZE/LOCAL_RANK, or Slurm's SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID with
        MASTER_ADDR = first host of `scontrol show hostnames $SLURM_NODELIST` and MASTER_PORT derived from the job id
        (both only when not already set). world_size > 1 initialises torch.distributed: nccl on CUDA, gloo on CPU.
    cleanup()                    destroy the process group (if any)
    all_reduce_(tensor, op="sum") in place; a no-op in a 1-process run
    broadcast_object(obj, src=0) the object from rank `src` (identity in a 1-process run)
    barrier()                    wait for every rank (a no-op in a 1-process run)
    local_world_size()           ranks on this node (torchrun's LOCAL_WORLD_SIZE, Slurm's tasks per node), else 1
    `python -m workflow.train.distributed -- CMD ...`   run CMD once per Slurm task (via srun) when the batch step of a
        Slurm job holds SLURM_NTASKS > 1; without Slurm once per visible GPU (torchrun; SNAKEBERT_LOCAL_RANKS
        overrides the count, e.g. 2 CPU ranks in tests); else directly (1 process, or already inside torchrun/srun).
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from workflow.cli import UserError

log = logging.getLogger(__name__)


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _int_env(environ, name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer") from None


def _slurm_master_addr(environ) -> str:
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_NODELIST") or environ.get(
        "SLURM_JOB_NODELIST")
    if not nodelist:
        return "127.0.0.1"
    try:
        hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True,
                               text=True).stdout.split()
    except (OSError, subprocess.CalledProcessError) as error:
        raise UserError(f"SLURM_NODELIST={nodelist!r}: `scontrol show hostnames` failed: {error}") from None
    return hosts[0] if hosts else "127.0.0.1"


def read_environment(environ=os.environ) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's or Slurm's variables; (0, 1, 0) when neither is set.

    Slurm's are used only inside a job step (SLURM_STEP_ID set, i.e. under srun): a batch script also carries
    SLURM_PROCID=0 and SLURM_NTASKS=N, yet is one process. Sets MASTER_ADDR/MASTER_PORT when missing.
    """
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return _int_env(environ, "RANK"), _int_env(environ, "WORLD_SIZE"), int(environ.get("LOCAL_RANK", "0"))
    if "SLURM_STEP_ID" in environ and "SLURM_PROCID" in environ:
        world_key = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
        rank, world = _int_env(environ, "SLURM_PROCID"), _int_env(environ, world_key)
        local = int(environ.get("SLURM_LOCALID", "0"))
        if world > 1:
            environ.setdefault("MASTER_ADDR", _slurm_master_addr(environ))
            job = int(environ.get("SLURM_JOB_ID", "0"))
            environ.setdefault("MASTER_PORT", str(15000 + job % 20000))
        return rank, world, local
    return 0, 1, 0


def setup(device: str = "auto", timeout_s: int = 1800) -> DistEnv:
    """Read the environment, pick the device, and join the process group when world_size > 1."""
    rank, world, local = read_environment()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch_device = torch.device("cuda", local % max(torch.cuda.device_count(), 1))
        torch.cuda.set_device(torch_device)
    else:
        torch_device = torch.device(device)
    backend = None
    if world > 1:
        backend = "nccl" if torch_device.type == "cuda" else "gloo"
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        if not dist.is_initialized():
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s),
                                    device_id=torch_device if torch_device.type == "cuda" else None)
        log.info("rank %d/%d (local %d) on %s, backend %s, master %s:%s", rank, world, local, torch_device,
                 backend, os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    return DistEnv(rank, world, local, torch_device, backend)


def cleanup() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return tensor


def broadcast_object(obj, src: int = 0):
    if dist.is_available() and dist.is_initialized():
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]
    return obj


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def local_world_size(environ=os.environ) -> int:
    if "LOCAL_WORLD_SIZE" in environ:
        return int(environ["LOCAL_WORLD_SIZE"])
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if "SLURM_STEP_ID" in environ and per_node:  # "2(x3)" or "4,2": the first node's count
        return int(re.match(r"\d+", per_node).group())
    return 1


def _job_layout(environ) -> tuple[int, int]:
    """(tasks, nodes) of the Slurm job: from the environment, else from `scontrol show job` (the Snakemake Slurm
    plugin runs a job's command with every SLURM_* variable except SLURM_JOB_ID removed)."""
    if "SLURM_NTASKS" in environ:
        nodes = environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or "1"
        return int(environ["SLURM_NTASKS"] or "1"), int(nodes)
    out = subprocess.run(["scontrol", "show", "job", environ["SLURM_JOB_ID"]], check=True, capture_output=True,
                         text=True).stdout
    fields = dict(re.findall(r"(\w+)=(\S+)", out))
    return int(fields["NumTasks"]), int(fields["NumNodes"])


def launch_command(command: list[str], environ=os.environ) -> list[str]:
    """The command line that runs `command` on every task of the Slurm job (srun), or `command` itself.

    In a Slurm batch step it always uses srun, even for one task: the time-limit warning (--signal) reaches steps.
    """
    inside_step = "SLURM_STEP_ID" in environ or "RANK" in environ  # already one process per task
    if ("SLURM_JOB_ID" in environ or "SLURM_NTASKS" in environ) and not inside_step:
        tasks, nodes = _job_layout(environ)
        spread = [f"--nodes={nodes}", f"--ntasks-per-node={tasks // nodes}"] if nodes > 1 else []
        return ["srun", f"--ntasks={tasks}", *spread, "--kill-on-bad-exit=1", *command]
    return command if inside_step else local_command(command, environ)


def local_command(command: list[str], environ=os.environ) -> list[str]:
    """Without Slurm: one rank per visible GPU (SNAKEBERT_LOCAL_RANKS overrides) through torchrun, else `command`."""
    ranks = int(environ.get("SNAKEBERT_LOCAL_RANKS") or torch.cuda.device_count() or 1)
    if ranks <= 1:
        return command
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "--no-python",
            *command]


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise UserError("usage: python -m workflow.train.distributed -- COMMAND [ARGS...]")
    command = launch_command(argv)
    log.info("launching: %s", " ".join(command))
    os.execvp(command[0], command)


if __name__ == "__main__":
    from workflow.cli import run

    run(main)
