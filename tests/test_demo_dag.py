"""The README's demo: `all` on the bundled sample (CPU, tiny model) finishes in a run directory outside the clone,
scores its predictions with the official SQuAD metric, prints and reports the run's own numbers, logs no progress
bar; fresh runs give the same data and phase-1 weights."""
import csv
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import REPO, SAMPLE, embedded_in_report, official_squad_v11, snakemake_env

# As `make demo` runs it, but from the run directory: the clone's Snakefile, the sample's paths relative to the run
WORKFLOW = ["--snakefile", str(REPO / "Snakefile"), "--configfile", "sample/config.yaml"]


def run_directory(path: Path) -> Path:
    """An empty run directory outside the clone, with the sample linked in as `make demo` links it."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "sample").symlink_to(SAMPLE)
    return path


def snakemake(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakemake", *args, *WORKFLOW], cwd=root, env=snakemake_env(**env),
                          capture_output=True, text=True, timeout=1800)


def file_digests(directory: Path) -> dict[str, str]:
    """sha256 of every file under `directory`, by relative path (Snakemake's directory markers left out)."""
    return {str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(directory.rglob("*")) if path.is_file() and path.name != ".snakemake_timestamp"}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """`make demo` in a run directory outside the clone: the DAG, the report, the printed summary."""
    root = run_directory(tmp_path_factory.mktemp("demo"))
    run = snakemake(root, "all", "--profile", str(REPO / "profiles/local"), "--cores", "2", PYTHONHASHSEED="0")
    assert run.returncode == 0, run.stderr[-4000:]
    report = snakemake(root, "all", "--cores", "2", "--report", "report.html")
    assert report.returncode == 0, report.stderr[-4000:]
    printed = subprocess.run([sys.executable, "-m", "workflow.report.summary", "--print", root / "results/summary.csv",
                              "--report", root / "report.html"], cwd=REPO, env=snakemake_env(), capture_output=True,
                             text=True, check=True).stdout
    return root, printed


def test_demo_scores_its_predictions_with_the_official_metric_and_prints_the_runs_numbers(demo):
    root, printed = demo
    evaluation = json.loads((root / "results/squad/eval.json").read_text())
    predictions = json.loads((root / "results/squad/predictions.json").read_text())
    dev = json.loads((root / "sample/squad/dev-sample.json").read_text())
    official = official_squad_v11(dev, predictions)
    assert evaluation["missing"] == 0 and evaluation["total"] == len(predictions) > 0
    assert evaluation["exact_match"] == pytest.approx(official["exact_match"], abs=1e-9)
    assert evaluation["f1"] == pytest.approx(official["f1"], abs=1e-9)

    with open(root / "results/summary.csv", newline="") as handle:
        table = {(r["stage"], r["metric"]): r["value"] for r in csv.DictReader(handle)}
    assert table[("squad", "exact_match")] == f"{evaluation['exact_match']:.6g}"
    assert table[("squad", "f1")] == f"{evaluation['f1']:.6g}"
    lines = printed.splitlines()
    assert (f"SQuAD v1.1 dev: EM {evaluation['exact_match']:.2f}  F1 {evaluation['f1']:.2f}  "
            f"({evaluation['total']} questions)") in lines
    for phase in ("phase1", "phase2"):
        metrics_file = root / f"results/pretrain/{phase}/metrics.jsonl"
        metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()]
        summary = json.loads((root / f"results/pretrain/{phase}/summary.json").read_text())
        assert table[(phase, "final_loss")] == f"{metrics[-1]['loss']:.6g}"
        assert table[(phase, "steps")] == str(summary["steps"]) == str(metrics[-1]["step"])
        assert any(line.split() == [f"{phase}.final_loss", table[(phase, "final_loss")]] for line in lines)
    assert lines[-1] == f"Report: {root / 'report.html'}"

    html = (root / "report.html").read_text(errors="replace")
    for path in ("results/summary.csv", "results/squad/eval.json", "results/report/pretrain_loss.png",
                 "results/report/mlm_accuracy.png", "results/report/throughput.png", "results/report/gpu_telemetry.png",
                 "results/report/squad_finetune.png", "results/report/config.yaml"):
        assert embedded_in_report(html, root / path), path  # the run's files, byte for byte


def test_demo_runs_outside_the_clone_and_its_logs_hold_no_progress_bar(demo):
    root, _ = demo
    assert sorted(path.name for path in root.iterdir()) == [".snakemake", "data", "logs", "report.html", "results",
                                                            "runs", "sample"]
    logs = sorted(path for path in (root / "logs").rglob("*") if path.is_file())
    assert len(logs) > 30  # every stage's
    assert [str(path.relative_to(root)) for path in logs if b"\r" in path.read_bytes()] == []


def test_fresh_runs_give_byte_identical_data_and_identical_phase1_weights(tmp_path):
    # Two checkouts, two hash seeds, 2 jobs at a time vs 1; the same config and seed, one training thread in both.
    # (Not the `demo` fixture: under `pytest -n 2` this test may run in another worker.)
    roots = []
    for name, cores, hash_seed in (("two_jobs", "2", "0"), ("one_job", "1", "1")):
        root = run_directory(tmp_path / name)
        run = snakemake(root, "results/pretrain/phase1/model", "--cores", cores, "--set-threads",
                        "pretrain_phase=1", PYTHONHASHSEED=hash_seed)
        assert run.returncode == 0, run.stderr[-4000:]
        roots.append(root)
    data = [file_digests(root / "data") for root in roots]
    assert {"vocab.txt", "hdf5_seq128/manifest.json", "hdf5_seq128/training/seq128_training_shard_0.hdf5"} <= data[0].keys()
    assert data[0] == data[1]

    weights = [load_file(root / "results/pretrain/phase1/model/model.safetensors") for root in roots]
    assert weights[0].keys() == weights[1].keys()
    assert [name for name in weights[0] if not weights[0][name].equal(weights[1][name])] == []
