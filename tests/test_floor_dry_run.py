"""`snakemake -n` on the sample says what a pretraining job would warn about its torch floor (docs/gpu.md), before any
job runs, where the head knows the jobs' torch: its own without a deployment method, envs/train.yaml's pin under
conda. The torch below a floor is a stand-in: a sitecustomize on PYTHONPATH sets torch.__version__ in the snakemake
process, as an older torch reports it."""
import json
import subprocess
import sys

import pytest

from tests.conftest import copy_workflow, snakemake_env

MODERNBERT = {"vocab": {"type": "bpe", "size": 1000}, "encode": {"objective": "full_sentences"},
              "model": {"family": "modernbert", "preset": "modernbert-tiny"}}
FLOOR_LINE = "needs torch >= "


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = copy_workflow(tmp_path_factory.mktemp("floor"))
    (root / "modernbert.yaml").write_text(json.dumps(MODERNBERT))
    return root


def dry_run(workdir, *extra, torch_version: str | None = None) -> str:
    """`snakemake -n pretrain` on the sample config (+ `extra` arguments); its stdout and stderr."""
    env = snakemake_env()
    if torch_version:
        site = workdir / f"torch_{torch_version}"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(f"import torch\ntorch.__version__ = {torch_version!r}\n")
        env["PYTHONPATH"] = str(site)
    result = subprocess.run([sys.executable, "-m", "snakemake", "-n", "pretrain", "--profile", "profiles/local",
                             "--configfile", "sample/config.yaml", *extra], cwd=workdir, env=env,
                            capture_output=True, text=True, timeout=300)
    return result.stdout + result.stderr


def floor_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if FLOOR_LINE in line]


@pytest.mark.parametrize("torch_version, extra, expected", [
    ("2.6.0", (), "warning: BERT's varlen flash attention with dropout needs torch >= 2.7 and compute capability >= "
     "8.0; torch 2.6.0 lacks it (the jobs' torch: this interpreter's, {python}): training with nested SDPA (exact, "
     "~4x slower) instead; upgrade torch to >= 2.7 (or pip install flash-attn)"),
    ("2.10.0", ("modernbert.yaml",), "warning: ModernBERT's windowed varlen flash attention needs torch >= 2.11 and "
     "compute capability >= 8.0; torch 2.10.0 lacks it (the jobs' torch: this interpreter's, {python}): training "
     "with rows with masks (exact, slower) instead; upgrade torch to >= 2.11 (or pip install flash-attn)"),
])
def test_a_dry_run_below_the_floor_prints_the_jobs_warning_once_naming_the_torch_to_upgrade(
        workdir, torch_version, extra, expected):
    output = dry_run(workdir, *extra, torch_version=torch_version)
    assert "This was a dry-run" in output, output[-3000:]
    assert floor_lines(output) == [expected.format(python=sys.executable)], output[-3000:]


def test_a_dry_run_with_todays_torch_prints_no_floor_warning(workdir):
    output = dry_run(workdir)
    assert "This was a dry-run" in output and floor_lines(output) == [], output[-3000:]


def test_a_dry_run_under_conda_compares_the_envs_pin_not_the_heads_torch(workdir):
    env = workdir / "envs" / "train.yaml"
    pinned = env.read_text()
    assert "torch==" in pinned
    env.write_text(pinned.replace("torch==", "torch==2.10.0  # was "))
    try:
        # The head's torch is today's; the job's env pins 2.10. (Without conda installed the run stops after
        # parsing, at `conda info`: the warning comes before.)
        output = dry_run(workdir, "modernbert.yaml", "--sdm", "conda")
    finally:
        env.write_text(pinned)
    assert floor_lines(output) == [
        f"warning: ModernBERT's windowed varlen flash attention needs torch >= 2.11 and compute capability >= 8.0; "
        f"torch 2.10.0 lacks it (the jobs' torch: {env}'s pin): training with rows with masks (exact, slower) "
        f"instead; pin torch >= 2.11 in {env} (or add flash-attn to it)"], output[-3000:]


def test_a_dry_run_on_a_torch_below_the_trainers_floor_says_each_training_job_will_stop(workdir):
    """torch 2.3 (NGC 24.04-24.06): the plan still runs (the data stages need no torch); the line says so first."""
    output = dry_run(workdir, torch_version="2.3.1")
    assert "This was a dry-run" in output, output[-3000:]
    assert [line for line in output.splitlines() if "snakebert trains with torch" in line] == [
        "warning: torch 2.3.1: snakebert trains with torch >= 2.4 (its attention kernels are torch.library custom "
        "ops, new in 2.4); upgrade torch (NGC's PyTorch containers have 2.4 from 24.07) (the jobs' torch: this "
        f"interpreter's, {sys.executable}); the data stages run, each training job stops at its start"], output[-3000:]
