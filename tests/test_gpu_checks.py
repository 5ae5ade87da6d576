"""benchmarks/gpu_checks.sh gives a verdict: each step's pass/fail (a timeout named so) in one Markdown table, a
non-zero exit when one failed, and a step whose synthetic data are missing fails saying so, before it runs."""
import os
import subprocess

from tests.conftest import REPO

SCRIPT = REPO / "benchmarks" / "gpu_checks.sh"


def run_steps(tmp_path, steps: str, **env) -> subprocess.CompletedProcess:
    """The script with the step list `steps` (bash) in place of its GPU checks."""
    (tmp_path / "steps.sh").write_text(steps)
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "GPU_CHECKS_STEPS": str(tmp_path / "steps.sh"), **env})


def table(stdout: str) -> list[list[str]]:
    """The verdict's rows, each [step, result, log]; its header first; every seconds cell a whole number."""
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in stdout.splitlines()
            if line.startswith("|")]
    assert rows[:2] == [["step", "result", "seconds", "log"], ["---"] * 4]
    assert all(row[2].isdigit() for row in rows[2:])
    return [[step, result, log] for step, result, _, log in rows[2:]]


def test_the_verdict_is_a_table_of_every_step_and_a_failure_or_a_timeout_fails_the_run(tmp_path):
    ran = run_steps(tmp_path, "step ok 5 true\nstep broken 5 false\nstep slow 1 sleep 5\n"
                              "gpu_step on_gpu 5 true\n")
    assert ran.returncode == 1, ran.stderr
    log = str(tmp_path / "out")
    assert table(ran.stdout) == [
        ["ok", "passed", f"{log}/ok.log"],
        ["broken", "failed (exit 1)", f"{log}/broken.log"],
        ["slow", "failed (timeout after 1 s)", f"{log}/slow.log"],
        ["on_gpu", "passed", f"{log}/on_gpu.log"]]


def test_every_step_passed_or_skipped_exits_zero_and_the_cpu_rehearsal_skips_gpu_only_steps(tmp_path):
    ran = run_steps(tmp_path, "step ok 5 echo hello\ngpu_step on_gpu 5 false\n", GPU_CHECKS_CPU="1")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert table(ran.stdout) == [["ok", "passed", f"{tmp_path}/out/ok.log"], ["on_gpu", "skipped (no GPU)", "-"]]
    assert (tmp_path / "out" / "ok.log").read_text() == "hello\n"


def test_a_step_whose_synthetic_data_were_not_made_fails_naming_them_and_does_not_run(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "shard.hdf5").write_text("x")
    ran = run_steps(tmp_path, f"made check_a {tmp_path}/data && step check_a 5 true\n"
                              f"made check_b {tmp_path}/data {tmp_path}/empty && step check_b 5 true\n")
    assert ran.returncode == 1
    assert table(ran.stdout) == [
        ["check_a", "passed", f"{tmp_path}/out/check_a.log"],
        ["check_b", f"failed (no synthetic data: {tmp_path}/empty is missing or empty)", "-"]]
    assert not (tmp_path / "out" / "check_b.log").exists()


def test_without_a_gpu_the_checks_stop_at_once_pointing_to_the_cpu_rehearsal(tmp_path):
    import sys

    import torch

    if torch.cuda.is_available():
        return  # a GPU machine runs the checks themselves
    env = {k: v for k, v in os.environ.items() if k not in ("GPU_CHECKS_STEPS", "GPU_CHECKS_CPU")}
    ran = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={**env, "PYTHON": sys.executable})
    assert ran.returncode == 2 and ran.stderr.splitlines() == [
        "error: gpu_checks: no CUDA device here; GPU_CHECKS_CPU=1 rehearses the steps on CPU at tiny sizes"]
