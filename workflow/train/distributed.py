"""What a rank needs to join its job: rank/world/master from the environment (1 process, torchrun or srun),
the process group, and the collectives the trainers use.

API:
    env = setup(device="auto")   -> DistEnv(rank, world_size, local_rank, device, backend, is_main)
        torchrun's RANK/WORLD_SIZE/LOCAL_RANK, or Slurm's SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID with
        MASTER_ADDR/MASTER_PORT as the launcher (workflow/slurm/launch.py) sets them (the batch host, a port the OS
        found free), else the first host of $SLURM_NODELIST and a port derived from the job id. world_size > 1
        initialises torch.distributed: nccl on CUDA, gloo on CPU.
    cleanup()                    destroy the process group (if any)
    all_reduce_(tensor, op="sum") in place; a no-op in a 1-process run
    broadcast_object(obj, src=0) the object from rank `src` (identity in a 1-process run)
    barrier(group=None)          wait for every rank (a no-op in a 1-process run)
    patient_group(), patient_barrier(group)   a wait for every rank with no timeout (rank 0's export)
    local_world_size()           ranks on this node (torchrun's LOCAL_WORLD_SIZE, Slurm's tasks per node), else 1
"""
from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from workflow.cli import UserError
from workflow.train import accelerator

log = logging.getLogger(__name__)
# A patient barrier's timeout: longer than any job's time limit, so only a rank's death ends its wait.
PATIENT_TIMEOUT = timedelta(days=365)


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


def first_host(nodelist: str) -> str | None:
    """The first host of a Slurm node list (`node[01-04]` -> node01), as `scontrol show hostnames` expands it."""
    try:
        hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True,
                               text=True).stdout.split()
    except (OSError, subprocess.CalledProcessError) as error:
        raise UserError(f"SLURM_NODELIST={nodelist!r}: `scontrol show hostnames` failed: {error}") from None
    return hosts[0] if hosts else None


def _slurm_master_addr(environ) -> str:
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_NODELIST") or environ.get(
        "SLURM_JOB_NODELIST")
    if not nodelist:
        return "127.0.0.1"
    return first_host(nodelist) or "127.0.0.1"


def _address_of(host: str) -> str:
    """The address `host` resolves to here (what gloo and NCCL connect to), or why it does not resolve."""
    try:
        return socket.gethostbyname(host)
    except OSError as error:
        return f"unresolved: {error}"


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
        device = "cuda" if accelerator.available() else "cpu"
    if device == "cuda":
        torch_device = torch.device("cuda", local % max(accelerator.device_count(), 1))
        accelerator.set_device(torch_device)
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
        log.info("rank %d/%d (local %d) on host %s, %s, backend %s, master %s (%s):%s", rank, world, local,
                 socket.gethostname(), torch_device, backend, os.environ["MASTER_ADDR"],
                 _address_of(os.environ["MASTER_ADDR"]), os.environ["MASTER_PORT"])
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


def barrier(group=None) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def patient_group():
    """A gloo group of every rank whose collectives wait PATIENT_TIMEOUT, for patient_barrier (None in a 1-process
    run). Every rank must call it: creating a group is a collective, within the process group's own timeout. The
    timeout is the group's, as every torch takes it: barrier's own `timeout` argument came in 2026 (pytorch#174974),
    and an older torch (2.6 tried) refuses it at the first barrier of every multi-rank job."""
    if dist.is_available() and dist.is_initialized():
        return dist.new_group(backend="gloo", timeout=PATIENT_TIMEOUT)
    return None


def patient_barrier(group) -> None:
    """Wait for every rank of `group` (patient_group) as long as it takes: the other ranks wait here for work of rank
    0 that has no bound, such as the export to slow storage. A rank that dies still ends the wait: its launcher ends
    the step (workflow/slurm/launch.py guard_rank; torchrun ends its other workers), and gloo fails on a closed
    peer."""
    barrier(group)


def local_world_size(environ=os.environ) -> int:
    if "LOCAL_WORLD_SIZE" in environ:
        return int(environ["LOCAL_WORLD_SIZE"])
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if "SLURM_STEP_ID" in environ and per_node:  # "2(x3)" or "4,2": the first node's count
        return int(re.match(r"\d+", per_node).group())
    return 1
