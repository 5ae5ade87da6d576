"""A run directory apart from the code: Snakemake from anywhere with `--snakefile` and `--directory`, the workflow's
config.yaml when the run directory has none, a run directory made by `make run-dir` where the guide's commands run
as written, and an offline plan that cannot read the dump's list is one line.
(The whole demo in a directory outside the clone: tests/test_demo_dag.py.)"""
import re
import shutil
import socket
import subprocess
import sys

from tests.conftest import REPO, copy_workflow, snakemake_env


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


def test_the_guides_commands_run_as_written_in_a_run_directory_made_by_make_run_dir(tmp_path):
    """`make run-dir`: from the run directory, `--profile profiles/NAME` resolves (Snakemake takes an existing path
    relative to where it is typed), the Snakefile is found, and `python -m workflow...` imports the clone's code."""
    clone = copy_workflow(tmp_path / "snakebert")
    shutil.copy2(REPO / "Makefile", clone / "Makefile")
    run = tmp_path / "scratch" / "run1"
    made = subprocess.run(["make", "-C", str(clone), "run-dir", f"RUN={run}"], capture_output=True, text=True,
                          timeout=60)
    assert made.returncode == 0, made.stderr
    (run / "config.yaml").write_text((run / "config.yaml").read_text() + "\nseed: 7\n")  # the user's edit
    again = subprocess.run(["make", "-C", str(clone), "run-dir", f"RUN={run}"], capture_output=True, text=True,
                           timeout=60)
    assert again.returncode == 0 and (run / "config.yaml").read_text().endswith("seed: 7\n"), "config.yaml replaced"
    (run / "my-cluster.yaml").write_text("default-resources: {slurm_account: my_account}\n"
                                         "software-deployment-method: null\n")
    env = snakemake_env()
    derive = subprocess.run([sys.executable, "-m", "workflow.slurm.profile", "derive", "profiles/slurm",
                             "my-cluster.yaml", "--output", "profiles/my-cluster"], cwd=run, env=env,
                            capture_output=True, text=True, timeout=60)
    assert derive.returncode == 0, derive.stderr
    assert (clone / "profiles" / "my-cluster").is_dir()  # beside the stock profiles, for every run
    plan = subprocess.run([sys.executable, "-m", "snakemake", "--profile", "profiles/my-cluster", "-n",
                           "data/hdf5_seq128", "--config", "wikipedia={parts: single}"], cwd=run, env=env,
                          capture_output=True, text=True, timeout=300)
    output = plan.stdout + plan.stderr
    assert plan.returncode == 0, output[-3000:]
    assert "Config file(s): ['config.yaml']" in output, output[-3000:]  # the run directory's, not the clone's
    assert re.search(r"^download_wikipedia\s+1$", plan.stdout, re.M), output[-3000:]
    assert not (clone / ".snakemake").exists()  # the run's state stays in the run directory


def test_make_run_dir_refuses_a_relative_path_in_one_line():
    result = subprocess.run(["make", "-s", "-C", str(REPO), "run-dir", "RUN=run1"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert result.stderr.splitlines()[0] == "error: make run-dir needs RUN=/absolute/path (the run directory)"
