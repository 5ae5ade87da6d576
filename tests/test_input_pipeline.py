"""The training input pipeline at the recipe's size: one rank's steps through the real DataLoader with workers.

Proves: at BERT-large phase 1's batch sizes (global batch 65,536 sequences, micro-batches of 64 rows, 8 ranks: 128
micro-batches per rank and step unpacked) a step crosses from a loader worker to the trainer under the common
`ulimit -n 1024` (each tensor's storage travels as its own file descriptor: the micro-batches of a step are
stacked into one tensor per field), and the trainer gets exactly the micro-batches of a read in its own process.
A rank whose step raises shuts its loader workers down, so it exits instead of hanging at Python's exit; a rank that
SIGKILL takes (the out-of-memory killer) leaves no process behind, whatever the start method: fork, spawn, or
forkserver (Python 3.14's default on Linux).
"""
from __future__ import annotations

import multiprocessing
import os
import resource
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from tests.test_pretrain import data, settings  # noqa: F401  (the data fixture)
from workflow.data.synthetic_shards import write_synthetic_shards
from workflow.train import engine
from workflow.train.pretrain import PretrainingTask, pretrain
from workflow.train.pretraining_data import PretrainingSequences, list_shards

GLOBAL_BATCH, MICRO_BATCH, WORLD = 65_536, 64, 8  # BERT-large phase 1 (config.yaml) on 8 ranks
DESCRIPTORS = 1024
STEPS = 4  # more than the workers hold ahead (2 workers x prefetch)
IDLE_S = 10  # the subprocess: torch import and 4 steps of a rank (~8,192 sequences each)


def loader_settings() -> engine.LoopSettings:
    return engine.LoopSettings("pretrain.phase1", "unused", total_steps=STEPS, global_batch_size=GLOBAL_BATCH,
                               micro_batch_size=MICRO_BATCH, loader_workers=2, prefetch_steps=2)


