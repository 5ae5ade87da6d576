"""Fine-tune only: `snakemake squad` / `glue` from squad.init_from / glue.init_from (an HF directory or an NVIDIA DLE
checkpoint) plan no data half and no pretraining, and make their features with the fine-tuned model's own casing."""
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import copy_workflow, official_squad_v11, snakemake_env
from tests.test_squad_rules import sample_squad_vocab
from workflow.data.features import load_features, load_tokenizer
from workflow.squad import data as squad_data
from workflow.train.models.dle_checkpoint import save_dle_checkpoint
from workflow.train.models.bert import BertConfig, BertForPreTraining, save_pretrained
from workflow.data.vocab import Normalization

SQUAD_JOBS = {"squad_download_train": 1, "squad_download_dev": 1, "squad_featurize": 2, "squad_finetune": 1,
              "squad_predict": 1, "squad_eval": 1, "squad": 1}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The workflow with a cased WordPiece vocab of the SQuAD sample, a tiny model as an HF directory (cased) and
    as a DLE checkpoint (its vocab rows padded to a multiple of 8, as DLE does) with its bert_config.json."""
    root = copy_workflow(tmp_path_factory.mktemp("finetune_only"))
    vocab_size = sample_squad_vocab(root, root / "cased", lowercase=False)
    config = BertConfig.preset("tiny", vocab_size=vocab_size)
    config.to_json(root / "bert_config.json")
    torch.manual_seed(0)
    save_pretrained(BertForPreTraining(config), config, root / "cased" / "vocab.txt", root / "hf_model",
                    normalization=Normalization(lowercase=False))
    config.vocab_size = (vocab_size + 7) // 8 * 8
    save_dle_checkpoint(BertForPreTraining(config), root / "ckpt_8601.pt", gelu="erf")
    return root


def snakemake(root, target, *configfiles, dry_run=True):
    return subprocess.run([sys.executable, "-m", "snakemake", target, "--cores", "2", *(["-n"] if dry_run else []),
                           "--set-threads", "squad_finetune=1", "squad_predict=1", "glue_finetune=1", "glue_eval=1",
                           "--configfile", "sample/config.yaml", *configfiles], cwd=root, env=snakemake_env(),
                          capture_output=True, text=True, timeout=600)


def planned_jobs(output: str) -> dict:
    """The dry run's job table: {rule: count}."""
    table = output.split("Job stats:", 1)[1].split("total", 1)[0]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.MULTILINE)}


def test_squad_from_an_hf_directory_plans_no_data_half_and_no_pretraining(workdir):
    (workdir / "hf.yaml").write_text("squad: {init_from: hf_model}\n")
    result = snakemake(workdir, "squad", "hf.yaml")
    assert result.returncode == 0, result.stderr[-3000:]
    assert planned_jobs(result.stdout) == SQUAD_JOBS


def test_glue_from_a_dle_checkpoint_plans_its_import_and_no_pretraining(workdir):
    (workdir / "glue.yaml").write_text("glue: {init_from: ckpt_8601.pt, tasks: [SST-2, MRPC]}\n"
                                       "model: {bert_config: bert_config.json}\n"
                                       "vocab: {file: cased/vocab.txt, lowercase: false}\n")
    result = subprocess.run([sys.executable, "-m", "snakemake", "glue", "-n", "-p", "--configfile",
                             "sample/config.yaml", "glue.yaml"], cwd=workdir, env=snakemake_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert planned_jobs(result.stdout) == {"import_dle_checkpoint": 1, "glue_download": 4, "glue_featurize": 4,
                                           "glue_finetune": 2, "glue_eval": 2, "glue": 1}
    assert "--vocab cased/vocab.txt --output data/glue/MRPC/train_features.npz --no-lowercase" in result.stdout


def test_a_dle_checkpoint_without_its_config_and_vocab_is_refused_naming_the_keys(workdir):
    (workdir / "bare.yaml").write_text("squad: {init_from: ckpt_8601.pt}\n")
    result = snakemake(workdir, "squad", "bare.yaml")
    assert result.returncode != 0
    assert ("config key 'squad.init_from': ckpt_8601.pt is a file, read as an NVIDIA DLE checkpoint: set "
            "model.bert_config to its bert_config.json and vocab.file to its vocab.txt (vocab.lowercase: its casing)"
            ) in result.stdout + result.stderr


def test_squad_fine_tunes_and_scores_a_cased_dle_checkpoint_with_cased_features(workdir):
    (workdir / "dle.yaml").write_text("squad: {init_from: ckpt_8601.pt, epochs: 1}\n"
                                      "model: {bert_config: bert_config.json}\n"
                                      "vocab: {file: cased/vocab.txt, lowercase: false}\n")
    result = snakemake(workdir, "squad", "dle.yaml", dry_run=False)
    assert result.returncode == 0, result.stderr[-3000:]
    ran = set(re.findall(r"Finished jobid: \d+ \(Rule: (\w+)\)", result.stdout + result.stderr))
    assert ran == {"import_dle_checkpoint", *SQUAD_JOBS}
    evaluation = json.loads((workdir / "results/squad/eval.json").read_text())
    dev = json.loads((workdir / "sample/squad/dev-sample.json").read_text())
    official = official_squad_v11(dev, json.loads((workdir / "results/squad/predictions.json").read_text()))
    assert (evaluation["total"], evaluation["missing"]) == (45, 0)
    assert evaluation["f1"] == pytest.approx(official["f1"], abs=1e-9)
    # The features are the cased model's: each question's WordPieces as the cased tokenizer gives them.
    features = load_features(workdir / "data/squad/dev_features.npz")
    examples = squad_data.load_squad(workdir / "sample/squad/dev-sample.json", "1.1")
    cased = load_tokenizer(workdir / "cased" / "vocab.txt", lowercase=False)
    row = int(np.flatnonzero(features["example_index"] == 0)[0])
    question = cased.encode(examples[0].question, add_special_tokens=False).ids[:32]
    assert features["input_ids"][row, 1:1 + len(question)].tolist() == question
    assert question != load_tokenizer(workdir / "cased" / "vocab.txt", lowercase=True).encode(
        examples[0].question, add_special_tokens=False).ids[:32]
    assert json.loads((workdir / "results/squad/model/tokenizer_config.json").read_text())["do_lower_case"] is False


def test_features_take_the_models_tokenizer_config_over_the_lowercase_flag(tmp_path):
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "Paris", "paris",
                                                   "café", "cafe"]) + "\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False}))
    squad = {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": "Paris café", "qas": [
        {"id": "q", "question": "Paris café", "answers": [{"text": "Paris", "answer_start": 0}]}]}]}]}
    (tmp_path / "squad.json").write_text(json.dumps(squad))
    for flags, name in ((["--lowercase", "--tokenizer-config", str(tmp_path / "tokenizer_config.json")], "cased"),
                        (["--lowercase"], "uncased")):
        squad_data.main(["--input", str(tmp_path / "squad.json"), "--vocab", str(tmp_path / "vocab.txt"),
                         "--output", str(tmp_path / f"{name}.npz"), "--max-seq-length", "32", "--max-query-length", "8", *flags])
    assert load_features(tmp_path / "cased.npz")["input_ids"][0, :4].tolist() == [2, 5, 7, 3]  # Paris café
    assert load_features(tmp_path / "uncased.npz")["input_ids"][0, :4].tolist() == [2, 6, 8, 3]  # paris cafe
