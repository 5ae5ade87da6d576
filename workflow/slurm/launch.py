"""The launcher of a training job: `python -m workflow.slurm.launch [--run-dir DIR] -- CMD ...`.

In the batch step of a Slurm job: check one rank per allocated GPU (else one `error:` line naming the profile keys),
run CMD once per task with srun (own GPU, own share of cores, a rendezvous port the OS found free on the first
node), then requeue or stop by cause (workflow/slurm/attempts.py; `--run-dir`: the run's checkpoints, by which it
judges progress, and which it claims first: one job per run directory, workflow/slurm/owner.py). Each task runs
`launch --rank -- CMD` (guard_rank): a rank that dies by a signal or an error ends the whole step at once. Inside a
step or torchrun: the same GPU check, then CMD directly. Without Slurm: CMD once per visible GPU through torchrun
(SNAKEBERT_LOCAL_RANKS overrides the count, e.g. 2 CPU ranks in tests).
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass

from workflow.cli import UserError
from workflow.slurm import attempts, owner

log = logging.getLogger(__name__)

# How long srun lets the other ranks finish after one has exited (the trainers leave together: rank 0's export is
# waited for); SNAKEBERT_RANK_EXIT_WAIT_S overrides it for tests.
RANK_EXIT_WAIT_S = 300


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
    """srun with `tasks_per_node` tasks on every node, each with its share of the node's cores. GPUs: every task
    sees all of its node's GPUs and trains on the one of its local rank (workflow/train/distributed.py), so NCCL
    keeps peer-to-peer (NVLink, CUDA IPC) between the ranks of a node. (`--gpus-per-task=1` would give each task a
    cgroup with its one GPU where ConstrainDevices=yes; `--gres-flags=allow-task-sharing` lifts that only in Slurm
    releases after 22.05. A step is allocated all of the job's GRES by default, in every release.)"""
    per_node, uneven = divmod(job.tasks, job.nodes)
    if uneven:
        raise UserError(f"Slurm job {job.job_id} (rule {job.rule}) has {job.tasks} tasks on {job.nodes} nodes: "
                        "set `tasks_per_node` in the profile, not `tasks`, so every node runs as many ranks")
    cpus_per_task = max(1, job.cpus // job.nodes // per_node)
    # Not --kill-on-bad-exit: its SIGTERM would hit ranks leaving after the time-limit checkpoint (138), and srun
    # would report the signal instead. --wait: how long the others may take after one rank ended (the trainers
    # wait for rank 0's export before any leaves); a rank that dies ends the step at once through its guard
    # (guard_rank).
    wait = int(os.environ.get("SNAKEBERT_RANK_EXIT_WAIT_S") or RANK_EXIT_WAIT_S)
    return ["srun", f"--ntasks={job.tasks}", f"--nodes={job.nodes}", f"--ntasks-per-node={per_node}",
            f"--cpus-per-task={cpus_per_task}", "--kill-on-bad-exit=0", f"--wait={wait}",
            sys.executable, "-m", "workflow.slurm.launch", "--rank", "--", *command]


def guard_rank(command: list[str], environ=os.environ) -> int:
    """Run one rank of a step (CMD as a child) and return its exit status (-N: killed by signal N). When it dies by
    a signal (the OOM killer, a GPU fault) or ends with an error, end the whole step at once (`scancel
    --signal=KILL` of the step): its peers would fail or hang in their next collective and srun would keep the step
    --wait seconds. A stop exit (attempts.STOP_EXITS: every rank checkpointed and met at a barrier) or 0 passes."""
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):  # the rank's to handle (Slurm signals the step)
        signal.signal(signum, lambda *_: None)  # a handler, not SIG_IGN: the child starts with the default action
    status = subprocess.run(command).returncode
    if status != 0 and status not in attempts.STOP_EXITS:
        step = f"{environ.get('SLURM_JOB_ID')}.{environ.get('SLURM_STEP_ID')}"
        name = next((s.name for s in signal.Signals if s == -status), f"signal {-status}")
        how = f"died of {name}" if status < 0 else f"exited with status {status}"
        print(f"launch: rank {environ.get('SLURM_PROCID')} on {socket.gethostname()} {how}: ending step {step} now",
              file=sys.stderr, flush=True)
        subprocess.run(["scancel", "--signal=KILL", step])
    return status


def free_port() -> int:
    """A TCP port free on this host now: the OS picks it, so two jobs sharing a node cannot pick the same one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def local_command(command: list[str], environ=os.environ) -> list[str]:
    """Without Slurm: one rank per visible GPU (SNAKEBERT_LOCAL_RANKS overrides) through torchrun, else `command`."""
    import torch  # only here: a Slurm batch step never needs it

    ranks = int(environ.get("SNAKEBERT_LOCAL_RANKS") or torch.cuda.device_count() or 1)
    if ranks <= 1:
        return command
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "--no-python",
            *command]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workflow.slurm.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", default=None, help="the run directory whose checkpoints show progress")
    parser.add_argument("--rank", action="store_true", help="one task of the launcher's srun step (guard_rank)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]: one rank's command")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    argv = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not argv:
        raise UserError("usage: python -m workflow.slurm.launch [--run-dir DIR] -- COMMAND [ARGS...]")
    if args.rank:
        status = guard_rank(argv)
        if status < 0:  # die as the rank did, so that srun reports the signal
            if -status != signal.SIGKILL:
                signal.signal(-status, signal.SIG_DFL)
            os.kill(os.getpid(), -status)
        sys.exit(status if status >= 0 else 128 - status)
    job_id = os.environ.get("SLURM_JOB_ID")
    if "RANK" in os.environ:  # torchrun's ranks
        os.execvp(argv[0], argv)
    if args.run_dir:  # one writer per run directory (the pid stays that of the trainer we exec into)
        owner.claim(args.run_dir)
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
    try:
        attempts.run_attempt(job, srun_command(job, argv), rendezvous, args.run_dir)
    except SystemExit as exit:
        if exit.code == 0 and args.run_dir:
            owner.release(args.run_dir)
        raise


if __name__ == "__main__":
    from workflow.cli import run

    run(main)
