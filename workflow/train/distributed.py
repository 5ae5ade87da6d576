"""One code path for 1 process, torchrun and srun: rank/world/master from the environment.

API:
    env = setup(device="auto")   -> DistEnv(rank, world_size, local_rank, device, backend, is_main)
        torchrun's RANK/WORLD_SIZE/LOCAL_RANK, or Slurm's SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID with
        MASTER_ADDR/MASTER_PORT as the launcher below set them (the batch host, a port the OS found free), else the
        first host of `scontrol show hostnames $SLURM_NODELIST` and a port derived from the job id. world_size > 1 initialises torch.distributed: nccl on CUDA, gloo on CPU.
    cleanup()                    destroy the process group (if any)
    all_reduce_(tensor, op="sum") in place; a no-op in a 1-process run
    broadcast_object(obj, src=0) the object from rank `src` (identity in a 1-process run)
    barrier()                    wait for every rank (a no-op in a 1-process run)
    local_world_size()           ranks on this node (torchrun's LOCAL_WORLD_SIZE, Slurm's tasks per node), else 1
    `python -m workflow.train.distributed -- CMD ...`   in the batch step of a Slurm job: check one rank per allocated
        GPU (else one `error:` line naming the profile keys), run CMD once per task with srun (own GPU, own share of
        cores, a rendezvous port the OS found free), then requeue or stop by cause (workflow/slurm_attempts.py).
        Inside a step or torchrun: the same GPU check, then CMD directly. Without Slurm: CMD once per visible GPU
        through torchrun (SNAKEBERT_LOCAL_RANKS overrides the count, e.g. 2 CPU ranks in tests).
"""
from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from workflow import slurm_attempts
from workflow.cli import UserError

log = logging.getLogger(__name__)

RANK_EXIT_WAIT_S = 300  # how long srun lets the other ranks finish (rank 0: its checkpoint) after one has exited


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


@dataclass(frozen=True)
class SlurmJob:
    """The allocation a launcher runs in, from `scontrol show job -o` (the Snakemake Slurm plugin runs a job's
    command with every SLURM_* variable except SLURM_JOB_ID removed, so the environment cannot tell)."""
    job_id: str
    name: str        # the Snakemake run's id: every job of one `snakemake` invocation carries it
    rule: str        # from the plugin's --comment rule_<rule>[_wildcards_...]
    nodes: int
    tasks: int
    cpus: int        # in the whole allocation
    gpus_per_node: int
    restarts: int    # Slurm requeues (node failure, our own requeue) keep the job id and count here
    batch_host: str

    @classmethod
    def parse(cls, text: str) -> "SlurmJob":
        fields = dict(re.findall(r"(\S+?)=(\S*)", text))
        per_node = re.search(r"gres[:/]gpu(?::[^:,=\s]+)?[:=](\d+)", fields.get("TresPerNode", ""))
        total = re.search(r"gres/gpu=(\d+)", fields.get("TRES", "") or fields.get("AllocTRES", ""))
        nodes = int(fields["NumNodes"].split("-")[0])
        gpus = int(per_node.group(1)) if per_node else (int(total.group(1)) // nodes if total else 0)
        return cls(job_id=fields["JobId"], name=fields.get("JobName", ""),
                   rule=fields.get("Comment", "").removeprefix("rule_").split("_wildcards_")[0],
                   nodes=nodes, tasks=int(fields["NumTasks"]), cpus=int(fields["NumCPUs"]), gpus_per_node=gpus,
                   restarts=int(fields.get("Restarts", "0")), batch_host=fields.get("BatchHost", ""))

    @classmethod
    def query(cls, job_id: str) -> "SlurmJob":
        try:
            out = subprocess.run(["scontrol", "show", "job", "-o", job_id], check=True, capture_output=True,
                                 text=True).stdout
        except (OSError, subprocess.CalledProcessError) as error:
            raise UserError(f"SLURM_JOB_ID={job_id}: `scontrol show job` failed: {error}") from None
        return cls.parse(out)


def check_one_rank_per_gpu(job: SlurmJob, ranks: int) -> None:
    """A GPU job must run one rank per allocated GPU: never train silently on fewer (or share a GPU)."""
    gpus = job.gpus_per_node * job.nodes
    if gpus and ranks != gpus:
        rule = job.rule or "<rule>"
        raise UserError(
            f"Slurm job {job.job_id} (rule {rule}) runs {ranks} rank(s) on {gpus} GPU(s) ({job.nodes} node(s) x "
            f"{job.gpus_per_node}): in the profile's set-resources for {rule}, `tasks_per_node` must equal the GPUs "
            f"per node in `gres` and `mpi` must be \"srun\" (the plugin then leaves the launch to us)")


def srun_command(job: SlurmJob, command: list[str]) -> list[str]:
    """srun with one task per GPU (or the job's tasks on a CPU job), each with its own GPU and core share."""
    per_node, uneven = divmod(job.tasks, job.nodes)
    if uneven:
        raise UserError(f"Slurm job {job.job_id} (rule {job.rule}) has {job.tasks} tasks on {job.nodes} nodes: "
                        "set `tasks_per_node` in the profile, not `tasks`, so every node runs as many ranks")
    cpus_per_task = max(1, job.cpus // job.nodes // per_node)
    gpu = ["--gpus-per-task=1"] if job.gpus_per_node else []
    # Not --kill-on-bad-exit: after the time-limit signal the other ranks exit (138) while rank 0 still writes the
    # checkpoint. --wait gives the last ranks that long after the first exits, then ends ranks hung on a dead peer.
    return ["srun", f"--ntasks={job.tasks}", f"--nodes={job.nodes}", f"--ntasks-per-node={per_node}",
            f"--cpus-per-task={cpus_per_task}", *gpu, "--kill-on-bad-exit=0", f"--wait={RANK_EXIT_WAIT_S}", *command]


def free_port() -> int:
    """A TCP port free on this host now: the OS picks it, so two jobs sharing a node cannot pick the same one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


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
    job_id = os.environ.get("SLURM_JOB_ID")
    if "RANK" in os.environ:  # torchrun's ranks
        os.execvp(argv[0], argv)
    if not job_id:  # no Slurm: one rank per visible GPU
        command = local_command(argv)
        log.info("launching: %s", " ".join(command))
        os.execvp(command[0], command)
    job = SlurmJob.query(job_id)
    if "SLURM_STEP_ID" in os.environ:  # already a step: the plugin wrapped us in `srun -n1`, or a user's srun
        ranks = os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("SLURM_NTASKS", "1")
        check_one_rank_per_gpu(job, int(ranks))
        os.execvp(argv[0], argv)
    check_one_rank_per_gpu(job, job.tasks)
    rendezvous = {"MASTER_ADDR": job.batch_host or socket.gethostname(), "MASTER_PORT": str(free_port())}
    slurm_attempts.run_attempt(job, srun_command(job, argv), rendezvous)


if __name__ == "__main__":
    from workflow.cli import run

    run(main)
