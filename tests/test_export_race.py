"""The end of a phase job on the test cluster (tests/slurm/start_cluster.sh): rank 0 alone exports the model, its
DLE checkpoint and the optimizer state, and srun kills a step's last ranks `--wait` seconds after its first one
exits. Proves: an export slower than that wait (slow shared storage, simulated) ends complete, with exit 0 and
nothing requeued, because no rank leaves before it is written; a rank 0 that fails mid-export still ends the ranks
waiting for it (here without Slurm). Cluster tests skip where no cluster can be had (not root), never under CI=true.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys

import torch
from safetensors.torch import load_file

from tests.fixtures.slurm_cluster import job_records
from tests.test_multinode import rank_lines, sbatch, state, wait_until
from tests.test_pretrain import command, environment, settings
from workflow.data.synthetic_shards import write_synthetic_shards
from workflow.train import checkpoint as ckpt

RANK_EXIT_WAIT_S = 5  # srun's --wait here (300 on a real run)
# Past srun's wait (it then ends the step with SIGKILL): without the wait for rank 0, rank 0 dies mid-export.
EXPORT_DELAY_S = 12


def two_step_phase(tmp_path):
    """The settings of a 2-step phase of a tiny model on synthetic shards under `tmp_path`."""
    write_synthetic_shards(tmp_path / "hdf5", n_training_shards=1, sequences_per_shard=64)
    return settings(tmp_path, tmp_path / "out", total_steps=2, global_batch_size=16, micro_batch_size=8,
                    checkpoint_every=2, log_every=1, loader_workers=0)


def test_an_export_slower_than_sruns_wait_ends_complete_with_exit_0(cluster, tmp_path):
    s = two_step_phase(tmp_path)
    trainer = shlex.join(command(s))
    job = sbatch(tmp_path, "job.out", f"SNAKEBERT_RANK_EXIT_WAIT_S={RANK_EXIT_WAIT_S} "
                 f"SNAKEBERT_EXPORT_DELAY_S={EXPORT_DELAY_S} {sys.executable} -m workflow.slurm.launch --run-dir "
                 f"{s.run_dir} -- {trainer}", "--nodes=2", "--ntasks-per-node=1", "--gres=gpu:1",
                 "--cpus-per-task=1", "--mem=1500")
    try:  # a killed export would be requeued: never leave it to the next test
        wait_until(f"job {job}", lambda: state(job) not in ("PENDING", "RUNNING"), seconds=300)
    finally:
        subprocess.run(["scancel", job])
    log = (tmp_path / "job.out").read_text()
    assert [(r["State"], r["DerivedExitCode"]) for r in job_records(job)] == [("COMPLETED", "0:0")], log[-3000:]
    assert f"--wait={RANK_EXIT_WAIT_S}" in log and "the export waits that long" in log, log[-3000:]
    assert f"Slurm job {job} run 0 completed" in log, log[-3000:]
    assert len({rank[3] for rank in rank_lines(log)}) == 2, log[-3000:]  # rank 1 waited from another host
    # Complete: the model and DLE checkpoint hold the last checkpoint's weights; the optimizer state and summary
    # were written after the slow part.
    (last,) = ckpt.list_checkpoints(tmp_path / "out" / "run" / "checkpoints")
    trained = ckpt.load_checkpoint(last)["model"]
    exported = load_file(tmp_path / "out" / "model" / "model.safetensors")
    assert all(torch.equal(exported[key], trained[key]) for key in exported), "exported weights differ"
    dle = torch.load(tmp_path / "out" / "model" / "dle_checkpoint.pt", weights_only=True)["model"]
    assert torch.equal(dle["bert.embeddings.word_embeddings.weight"][:64],
                       trained["bert.embeddings.word_embeddings.weight"][:64])
    optimizer = torch.load(tmp_path / "out" / "optimizer_state.pt", weights_only=True)
    moments = [tuple(optimizer["state"][k]["exp_avg"].shape) for k in range(len(optimizer["state"]))]
    assert moments == [tuple(shape) for shape in optimizer["shapes"]] and len(moments) == len(trained)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["steps"], summary["world_size"]) == (2, 2), summary


def test_a_rank_0_that_fails_mid_export_ends_the_ranks_waiting_for_it(tmp_path):
    # Two ranks through torchrun (no Slurm; there the launcher's guard ends the step): the optimizer state, the
    # export's last file, cannot be written. Rank 1 waits in a barrier with no timeout, and must not wait forever.
    s = two_step_phase(tmp_path)
    (tmp_path / "out" / "optimizer_state.pt").mkdir(parents=True)
    result = subprocess.run([sys.executable, "-m", "workflow.slurm.launch", "--", *command(s)],
                            env=environment(SNAKEBERT_LOCAL_RANKS="2"), capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "IsADirectoryError" in result.stderr and "Connection closed by peer" in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "out" / "summary.json").exists()  # the export is not complete and does not look it
