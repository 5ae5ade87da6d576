"""The GLUE rules run for real under Snakemake: TSVs downloaded (resumably) from a loopback HTTP server, featurized,
fine-tuned from a stand-in phase-2 export and scored with each task's metric (MNLI on both dev sets); `all` includes
GLUE exactly when glue.tasks is non-empty; the summary shows the scores."""
import csv
import json
import random
import shutil
import subprocess
import sys

import pytest
import torch
from sklearn import metrics as sk

from tests.conftest import snakemake_env
from workflow.classify import evaluate as classify_eval, model as classifier
from workflow.glue import data as glue_data
from workflow.report import summary
from workflow.data.features import load_features
from workflow.train.models.bert import BertConfig, BertForPreTraining, save_pretrained

MNLI_HEADER = ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
               "sentence2_parse\tsentence1\tsentence2")


def mnli_tsv(path, n, seed, dev):
    """MNLI's layout (train: label1, gold_label; dev: label1..label5, gold_label), labels from cue words."""
    rng = random.Random(seed)
    cues = {"entailment": "indeed", "contradiction": "never", "neutral": "perhaps"}
    labels = ["label1", "label2", "label3", "label4", "label5"] if dev else ["label1"]
    lines = ["\t".join([MNLI_HEADER, *labels, "gold_label"])]
    for i in range(n):
        gold = rng.choice(sorted(cues))
        fields = [str(i), str(i), f"{i}x", "fiction", "( a )", "( b )", "(ROOT a)", "(ROOT b)",
                  "the man walked home", f"he {cues[gold]} walked", *[gold] * len(labels), gold]
        lines.append("\t".join(fields))
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture
def glue_server(tmp_path, http_server, sample_dir):
    served = tmp_path / "served"
    shutil.copytree(sample_dir / "glue", served, ignore=shutil.ignore_patterns("*.py"))
    (served / "MNLI").mkdir()
    mnli_tsv(served / "MNLI" / "train.tsv", 64, 1, dev=False)
    mnli_tsv(served / "MNLI" / "dev_matched.tsv", 24, 2, dev=True)
    mnli_tsv(served / "MNLI" / "dev_mismatched.tsv", 20, 3, dev=True)
    server = http_server(served)
    server.cut_once("MRPC/train.tsv", 1000)  # a dropped connection: the download resumes with a Range request
    return server, served


def _upstream(root, served):
    """data/vocab.txt (whole words of the served texts) and a randomly initialised tiny phase-2 export."""
    words = set()
    for tsv in served.glob("*/*.tsv"):
        for line in tsv.read_text().splitlines():
            words.update(w for field in line.split("\t") for w in field.lower().split() if w.isalpha())
    (root / "data").mkdir()
    (root / "data" / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".",
                                                         *sorted(words)]) + "\n")
    torch.manual_seed(0)
    config = BertConfig.preset("tiny", vocab_size=len(words) + 6, max_position_embeddings=64)
    save_pretrained(BertForPreTraining(config), config, root / "data" / "vocab.txt",
                    root / "results" / "pretrain" / "phase2" / "model")


