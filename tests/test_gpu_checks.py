"""benchmarks/gpu_checks.sh gives a verdict: each step's pass/fail (a timeout named so) in one Markdown table, a
non-zero exit when one failed, and a step whose synthetic data are missing fails saying so, before it runs; the step
benchmarks run full size on a GPU and tiny on CPU in the rehearsal, never skipped."""
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


def test_the_cpu_rehearsal_runs_every_step_benchmark_tiny_on_cpu_with_every_variant(tmp_path):
    """The benchmark steps are not skipped on CPU: each runs its GPU mode (--gpu) at tiny sizes on the CPU, compiled
    and float8 asked for, the largest micro-batch searched; the benchmarks' own tests run these command lines."""
    stub = tmp_path / "python"
    stub.write_text('#!/bin/sh\necho "$@"\n')  # stands in for Python: each step's log is its command line
    stub.chmod(0o755)
    ran = run_steps(tmp_path, "benchmark_steps\n", GPU_CHECKS_CPU="1", PYTHON=str(stub))
    assert ran.returncode == 0, ran.stdout + ran.stderr
    names = ["train_step_phase1", "train_step_phase2", "modernbert_step_1024_50368", "modernbert_step_8192_50368"]
    assert table(ran.stdout) == [[name, "passed", f"{tmp_path}/out/{name}.log"] for name in names]
    for name in names:
        command = (tmp_path / "out" / f"{name}.log").read_text().split()
        assert command[1:2] == ["--gpu"] and "--compile" in command and "--float8" in command
        assert command[command.index("--device") + 1] == "cpu"
        assert command[command.index("--find-max-micro-batch") + 1] == "hf,eager"
        assert command[command.index("--preset") + 1] == ("tiny" if name.startswith("train") else "modernbert-tiny")
    phases = [(tmp_path / "out" / f"train_step_{phase}.log").read_text().split() for phase in ("phase1", "phase2")]
    assert [command[command.index("--phases") + 1] for command in phases] == ["phase1", "phase2"]


def test_on_a_gpu_the_step_benchmarks_run_full_size_bert_large_and_modernbert_base_at_both_lengths(tmp_path):
    stub = tmp_path / "python"
    stub.write_text('#!/bin/sh\necho "$@"\n')
    stub.chmod(0o755)
    ran = run_steps(tmp_path, "benchmark_steps\n", PYTHON=str(stub))
    assert ran.returncode == 0, ran.stdout + ran.stderr
    modernbert = {seq: (tmp_path / "out" / f"modernbert_step_{seq}_50368.log").read_text().split()
                  for seq in (1024, 8192)}
    for seq, rows in ((1024, "64"), (8192, "8")):
        command = modernbert[seq]
        assert "--device" not in command and "--preset" not in command  # CUDA, modernbert-base: the defaults
        assert command[command.index("--gpu-seq") + 1] == str(seq)
        assert command[command.index("--micro-batch") + 1] == rows
        assert command[command.index("--vocab") + 1] == "50368"
    bert = (tmp_path / "out" / "train_step_phase1.log").read_text().split()
    assert "--device" not in bert and "--preset" not in bert  # CUDA, BERT-large, config.yaml's micro-batches
