"""The data stages' forked pools end: under load, after a block that raises, and on the stage's SIGTERM."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from workflow.pool import forked_pool

ROOT = Path(__file__).resolve().parent.parent

# A stage under workflow.cli.run (its SIGTERM handler raises SystemExit) making many short pools of 3 workers,
# each block either completing or raising at once, so that terminate() meets workers still in their fork.
STRESS = textwrap.dedent("""
    import sys
    from workflow.cli import run
    from workflow.pool import forked_pool

    def square(x):
        return x * x

    def main(argv):
        completed = 0
        for i in range(int(argv[0])):
            try:
                with forked_pool(3) as pool:
                    if i % 3:
                        raise KeyError(i)
                    completed += pool.map(square, range(3)) == [0, 1, 4]
            except KeyError:
                pass
        print(completed)

    run(main, sys.argv[1:])
""")


def _python(script: str, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *args], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)}, **kwargs)


def test_many_short_pools_under_load_all_end():
    # Without the signal mask across the fork, about one pool in 30 of these hung for good on this machine (both
    # cores busy); two runs side by side keep both cores busy. Idle time: ~15 s each.
    runs = [_python(STRESS, "900") for _ in range(2)]
    for each in runs:
        out, err = each.communicate(timeout=150)
        assert each.returncode == 0, err
        assert out.split() == ["300"]


def test_the_parent_gets_its_sigterm_back_after_a_pool():
    with forked_pool(2) as pool:
        assert pool.map(abs, [-1, -2]) == [1, 2]
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_a_raising_block_ends_its_workers_and_raises():
    with pytest.raises(ZeroDivisionError):
        with forked_pool(2) as pool:
            pool.map(abs, [1, 2])
            workers = [process.pid for process in pool._pool]
            1 / 0
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


SLOW_STAGE = textwrap.dedent("""
    import os, sys, time
    from workflow.cli import run
    from workflow.pool import forked_pool

    def started():
        open(os.path.join(sys.argv[1], str(os.getpid())), "w").close()

    def main(argv):
        with forked_pool(2, started) as pool:
            pool.map(time.sleep, [60, 60], chunksize=1)

    run(main, sys.argv[1:])
""")


def test_a_stage_cancelled_during_its_pool_exits_at_once_and_leaves_no_worker(tmp_path):
    stage = _python(SLOW_STAGE, str(tmp_path))
    deadline = time.monotonic() + 30
    while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = [int(path.name) for path in tmp_path.iterdir()]
    assert len(workers) == 2
    stage.send_signal(signal.SIGTERM)  # scancel, Snakemake's shutdown
    stage.communicate(timeout=30)
    assert stage.returncode == 128 + signal.SIGTERM
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
