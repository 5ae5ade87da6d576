"""The README's demo: `all` on the bundled sample (CPU, tiny model) finishes and prints SQuAD EM/F1 in [0, 100]."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

# What the demo needs from the repository (the rest, e.g. .venv and earlier results, stays behind).
TREE = ["Snakefile", "config.yaml", "config.schema.yaml", "rules", "envs", "workflow", "profiles", "report",
        "sample"]


def test_demo_all_finishes_with_squad_scores(tmp_path):
    for name in TREE:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif source.exists():
            shutil.copy(source, tmp_path / name)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    run = subprocess.run([sys.executable, "-m", "snakemake", "all", "--profile", "profiles/local", "--cores", "2",
                          "--configfile", "sample/config.yaml"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-4000:]

    evaluation = json.loads((tmp_path / "results/squad/eval.json").read_text())
    assert evaluation["total"] > 0 and evaluation["missing"] == 0
    assert 0 <= evaluation["exact_match"] <= 100 and 0 <= evaluation["f1"] <= 100
    printed = subprocess.run([sys.executable, "-m", "workflow.report.summary", "--print", "results/summary.csv"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout
    assert f"EM {evaluation['exact_match']:.2f}  F1 {evaluation['f1']:.2f}" in printed
    assert "Report:" in printed
    for phase in ("phase1", "phase2"):
        assert f"{phase}.final_loss" in printed

    report = subprocess.run([sys.executable, "-m", "snakemake", "all", "--cores", "2", "--configfile",
                             "sample/config.yaml", "--report", "report.html"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-4000:]
    html = (tmp_path / "report.html").read_text(errors="replace")
    # needs all_targets() to include REPORT_TARGETS (rules/report.smk)
    for name in ("summary.csv", "eval.json", "pretrain_loss.png", "mlm_accuracy.png", "throughput.png",
                 "gpu_telemetry.png", "squad_finetune.png", "config.yaml"):
        assert name in html, name
