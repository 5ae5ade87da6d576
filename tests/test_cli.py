"""Stage plumbing: SIGTERM unwinds a stage's atomic outputs, while its forked pool workers still die at once."""
import signal
import subprocess
import sys
import textwrap

from tests.conftest import REPO

STAGE = textwrap.dedent("""
    import sys, time
    from workflow.atomic import atomic_path
    from workflow.cli import run

    def main(argv):
        with atomic_path(sys.argv[1]) as temporary:
            temporary.write_text("half of the output")
            print("writing", flush=True)
            for _ in range(600):  # works in steps, as stages do: see the test
                time.sleep(0.1)

    run(main)
""")


def test_sigterm_mid_write_exits_143_and_removes_the_temporary(tmp_path):
    # CPython runs a Python signal handler between bytecodes. A SIGTERM that lands after the last check and before
    # a blocking call starts waits for that call: strace on 3.14.8 showed it arrive 0.2 ms after "writing" and a
    # single sleep(60) then sleep its full minute. The stage therefore sleeps in short steps, as real stages work.
    output = tmp_path / "out.txt"
    process = subprocess.Popen([sys.executable, "-c", STAGE, str(output)], cwd=REPO, stdout=subprocess.PIPE,
                               text=True)
    assert process.stdout.readline().strip() == "writing"
    assert [p.name for p in tmp_path.iterdir()] == [f".out.txt.tmp-{process.pid}"]
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


POOL_STAGE = textwrap.dedent("""
    import multiprocessing, os, signal
    from workflow.cli import run

    def handler_in_worker(_):
        return signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    def main(argv):
        with multiprocessing.get_context("fork").Pool(2) as pool:
            print(all(pool.map(handler_in_worker, range(8))), flush=True)
        # Pool.__exit__ terminated the workers with SIGTERM: a worker that unwound instead would hang this join

    run(main)
""")


def test_forked_pool_workers_keep_the_default_sigterm_so_pool_shutdown_cannot_hang():
    result = subprocess.run([sys.executable, "-c", POOL_STAGE], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
