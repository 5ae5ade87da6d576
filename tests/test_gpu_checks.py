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


def stub_python(tmp_path):
    """A stand-in for Python: each step's log is its command line."""
    stub = tmp_path / "python"
    stub.write_text('#!/bin/sh\necho "$@"\n')
    stub.chmod(0o755)
    return stub


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
    ran = run_steps(tmp_path, "benchmark_steps\n", GPU_CHECKS_CPU="1", PYTHON=str(stub_python(tmp_path)))
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
    ran = run_steps(tmp_path, "benchmark_steps\n", PYTHON=str(stub_python(tmp_path)))
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


def test_parts_pick_and_order_the_steps_and_an_unknown_part_stops_before_any_step(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "GPU_CHECKS_STEPS"}
    def run(parts):
        return subprocess.run(["bash", str(SCRIPT), str(tmp_path / parts.replace(" ", "_"))], cwd=REPO,
                              capture_output=True, text=True, timeout=60,
                              env={**env, "GPU_CHECKS_CPU": "1", "PYTHON": str(stub_python(tmp_path)), "PARTS": parts})
    speed = run("speed")
    assert speed.returncode == 0, speed.stdout + speed.stderr
    assert [row[0] for row in table(speed.stdout)] == [
        "train_step_phase1", "train_step_phase2", "modernbert_step_1024_50368", "modernbert_step_8192_50368"]
    both = table(run("checks speed").stdout)
    assert [row[0] for row in both][:2] == ["gpu_tests", "data_bert"] and both[-1][0] == "modernbert_step_8192_50368"
    wrong = run("speed learning")
    assert wrong.returncode == 2 and wrong.stderr.splitlines() == [
        "error: gpu_checks: PARTS: unknown part 'learning' (speed, checks)"]
    assert "|" not in wrong.stdout


def test_each_row_is_appended_to_verdict_md_as_its_step_ends(tmp_path):
    ran = run_steps(tmp_path, "step ok 5 true\n"
                              "head -n 3 \"$out/verdict.md\" >\"$out/so_far\"\n"
                              "step broken 5 false\n")
    assert ran.returncode == 1
    verdict = (tmp_path / "out" / "verdict.md").read_text().splitlines()
    assert verdict == [line for line in ran.stdout.splitlines() if line.startswith("|")]
    assert (tmp_path / "out" / "so_far").read_text().splitlines() == verdict[:3]  # ok's row, before broken ran


def test_on_a_gpu_the_wheels_are_installed_first_and_put_on_pythonpath(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in ("torchao-0.18.0-cp310-abi3-manylinux_2_28_x86_64.whl", "torch_optimi-0.3.3-py3-none-any.whl"):
        (wheels / name).write_text("")
    ran = run_steps(tmp_path, 'install_wheels\necho "$PYTHONPATH" >"$out/pythonpath"\n',
                    PYTHON=str(stub_python(tmp_path)), WHEELS=str(wheels), PYTHONPATH="/elsewhere")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    site = (tmp_path / "out" / "pythonpath").read_text().strip().split(":")
    assert site[1:] == ["/elsewhere"] and site[0].endswith("/site")
    pip = ran.stdout.splitlines()[0].split()  # the stub's echo of its command line
    assert pip[:3] == ["-m", "pip", "install"] and "--no-index" in pip and "--no-deps" in pip
    assert pip[pip.index("--target") + 1] == site[0]
    assert sorted(pip[-2:]) == sorted(str(path) for path in wheels.iterdir())


def test_gpu_wheels_asks_pip_for_the_projects_pins_without_dependencies_for_the_gpu_machines_python(tmp_path):
    stub = tmp_path / "python"  # `-c CODE NAME` (the installed version of an unpinned NAME) answers 9.9
    stub.write_text('#!/bin/sh\nif [ "$1" = -c ]; then echo "$3==9.9"; else echo "$@"; fi\n')
    stub.chmod(0o755)
    ran = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_wheels.sh"), str(tmp_path / "wheels")], cwd=REPO,
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHON": str(stub)})
    assert ran.returncode == 0, ran.stderr
    download = ran.stdout.splitlines()[0].split()
    pins = {line.split("==")[0]: line.split()[0] for name in ("requirements.txt", "requirements-gpu.txt")
            for line in (REPO / name).read_text().splitlines() if "==" in line and not line.startswith("#")}
    assert download[:3] == ["-m", "pip", "download"] and "--no-deps" in download and "--only-binary=:all:" in download
    assert download[download.index("--python-version") + 1] == "3.12"
    assert download[download.index("-d") + 2:] == [pins["torch-optimi"], pins["torchao"], pins["liger-kernel"],
                                                   pins["jsonschema"], "jsonschema-specifications==9.9",
                                                   "referencing==9.9", "rpds-py==9.9", "attrs==9.9"]