def test_glue_rules_download_finetune_and_score_each_task_with_its_metric(workflow_copy, glue_server, tmp_path):
    server, served = glue_server
    _upstream(workflow_copy, served)
    (workflow_copy / "glue.yaml").write_text(json.dumps({"glue": {
        "tasks": ["SST-2", "MRPC", "MNLI"], "url": server.url, "learning_rate": 1.0e-3, "epochs": 3,
        "overrides": {"MNLI": {"epochs": 6}}}}))  # the recipe this test measured, whatever the demo's settings
    result = subprocess.run([sys.executable, "-m", "snakemake", "glue", "--cores", "2", "--set-threads",
                             "glue_finetune=1", "glue_eval=1", "--configfile", "sample/config.yaml", "glue.yaml"],
                            cwd=workflow_copy, env=snakemake_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]

    for tsv in served.glob("*/*.tsv"):  # every file arrived whole, the cut one by resuming
        assert (workflow_copy / "data/download/glue" / tsv.parent.name / tsv.name).read_bytes() == tsv.read_bytes()
    assert ("/MRPC/train.tsv", "bytes=1000-") in server.requests

    scores = {}
    for task in ("SST-2", "MRPC", "MNLI"):
        evaluation = json.loads((workflow_copy / f"results/glue/{task}/eval.json").read_text())
        spec = glue_data.TASKS[task]
        assert evaluation["task"] == task and sorted(evaluation["splits"]) == sorted(spec.dev_splits)
        model, _ = classifier.load_classifier(workflow_copy / f"results/glue/{task}/model", spec.num_labels, True)
        for split, got in evaluation["splits"].items():
            features = load_features(workflow_copy / f"data/glue/{task}/{split}_features.npz")
            predictions = classify_eval.compute_logits(model, features, 64, torch.device("cpu"), "fp32").argmax(-1)
            labels = features["labels"]
            rows = len((served / task / f"{split}.tsv").read_text().splitlines()) - 1
            assert got["examples"] == len(labels) == rows
            assert got["accuracy"] == pytest.approx(sk.accuracy_score(labels, predictions), abs=1e-9)
            if "f1" in spec.metrics:
                assert got["f1"] == pytest.approx(sk.f1_score(labels, predictions), abs=1e-9)
            scores[f"{task} {split}"] = got["accuracy"]
        assert not (workflow_copy / "runs/glue" / task).exists()
    print(scores)
    # the cue-word tasks are learnt by the pipeline itself (measured: 1.0); MRPC's sample is only run, not judged
    assert scores["SST-2 dev"] >= 0.9 and min(scores["MNLI dev_matched"], scores["MNLI dev_mismatched"]) >= 0.8

    rows = summary.summarize({}, None, None, [workflow_copy / f"results/glue/{t}/eval.json" for t in
                                              ("SST-2", "MRPC", "MNLI")])
    table = {(stage, metric): value for stage, metric, value in rows}
    assert table[("glue", "MNLI-m.accuracy")] == scores["MNLI dev_matched"]
    assert table[("glue", "MNLI-mm.accuracy")] == scores["MNLI dev_mismatched"]
    assert table[("glue", "SST-2.examples")] == 80
    csv_path = tmp_path / "summary.csv"
    csv_path.write_text(summary.to_csv(rows))
    with open(csv_path, newline="") as handle:
        assert {(r["stage"], r["metric"]) for r in csv.DictReader(handle)} >= {("glue", "MRPC.f1"),
                                                                               ("glue", "MRPC.accuracy")}
    printed = summary.render(summary.read_summary(csv_path), tmp_path / "report.html")
    assert f"GLUE dev: SST-2 accuracy {scores['SST-2 dev']:.4f}  MRPC accuracy" in printed


def glue_jobs(stdout: str) -> dict:
    """{rule: count} of the GLUE rules in a dry run's job table."""
    return dict(line.split() for line in stdout.splitlines() if line.startswith("glue_") and len(line.split()) == 2)


def test_a_summary_refuses_an_eval_json_that_is_not_glues(tmp_path):
    (tmp_path / "eval.json").write_text(json.dumps({"exact_match": 80.0, "f1": 88.0}))
    with pytest.raises(summary.UserError, match=r"eval.json: not a GLUE evaluation \(keys task, splits\)"):
        summary.summarize({}, None, None, [tmp_path / "eval.json"])


def _dry_run(root, *configfiles):
    return subprocess.run([sys.executable, "-m", "snakemake", "-n", "all", *(["--configfile", *configfiles]
                                                                           if configfiles else [])],
                          cwd=root, env=snakemake_env(), capture_output=True, text=True)


def test_all_includes_glue_exactly_when_tasks_are_configured(workflow_copy):
    with_glue = _dry_run(workflow_copy, "sample/config.yaml")
    assert with_glue.returncode == 0, with_glue.stderr[-2000:]
    assert glue_jobs(with_glue.stdout) == {"glue_download": "2", "glue_featurize": "2", "glue_finetune": "1", "glue_eval": "1"}
    (workflow_copy / "no_glue.yaml").write_text("glue: {tasks: []}\n")
    without = _dry_run(workflow_copy, "sample/config.yaml", "no_glue.yaml")
    assert without.returncode == 0 and "hdf5_dir" in without.stdout and glue_jobs(without.stdout) == {}


@pytest.mark.parametrize(("override", "message"), [
    ("glue: {tasks: [MRPC]}",
     "config key 'glue.url': required when glue.tasks is non-empty (a directory or base URL of GLUE TSVs)"),
    ("glue: {tasks: [SST2]}", "config key 'glue.tasks.0': 'SST2' is not one of ['CoLA', 'SST-2', 'MRPC', 'STS-B', "
                              "'QQP', 'MNLI', 'QNLI', 'RTE', 'WNLI']"),
    ("glue: {tasks: [RTE], url: x, overrides: {RTE: {batch_size: 24}}}",
     "config key 'glue.batch_size': 24 is not a multiple of glue.micro_batch_size (32) for task RTE "
     "(glue.overrides.RTE may set either)"),
])
def test_a_bad_glue_config_is_one_line_naming_the_key(override, message, workflow_copy):
    (workflow_copy / "bad.yaml").write_text(override + "\n")
    result = _dry_run(workflow_copy, "bad.yaml")
    assert result.returncode == 1
    assert message in (result.stdout + result.stderr).splitlines()
