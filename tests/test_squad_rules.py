"""The SQuAD and report rules run for real under Snakemake on the bundled sample, from a stand-in phase-2 export."""
import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from workflow.squad import data as squad_data
from workflow.train.model import BertConfig, BertForPreTraining, save_pretrained

TARGETS = ["results/squad/eval.json", "results/summary.csv", "results/report/pretrain_loss.png",
           "results/report/gpu_telemetry.png", "results/report/squad_finetune.png", "results/report/config.yaml"]


def _upstream(root: Path) -> None:
    """What the data and pretraining stages leave behind: data/vocab.txt, the phase-2 export, phase metrics."""
    from tokenizers import BertWordPieceTokenizer

    texts = set()
    for name in ("train-sample.json", "dev-sample.json"):
        for example in squad_data.load_squad(root / "sample" / "squad" / name, "1.1"):
            texts.update([example.context, example.question])
    (root / "corpus.txt").write_text("\n".join(sorted(texts)))
    trainer = BertWordPieceTokenizer(lowercase=True)
    trainer.train([str(root / "corpus.txt")], vocab_size=1000, min_frequency=1, show_progress=False,
                  special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    (root / "data").mkdir()
    trainer.save_model(str(root / "data"))
    vocab_size = len((root / "data" / "vocab.txt").read_text().splitlines())
    config = BertConfig.preset("tiny", vocab_size=vocab_size)
    torch.manual_seed(0)
    save_pretrained(BertForPreTraining(config), config, root / "data" / "vocab.txt",
                    root / "results" / "pretrain" / "phase2" / "model")
    for phase, steps in (("phase1", 60), ("phase2", 20)):
        directory = root / "results" / "pretrain" / phase
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "loss": 9 - s / 20, "mlm_loss": 8 - s / 20, "nsp_loss": 0.69,
                        "mlm_accuracy": s / 200, "lr": 1e-3, "grad_norm": 1.0, "seq_per_s": 50.0,
                        "tokens_per_s": 6400.0}) + "\n" for s in range(5, steps + 1, 5)))
        (directory / "summary.json").write_text(json.dumps({"steps": steps, "seq_per_s": 50.0,
                                                            "global_batch_size": 16, "test_mlm_accuracy": 0.1}))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("dag")
    for name in ("Snakefile", "config.yaml", "config.schema.yaml"):
        shutil.copy(REPO / name, root / name)
    for name in ("rules", "envs", "report", "workflow", "profiles"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "sample").mkdir()
    shutil.copy(REPO / "sample" / "config.yaml", root / "sample" / "config.yaml")
    shutil.copytree(REPO / "sample" / "squad", root / "sample" / "squad")
    (root / "fast.yaml").write_text("squad:\n  epochs: 3\n")  # the demo's 20 epochs are not needed here
    _upstream(root)
    return root


def _snakemake(root, *extra):
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return subprocess.run([sys.executable, "-m", "snakemake", *TARGETS, "--cores", "2", *extra,
                           "--set-threads", "squad_finetune=1", "squad_predict=1",
                           "--configfile", "sample/config.yaml", "fast.yaml"], cwd=root, env=env, capture_output=True, text=True)


def test_squad_rules_end_to_end_with_report(workdir):
    result = _snakemake(workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    evaluation = json.loads((workdir / "results/squad/eval.json").read_text())
    assert evaluation["total"] == 45 and evaluation["missing"] == 0
    assert 0 <= evaluation["exact_match"] <= evaluation["f1"] <= 100
    predictions = json.loads((workdir / "results/squad/predictions.json").read_text())
    dev = squad_data.load_squad(workdir / "sample/squad/dev-sample.json", "1.1")
    assert set(predictions) == {e.qas_id for e in dev}
    nbest = json.loads((workdir / "results/squad/nbest_predictions.json").read_text())
    assert all(1 <= len(entries) <= 20 and entries[0]["text"] == predictions[qid] for qid, entries in nbest.items())
    with open(workdir / "results/summary.csv", newline="") as handle:
        table = {(r["stage"], r["metric"]): r["value"] for r in csv.DictReader(handle)}
    assert float(table[("squad", "f1")]) == pytest.approx(evaluation["f1"], rel=1e-5)
    assert table[("phase1", "final_loss")] == "6"
    assert (workdir / "results/squad/model/config.json").is_file()
    assert not (workdir / "runs/squad").exists()
    assert "fine-tuned model" in (workdir / "logs/squad_finetune/finetune.log").read_text()

    again = _snakemake(workdir, "--dry-run")
    assert "Nothing to be done" in again.stdout + again.stderr

    report = _snakemake(workdir, "--report", "report.html")
    assert report.returncode == 0, report.stderr[-3000:]
    html = (workdir / "report.html").read_text(errors="replace")
    for name in ("pretrain_loss.png", "gpu_telemetry.png", "squad_finetune.png", "summary.csv", "eval.json",
                 "config.yaml"):
        assert name in html
