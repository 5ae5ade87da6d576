"""A run directory apart from the code: Snakemake from anywhere with `--snakefile` and `--directory`, the workflow's
config.yaml when the run directory has none, and an offline plan that cannot read the dump's list is one line.
(The whole demo in a directory outside the clone: tests/test_demo_dag.py.)"""
import re
import socket
import subprocess
import sys

from tests.conftest import REPO, snakemake_env


def snakemake(cwd, *args):
    return subprocess.run([sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), *args],
                          cwd=cwd, env=snakemake_env(), capture_output=True, text=True, timeout=300)


def unreachable_url(name: str) -> str:
    """A loopback URL nothing listens on (a port just closed): a refused connection, as offline."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}/{name}"


def test_dry_run_from_anywhere_plans_the_default_config_in_the_run_directory(tmp_path):
    run = tmp_path / "scratch" / "run1"
    run.mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    result = snakemake(tmp_path / "elsewhere", "--directory", str(run), "-n", "data/hdf5_seq128",
                       "--config", "wikipedia={parts: single}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Config file(s): ['{REPO / 'config.yaml'}']" in result.stdout + result.stderr
    assert re.search(r"^download_wikipedia\s+1$", result.stdout, re.M), result.stdout[-3000:]
    assert sorted(p.name for p in run.iterdir()) == [".snakemake"]


def test_offline_plan_with_parts_auto_is_one_error_line_naming_the_fix(tmp_path):
    dump = unreachable_url("enwiki-20240101-pages-articles.xml.bz2")
    listing = dump.replace("pages-articles.xml.bz2", "md5sums.txt")
    (tmp_path / "offline.yaml").write_text(f"wikipedia: {{url: '{dump}', parts: auto}}\n")
    result = snakemake(tmp_path, "-n", "all", "--configfile", "offline.yaml")
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    errors = [line for line in output.splitlines() if "error" in line.lower()]
    assert errors == [f"error: config key 'wikipedia.parts': auto reads the dump's checksum list: {listing}: cannot "
                      "read (<urlopen error [Errno 111] Connection refused>); offline, set wikipedia.parts: single "
                      "or point wikipedia.url at a local dump"], output[-3000:]
    assert "Traceback" not in output and "Exception" not in output
