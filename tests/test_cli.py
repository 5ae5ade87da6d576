"""Stage plumbing: a cancelled job (SIGTERM) exits non-zero and leaves neither output nor temporary behind."""
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
            time.sleep(60)

    run(main)
""")


def test_sigterm_mid_write_exits_143_and_removes_the_temporary(tmp_path):
    output = tmp_path / "out.txt"
    process = subprocess.Popen([sys.executable, "-c", STAGE, str(output)], cwd=REPO, stdout=subprocess.PIPE,
                               text=True)
    assert process.stdout.readline().strip() == "writing"
    assert [p.name for p in tmp_path.iterdir()] == [f".out.txt.tmp-{process.pid}"]
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []
