"""model.family: modernbert through the real DAG on the sample: a byte-level BPE vocab, full-sentences packed data,
both phases (128 then 512 tokens with a larger global rotary theta, AdamW moments carried), and phase exports that Hugging Face's classes load and
that compute what ours compute; an own classification task fine-tuned from the phase-2 export exports HF's
ModernBertForSequenceClassification, which AutoModelForSequenceClassification and pipeline() load and which predicts
what our evaluation scored."""
import json
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.conftest import copy_workflow, snakemake_env
from tests.test_tasks import sentiment_csv

OVERLAY = {
    "vocab": {"type": "bpe", "size": 1000},
    "encode": {"objective": "full_sentences"},
    "model": {"family": "modernbert", "preset": "modernbert-tiny", "architecture": {"num_hidden_layers": 3}},
    "pretrain": {"optimizer": "adamw", "eval_max_sequences": 200, "eval_every": 0, "checkpoint_every": 4,
                 "phase1": {"learning_rate": 2.0e-3, "total_steps": 6, "global_batch_size": 16, "micro_batch_size": 8},
                 "phase2": {"learning_rate": 1.0e-3, "total_steps": 3, "global_batch_size": 8, "micro_batch_size": 4,
                            "global_rope_theta": 320000.0}},  # context extension
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = copy_workflow(tmp_path_factory.mktemp("modernbert"))
    (root / "modernbert.yaml").write_text(json.dumps(OVERLAY))
    result = subprocess.run([sys.executable, "-m", "snakemake", "pretrain", "--profile", "profiles/local",
                             "--configfile", "sample/config.yaml", "modernbert.yaml"], cwd=root, text=True,
                            capture_output=True, env=snakemake_env(), timeout=1500)
    assert result.returncode == 0, result.stderr[-4000:]
    return root


def test_both_phases_train_modernbert_on_bpe_data(run):
    summaries = [json.loads((run / f"results/pretrain/{phase}/summary.json").read_text()) for phase in
                 ("phase1", "phase2")]
    assert [(s["family"], s["seq_length"], s["steps"], s["objective"], s["packed"]) for s in summaries] == [
        ("modernbert", 128, 6, "full_sentences", True), ("modernbert", 512, 3, "full_sentences", True)]
    # no next-sentence head: no NSP figure, and every held-out sequence counted
    assert not any("test_nsp_accuracy" in s for s in summaries)
    assert all(s["test_sequences"] == int(s["test_set"].split()[0]) > 0 for s in summaries)
    assert summaries[0]["model"]["num_hidden_layers"] == 3
    assert [s["model"]["global_rope_theta"] for s in summaries] == [160000.0, 320000.0]  # phase 2 extends
    exported = json.loads((run / "results/pretrain/phase2/model/config.json").read_text())
    assert exported["rope_parameters"]["full_attention"]["rope_theta"] == exported["global_rope_theta"] == 320000.0
    assert exported["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    tokenizer = json.loads((run / "data/tokenizer.json").read_text())
    assert tokenizer["model"]["type"] == "BPE" and summaries[0]["model"]["vocab_size"] >= len(tokenizer["model"]["vocab"])


def test_the_phase_export_is_what_hf_loads_and_computes(run):
    from transformers import AutoModelForMaskedLM, AutoTokenizer, pipeline

    from workflow.train.models.family import ModelSettings, family

    export = run / "results/pretrain/phase2/model"
    hf = AutoModelForMaskedLM.from_pretrained(export).eval()
    assert type(hf).__name__ == "ModernBertForMaskedLM"
    settings = ModelSettings.from_config({"family": "modernbert", "init_from": str(export)})
    tokenizer = AutoTokenizer.from_pretrained(export)
    _, ours = family("modernbert").build(settings, str(export / "tokenizer.json"), len(tokenizer), 512)
    encoded = tokenizer(["The town lies on the river.", "It was founded in the year 1200 by monks."],
                        padding=True, return_tensors="pt")
    with torch.no_grad():
        theirs = hf(**encoded).logits
        mine = ours.eval()(encoded["input_ids"], attention_mask=encoded["attention_mask"])[0]
    real = encoded["attention_mask"].bool()
    assert (theirs[real] - mine[real]).abs().max() < 1e-4

    text = "The town lies on the [MASK]."
    best = pipeline("fill-mask", model=str(export), device="cpu")(text, top_k=1)[0]["token"]
    encoded = tokenizer(text, return_tensors="pt")
    slot = int((encoded["input_ids"][0] == tokenizer.mask_token_id).nonzero())
    with torch.no_grad():
        assert best == int(ours(encoded["input_ids"], attention_mask=encoded["attention_mask"])[0][0, slot].argmax())


TASK = {"sentiment": {"type": "classification", "train": "own/train.csv", "dev": "own/dev.csv", "test": "own/test.csv",
                      "format": "csv", "text_fields": ["text"], "label_field": "label"}}


@pytest.fixture(scope="module")
def task_run(run):
    """`snakemake tasks` on one own classification task, fine-tuned from the pretrained phase-2 export."""
    rng = random.Random(0)
    (run / "own").mkdir()
    sentiment_csv(run / "own/train.csv", 64, rng)
    sentiment_csv(run / "own/dev.csv", 24, rng)
    sentiment_csv(run / "own/test.csv", 8, rng, labelled=False)
    (run / "own.yaml").write_text(json.dumps({
        "squad": {"enabled": False}, "tasks": TASK,
        "glue": {"tasks": [], "learning_rate": 1e-3, "epochs": 1, "max_seq_length": 32, "batch_size": 16,
                 "micro_batch_size": 16}}))
    result = subprocess.run([sys.executable, "-m", "snakemake", "tasks", "--profile", "profiles/local",
                             "--configfile", "sample/config.yaml", "modernbert.yaml", "own.yaml"], cwd=run, text=True,
                            capture_output=True, env=snakemake_env(), timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "rule pretrain" not in result.stderr  # the task starts from the phase-2 export as it is
    return run


def test_an_own_classification_task_finetunes_modernbert_and_hf_predicts_what_we_scored(task_run):
    from transformers import AutoModelForSequenceClassification, pipeline

    from workflow.data.features import load_features

    model_dir = task_run / "results/tasks/sentiment/model"
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("modernbert", ["ModernBertForSequenceClassification"])
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    assert model.config.id2label == {0: "neg", 1: "pos"}
    features = load_features(task_run / "data/tasks/sentiment/dev_features.npz")
    with torch.no_grad():
        logits = model(**{k: torch.from_numpy(features[k].astype(np.int64))
                          for k in ("input_ids", "attention_mask")}).logits
    evaluation = json.loads((task_run / "results/tasks/sentiment/eval.json").read_text())["splits"]["dev"]
    accuracy = float((logits.argmax(-1).numpy() == features["labels"]).mean())
    assert evaluation["examples"] == 24 and evaluation["accuracy"] == pytest.approx(accuracy, abs=1e-9)

    texts = [line.strip('"') for line in (task_run / "own/test.csv").read_text().splitlines()[1:]]
    ours = [json.loads(line)["label"] for line in
            (task_run / "results/tasks/sentiment/predictions.jsonl").read_text().splitlines()]
    theirs = pipeline("text-classification", model=str(model_dir), device="cpu")(texts)
    assert ours == [answer["label"] for answer in theirs]