def rank(index: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(rank=index, world_size=WORLD, device=torch.device("cpu"))


def read_through_loader(directory: str, rank_index: int, output: str) -> None:
    """The subprocess: rank `rank_index`'s first STEPS steps through engine.step_batches, saved to `output`."""
    sequences = PretrainingSequences(list_shards(directory, "training"), seed=1)
    steps = engine.step_batches(sequences, [k * GLOBAL_BATCH for k in range(STEPS)], loader_settings(),
                                rank(rank_index))
    torch.save([[{name: value.clone() for name, value in batch.items()} for batch in step] for step in steps], output)


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_a_ranks_full_size_steps_cross_from_loader_workers_under_ulimit_1024_unchanged(tmp_path, packed):
    # Short sequences keep it fast; the number of micro-batches per step and of fields is the recipe's.
    directory = write_synthetic_shards(tmp_path / "data", seq_length=16, max_predictions=3, n_training_shards=2,
                                       sequences_per_shard=1024, max_sequences_per_pack=3 if packed else None,
                                       short_seq_prob=0.5 if packed else 0.0)
    output = tmp_path / "steps.pt"
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    child = subprocess.run(
        [sys.executable, "-c", "import sys; from tests.test_input_pipeline import read_through_loader as r; "
                               "r(sys.argv[1], 3, sys.argv[2])", str(directory), str(output)],
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (DESCRIPTORS, hard)),
        capture_output=True, text=True, timeout=5 * IDLE_S)
    assert child.returncode == 0, child.stderr[-3000:]
    received = torch.load(output)

    reference = PretrainingSequences(list_shards(directory, "training"), seed=1)
    expected = [reference.micro_batches(k * GLOBAL_BATCH, GLOBAL_BATCH, 3, WORLD, MICRO_BATCH) for k in range(STEPS)]
    fields = 9 if packed else 6
    assert [len(step) for step in received] == [len(step) for step in expected]
    assert all(len(step) * fields > DESCRIPTORS // 2 for step in expected)  # the old layout's share of the limit
    if not packed:
        assert {len(step) for step in expected} == {GLOBAL_BATCH // (MICRO_BATCH * WORLD)}  # 128
    for got_step, want_step in zip(received, expected):
        for got, want in zip(got_step, want_step):
            assert got.keys() == want.keys() and len(got) == fields
            for name in want:
                assert torch.equal(got[name], want[name]), name


def test_a_steps_micro_batches_stack_into_one_tensor_per_field_and_split_back_into_views():
    batches = [{"input_ids": torch.arange(6).view(2, 3) + 10 * k, "ids": [k], "count": torch.tensor(k)}
               for k in range(3)]
    step = engine.stack_micro_batches(batches)
    assert list(step["stacked"]) == ["input_ids"] and step["rows"] == {"input_ids": [2, 2, 2]}
    assert set(step["others"]) == {"ids", "count"}  # not concatenable: passed as they are
    back = engine.unstack_micro_batches(step)
    assert len(back) == 3 and all(list(b) == ["input_ids", "ids", "count"] for b in back)
    for got, want in zip(back, batches):
        assert torch.equal(got["input_ids"], want["input_ids"]) and got["ids"] == want["ids"]
        assert got["input_ids"].untyped_storage().data_ptr() == step["stacked"]["input_ids"].untyped_storage(
        ).data_ptr()  # a view: no copy in the trainer


def test_a_step_that_raises_leaves_no_loader_worker_behind(data, tmp_path, monkeypatch):  # noqa: F811
    # The workers ignore SIGTERM (Slurm's stop is the rank's to handle): left to Python's exit, which terminates and
    # then joins them, they would hold a failed rank (a peer's death, an out-of-memory error) until the job's end.
    real, steps = engine._optimizer_step, [0]

    def failing_step(*args, **kwargs):
        steps[0] += 1
        if steps[0] == 3:
            raise RuntimeError("a peer died")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "_optimizer_step", failing_step)
    before = set(multiprocessing.active_children())
    with pytest.raises(RuntimeError, match="a peer died") as raised:
        pretrain(settings(data, tmp_path, total_steps=12, loader_workers=2, eval_max_sequences=16))
    assert raised.traceback  # the frames that held the loader are still alive here
    assert set(multiprocessing.active_children()) == before


class FailingTask(PretrainingTask):
    """A rank's task whose loader worker raises (a damaged shard) at its fifth step in rank $FAILING_RANK: each read
    notes its worker's pid in $FAILING_NOTES/workers, the failing one the time of its error. A class that the workers
    import by name, so that it reaches them under every start method."""

    def micro_batches(self, start, count, rank, world, rows):
        notes = Path(os.environ["FAILING_NOTES"])
        with open(notes / "workers", "a") as handle:
            handle.write(f"{os.getpid()}\n")
        if start >= 4 * count and os.environ.get("RANK", "0") == os.environ.get("FAILING_RANK", "0"):
            (notes / "error_at").write_text(repr(time.time()))
            raise OSError(f"{notes}/shard_1.hdf5: damaged")
        return super().micro_batches(start, count, rank, world, rows)


# A rank as `python -m workflow.train.pretrain` runs it: its processes started by the start method $START_METHOD names
# (else Python's default), its task FailingTask where $FAILING_NOTES is set.
RANK = """
import multiprocessing, os, sys
from workflow.cli import run
from workflow.train import pretrain

if os.environ.get("START_METHOD"):
    multiprocessing.set_start_method(os.environ["START_METHOD"], force=True)
if os.environ.get("FAILING_NOTES"):
    from tests.test_input_pipeline import FailingTask
    pretrain.PretrainingTask = FailingTask
run(pretrain.main, sys.argv[1:])
"""


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])  # Python 3.14's default on Linux: forkserver
def test_a_rank_whose_loader_worker_raises_exits_non_zero_within_seconds_and_leaves_no_worker(  # noqa: F811
        data, tmp_path, start_method):
    # The error leaves next() of the DataLoader's iterator with a traceback that holds the iterator: left to Python's
    # exit, its workers (which ignore SIGTERM) were terminated in vain and joined forever, and the rank never exited.
    from tests.test_pretrain import command, environment

    notes = tmp_path / "notes"
    notes.mkdir()
    argv = command(settings(data, tmp_path / "out", total_steps=12, loader_workers=2, eval_max_sequences=16))
    rank = subprocess.Popen([sys.executable, "-c", RANK, *argv[3:]],
                            env=environment(FAILING_NOTES=str(notes), START_METHOD=start_method),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = rank.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        rank.kill()
        pytest.fail("the rank did not exit within 90 s of its start")
    exited = time.time()
    assert rank.returncode != 0
    assert "damaged" in stderr
    waited = exited - float((notes / "error_at").read_text())
    assert waited < 10, f"the rank exited {waited:.1f} s after its worker's error"
    workers = {int(pid) for pid in (notes / "workers").read_text().split()}
    assert len(workers) == 2
    time.sleep(1)
    assert not [pid for pid in workers if _alive(pid)]


def test_two_local_ranks_end_within_seconds_of_one_ranks_loader_worker_error(data, tmp_path):  # noqa: F811
    # Rank 1's worker raises; rank 1 exits, torchrun stops rank 0 (blocked in its next collective, not for the
    # collective timeout's 30 minutes), and the launcher exits non-zero, leaving no worker of either rank.
    from tests.test_pretrain import command, environment

    notes = tmp_path / "notes"
    notes.mkdir()
    argv = command(settings(data, tmp_path / "out", total_steps=12, loader_workers=2, eval_max_sequences=16))
    launcher = [sys.executable, "-m", "workflow.slurm.launch", "--", sys.executable, "-c", RANK, *argv[3:]]
    result = subprocess.run(launcher, env=environment(SNAKEBERT_LOCAL_RANKS="2", FAILING_RANK="1",
                                                      FAILING_NOTES=str(notes)),
                            capture_output=True, text=True, timeout=120)
    exited = time.time()
    assert result.returncode != 0 and "damaged" in result.stderr
    waited = exited - float((notes / "error_at").read_text())
    assert waited < 20, f"the job ended {waited:.1f} s after rank 1's worker's error"
    workers = {int(pid) for pid in (notes / "workers").read_text().split()}
    assert len(workers) == 4  # two per rank
    time.sleep(1)
    assert not [pid for pid in workers if _alive(pid)]


def _alive(pid: int) -> bool:
    try:
        return " Z " not in open(f"/proc/{pid}/stat").read().split(")")[-1][:4]  # a zombie is gone but for its reaper
    except FileNotFoundError:
        return False


def processes_marked(mark: bytes) -> set[int]:
    """The live processes whose environment holds `mark` (every process a rank starts inherits it)."""
    pids = set()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark in environ.read_bytes().split(b"\0") and _alive(int(environ.parent.name)):
                pids.add(int(environ.parent.name))
        except OSError:  # gone meanwhile
            pass
    return pids


@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_a_rank_killed_by_sigkill_leaves_no_process_behind_under_every_start_method(  # noqa: F811
        data, tmp_path, start_method):
    # Python 3.14 starts processes by forkserver on Linux. The workers are then the fork server's children, so
    # torch's check that their parent changed never fires: they and the fork server outlived a rank that the
    # out-of-memory killer took, forever, holding its memory and its output pipes.
    from tests.test_pretrain import command, environment

    mark = f"SNAKEBERT_TEST_RANK={tmp_path}".encode()
    argv = command(settings(data, tmp_path / "out", total_steps=12, loader_workers=2, eval_max_sequences=16))
    with open(tmp_path / "stderr", "w") as stderr:
        rank = subprocess.Popen([sys.executable, "-c", RANK, *argv[3:]],
                                env=environment(SNAKEBERT_FAIL_AT_STEP="7", SNAKEBERT_TEST_RANK=str(tmp_path),
                                                START_METHOD=start_method),
                                stdout=subprocess.DEVNULL, stderr=stderr)
        seen, deadline = set(), time.time() + 150
        while rank.poll() is None and time.time() < deadline:
            seen |= processes_marked(mark) - {rank.pid}
            time.sleep(0.1)
        if rank.poll() is None:
            rank.kill()
            pytest.fail(f"the rank did not reach step 7 within 150 s: {(tmp_path / 'stderr').read_text()[-2000:]}")
    assert rank.returncode == -signal.SIGKILL, (tmp_path / "stderr").read_text()[-2000:]
    assert len(seen) >= 2  # its two loader workers (and under forkserver the fork server, the resource tracker)
    deadline = time.time() + 30  # torch's own check runs every 5 s
    while (left := processes_marked(mark)) and time.time() < deadline:
        time.sleep(0.2)
    assert not left, f"{len(left)} of the rank's {len(seen)} processes outlived it"
