"""The SQuAD and report rules run for real under Snakemake on the bundled sample, from a stand-in phase-2 export:
the scores are the official metric of the predictions, the summary and the report show the run's own numbers."""
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import copy_workflow, embedded_in_report, official_squad_v11, snakemake_env
from workflow.report import report
from workflow.squad import data as squad_data
from workflow.train.models.bert import BertConfig, BertForPreTraining, save_pretrained

TARGETS = ["results/squad/eval.json", "results/summary.csv", "results/report/pretrain_loss.png",
           "results/report/mlm_accuracy.png", "results/report/throughput.png",
           "results/report/gpu_telemetry.png", "results/report/squad_finetune.png", "results/report/config.yaml"]


def sample_squad_vocab(root: Path, directory: Path, lowercase: bool = True) -> int:
    """A 1000-entry WordPiece vocab of the SQuAD sample's texts in `directory`/vocab.txt; its size."""
    from tokenizers import BertWordPieceTokenizer

    texts = set()
    for name in ("train-sample.json", "dev-sample.json"):
        for example in squad_data.load_squad(root / "sample" / "squad" / name, "1.1"):
            texts.update([example.context, example.question])
    (root / "corpus.txt").write_text("\n".join(sorted(texts)))
    trainer = BertWordPieceTokenizer(lowercase=lowercase, strip_accents=lowercase)
    trainer.train([str(root / "corpus.txt")], vocab_size=1000, min_frequency=1, show_progress=False,
                  special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    directory.mkdir(parents=True)
    trainer.save_model(str(directory))
    return len((directory / "vocab.txt").read_text().splitlines())


def _upstream(root: Path) -> None:
    """What the data and pretraining stages leave behind: data/vocab.txt, the phase-2 export, phase metrics."""
    vocab_size = sample_squad_vocab(root, root / "data")
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


def effective_config(root: Path, *configfiles: str) -> dict:
    """config.yaml overlaid by each --configfile in turn, then the schema's defaults where none sets a key."""
    def overlay(base, override):
        for key, value in override.items():
            base[key] = overlay(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) \
                else value
        return base

    def fill(config, node, schema):
        node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]] | node if "$ref" in node else node
        for key, child in node.get("properties", {}).items():
            if key not in config and "default" in child:
                config[key] = json.loads(json.dumps(child["default"]))
            if isinstance(config.get(key), dict):
                fill(config[key], child, schema)

    config = {}
    for name in ("config.yaml", *configfiles):
        overlay(config, yaml.safe_load((root / name).read_text()) or {})
    schema = yaml.safe_load((root / "config.schema.yaml").read_text())
    fill(config, schema, schema)
    return config


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = copy_workflow(tmp_path_factory.mktemp("dag"))
    (root / "fast.yaml").write_text("squad:\n  epochs: 3\n")  # the demo's 20 epochs are not needed here
    _upstream(root)
    return root


def _snakemake(root, *extra):
    return subprocess.run([sys.executable, "-m", "snakemake", *TARGETS, "--cores", "2", *extra,
                           "--set-threads", "squad_finetune=1", "squad_predict=1",
                           "--configfile", "sample/config.yaml", "fast.yaml"], cwd=root, env=snakemake_env(),
                          capture_output=True, text=True)


def test_squad_rules_score_the_predictions_with_the_official_metric_and_report_the_runs_numbers(workdir, tmp_path):
    result = _snakemake(workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    evaluation = json.loads((workdir / "results/squad/eval.json").read_text())
    predictions = json.loads((workdir / "results/squad/predictions.json").read_text())
    dev = json.loads((workdir / "sample/squad/dev-sample.json").read_text())
    official = official_squad_v11(dev, predictions)
    assert (evaluation["total"], evaluation["missing"]) == (45, 0)
    assert evaluation["exact_match"] == pytest.approx(official["exact_match"], abs=1e-9)
    assert evaluation["f1"] == pytest.approx(official["f1"], abs=1e-9)
    assert set(predictions) == {e.qas_id for e in squad_data.load_squad(workdir / "sample/squad/dev-sample.json",
                                                                           "1.1")}
    nbest = json.loads((workdir / "results/squad/nbest_predictions.json").read_text())
    assert all(1 <= len(entries) <= 20 and entries[0]["text"] == predictions[qid] for qid, entries in nbest.items())
    assert "fine-tuned model" in (workdir / "logs/squad_finetune/finetune.log").read_text()
    assert not (workdir / "runs/squad").exists()

    with open(workdir / "results/summary.csv", newline="") as handle:
        table = {(r["stage"], r["metric"]): r["value"] for r in csv.DictReader(handle)}
    assert table[("squad", "exact_match")] == f"{evaluation['exact_match']:.6g}"
    assert table[("squad", "f1")] == f"{evaluation['f1']:.6g}"
    assert table[("phase1", "final_loss")] == "6" and table[("phase2", "steps")] == "20"  # _upstream's last lines

    # The report's files are the run's: its config, and figures drawn from its own metrics files.
    written = yaml.safe_load((workdir / "results/report/config.yaml").read_text())
    assert written == effective_config(workdir, "sample/config.yaml", "fast.yaml")
    assert written["squad"]["epochs"] == 3 and written["model"]["preset"] == "tiny"
    report.plot_squad(workdir / "results/squad/finetune_metrics.jsonl", workdir / "results/squad/eval.json",
                      tmp_path / "squad.png")
    assert (workdir / "results/report/squad_finetune.png").read_bytes() == (tmp_path / "squad.png").read_bytes()
    phases = [(phase, workdir / "results/pretrain" / phase) for phase in ("phase1", "phase2")]
    report.plot_pretrain(phases, tmp_path / "loss.png", tmp_path / "accuracy.png", tmp_path / "throughput.png")
    for name in ("loss", "accuracy", "throughput"):
        rule_output = {"loss": "pretrain_loss", "accuracy": "mlm_accuracy", "throughput": "throughput"}[name]
        assert (workdir / f"results/report/{rule_output}.png").read_bytes() == (tmp_path / f"{name}.png").read_bytes()

    again = _snakemake(workdir, "--dry-run")
    assert "Nothing to be done" in again.stdout + again.stderr

    built = _snakemake(workdir, "--report", "report.html")
    assert built.returncode == 0, built.stderr[-3000:]
    html = (workdir / "report.html").read_text(errors="replace")
    for path in TARGETS:  # the report embeds the run's files, byte for byte
        assert embedded_in_report(html, workdir / path), path
