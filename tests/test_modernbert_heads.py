"""ModernBERT fine-tuning through the shared fine-tuning code: every head (sequence classification pooled by [CLS]
or by the mean, regression, token classification, question answering) fine-tunes from a directory Hugging Face saved
from a random small config, at sequences longer than BERT's 512 positions, and exports HF's layout: HF's Auto classes
(eager) compute our logits and pipeline() predicts what we do. The unpadded path takes its real tokens from the
host. The rules fine-tune from a ModernBERT directory with its own tokenizer.json; a DLE checkpoint is BERT's.
"""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.conftest import snakemake_env
from tests.test_finetune_ddp import features as ddp_features
from workflow.classify.model import job_of, load_classifier
from workflow.classify.task import SentenceTask
from workflow.data.features import save_features
from workflow.data.vocab import train_bpe
from workflow.squad.finetune import JOB as SQUAD_JOB
from workflow.squad.finetune import load_qa_model
from workflow.tasks.run import token_job
from workflow.tasks.token_model import TOKEN_CLASSIFIERS
from workflow.train import finetune as finetuning
from workflow.train.models.family import directory_family

transformers = pytest.importorskip("transformers")

TEXT = ("The river flows north through the valley. Its water feeds the old mill, which ground wheat for the town. "
        "In winter the river freezes and the children skate on it. ") * 40
SEQ, ROWS = 600, 8  # longer than BERT's 512 positions; the tiny config below has 1,024
LABELS = ["calm", "flood", "ice"]  # pipeline("token-classification") leaves out a label named "O": none here
RECIPE = {**vars(finetuning.FinetuneSettings()), "learning_rate": 1e-3, "epochs": 1.0, "batch_size": 4,
          "micro_batch_size": 2, "log_every": 1, "precision": "fp32"}
HEADS = {  # name: (job, our loader, HF's Auto class, the class our export names)
    "classification": (job_of(SentenceTask("mood", tuple(LABELS), ("accuracy",)), "tasks.mood", "tasks.mood"),
                       lambda d: load_classifier(d, 3, require_head=True), "AutoModelForSequenceClassification",
                       "ModernBertForSequenceClassification"),
    "regression": (job_of(SentenceTask("level", None, ("pearson",)), "tasks.level", "tasks.level"),
                   lambda d: load_classifier(d, 1, require_head=True), "AutoModelForSequenceClassification",
                   "ModernBertForSequenceClassification"),
    "token_classification": (token_job("tags", LABELS),
                             lambda d: load_classifier(d, 3, require_head=True, heads=TOKEN_CLASSIFIERS),
                             "AutoModelForTokenClassification", "ModernBertForTokenClassification"),
    "squad": (SQUAD_JOB, lambda d: load_qa_model(d, require_head=True), "AutoModelForQuestionAnswering",
              "ModernBertForQuestionAnswering"),
}


@pytest.fixture(scope="module")
def inits(tmp_path_factory):
    """{pooling: an HF directory transformers itself saved from a random small ModernBERT config (window 8, 1,024
    positions) with a BPE tokenizer.json}."""
    from workflow.data.tokenizer import Vocabulary, save_tokenizer

    root = tmp_path_factory.mktemp("modernbert_heads")
    (root / "shard_0.txt").write_text(TEXT.replace(". ", ".\n"), encoding="utf-8")
    train_bpe([root / "shard_0.txt"], root / "tokenizer.json", size=400)
    vocab = Vocabulary.load(root / "tokenizer.json")
    out = {}
    for pooling in ("cls", "mean"):
        torch.manual_seed(0)
        config = transformers.ModernBertConfig(
            vocab_size=(vocab.size + 7) // 8 * 8, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
            num_attention_heads=2, local_attention=8, max_position_embeddings=1024, pad_token_id=vocab.pad,
            cls_token_id=vocab.cls, bos_token_id=vocab.cls, sep_token_id=vocab.sep, eos_token_id=vocab.sep,
            classifier_pooling=pooling)
        transformers.ModernBertForMaskedLM(config).save_pretrained(root / pooling)
        save_tokenizer(root / "tokenizer.json", root / pooling, None, config.max_position_embeddings)
    return {**out, "cls": root / "cls", "mean": root / "mean", "vocab": vocab}


def features(head: str, vocab, rows: int = ROWS, seed: int = 0, seq: int = SEQ) -> dict:
    """The head's random features of `seq` tokens (rows half to fully real) within the vocab."""
    return ddp_features(head, rows, seq, vocab.size, seed)


def finetuned(head: str, init, vocab, root, seq: int = SEQ):
    job = HEADS[head][0]
    save_features(root / "train.npz", features(head, vocab, seq=seq))
    settings = finetuning.FinetuneSettings(**{**RECIPE, "seed": 7})
    assert finetuning.finetune(job, init, root / "train.npz", root / "model", root / "run", settings,
                               metrics_path=root / "metrics.jsonl", device="cpu") == 0
    steps = [json.loads(line)["step"] for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    return root / "model"


@pytest.fixture(scope="module")
def exports(inits, tmp_path_factory):
    """exports(head, pooling): the fine-tuned model directory (made once per module)."""
    made = {}

    def export(head: str, pooling: str):
        if (head, pooling) not in made:
            root = tmp_path_factory.mktemp(f"{head}_{pooling}")
            made[head, pooling] = finetuned(head, inits[pooling], inits["vocab"], root)
        return made[head, pooling]

    return export


def outputs(model, inputs: dict) -> torch.Tensor:
    """The logits of ours or HF's model, stacked (QA: start and end on the last axis)."""
    if not isinstance(model, transformers.PreTrainedModel):  # ours
        out = model(inputs["input_ids"], None, inputs["attention_mask"])
    else:
        out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        out = (out.start_logits, out.end_logits) if hasattr(out, "start_logits") else out.logits
    return torch.stack(out, -1) if isinstance(out, tuple) else out


@pytest.mark.parametrize("head, pooling", [("classification", "cls"), ("classification", "mean"),
                                           ("regression", "mean"), ("token_classification", "cls"), ("squad", "cls")])
def test_a_finetuned_head_exports_hfs_layout_and_hf_computes_our_logits(inits, exports, head, pooling):
    model_dir = exports(head, pooling)
    _, load, auto, architecture = HEADS[head]
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["model_type"], config["architectures"], config["classifier_pooling"]) == (
        "modernbert", [architecture], pooling)
    if head in ("classification", "token_classification"):
        assert config["id2label"] == {str(i): label for i, label in enumerate(LABELS)}
    assert (model_dir / "tokenizer.json").is_file()

    ours, _ = load(model_dir)
    dev = {k: torch.from_numpy(v.astype(np.int64)) for k, v in features(head, inits["vocab"], 4, seed=1).items()}
    assert logit_difference_to_hf(ours, model_dir, auto, architecture, dev, f"{head} ({pooling})") < 1e-5


def logit_difference_to_hf(ours, model_dir, auto: str, architecture: str, dev: dict, label: str) -> float:
    """The largest |logit| difference between our head and HF's class `auto` loading its export (which must load
    as `architecture`, every weight used) on the features `dev`; padding's token logits left out."""
    theirs, info = getattr(transformers, auto).from_pretrained(model_dir, attn_implementation="eager",
                                                                output_loading_info=True)
    assert type(theirs).__name__ == architecture and not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        mine, hf = outputs(ours.eval(), dev), outputs(theirs.eval(), dev)
    if mine.dim() > 2:  # per token: padding's logits are no one's
        mine, hf = mine[dev["attention_mask"].bool()], hf[dev["attention_mask"].bool()]
    difference = float((mine - hf).abs().max())
    print(f"{label}: max |logit difference| to HF {difference:.2e} (logits up to {float(mine.abs().max()):.2f})")
    return difference


def test_pipelines_predict_what_our_logits_say_beyond_512_tokens(exports):
    classifier_dir, tagger_dir = exports("classification", "mean"), exports("token_classification", "cls")
    text = TEXT[:3000]  # ~700 tokens: past BERT's positions, within the model's 1,024
    tokenizer = transformers.AutoTokenizer.from_pretrained(classifier_dir)
    encoded = tokenizer(text, return_tensors="pt")
    assert 512 < encoded["input_ids"].shape[1] <= 1024
    assert_pipelines_predict_our_logits(classifier_dir, tagger_dir, text, encoded)


def assert_pipelines_predict_our_logits(classifier_dir, tagger_dir, text: str, encoded) -> None:
    """HF's text- and token-classification pipelines on our exports say what our heads' logits say of `text`
    (`encoded`: its tokenizer's encoding): the labels, and the scores within 1e-5."""
    ours, _ = load_classifier(classifier_dir, 3, require_head=True)
    with torch.no_grad():
        probabilities = ours.eval()(encoded["input_ids"], None, encoded["attention_mask"]).softmax(-1)[0]
    answer = transformers.pipeline("text-classification", model=str(classifier_dir), device="cpu")(text)[0]
    assert answer["label"] == LABELS[int(probabilities.argmax())]
    assert answer["score"] == pytest.approx(float(probabilities.max()), abs=1e-5)

    ours, _ = load_classifier(tagger_dir, 3, require_head=True, heads=TOKEN_CLASSIFIERS)
    with torch.no_grad():
        probabilities = ours.eval()(encoded["input_ids"], None, encoded["attention_mask"]).softmax(-1)[0]
    tags = transformers.pipeline("token-classification", model=str(tagger_dir), device="cpu")(text)
    assert len(tags) == encoded["input_ids"].shape[1] - 2  # every token but the two special ones
    for tag in tags:
        assert tag["entity"] == LABELS[int(probabilities[tag["index"]].argmax())]
        assert tag["score"] == pytest.approx(float(probabilities[tag["index"]].max()), abs=1e-5)



def test_a_directory_without_the_tasks_head_gets_a_fresh_one_or_is_refused_where_one_is_required(inits, exports):
    from safetensors.torch import load_file

    from workflow.cli import UserError

    with pytest.raises(UserError, match=r"no classifier\.\* weights: not a fine-tuned ModernBertForSequenceClass"):
        load_classifier(inits["cls"], 3, require_head=True)  # a masked-LM directory
    other_task = exports("classification", "mean")
    with pytest.raises(UserError, match="its classifier has 3 outputs, the task 1"):
        load_classifier(other_task, 1, require_head=True)
    model, _ = load_classifier(other_task, 1)  # its classifier dropped, the rest of its head kept
    state = load_file(str(other_task / "model.safetensors"))
    assert torch.equal(model.head.dense.weight, state["head.dense.weight"]) and model.classifier.out_features == 1


@pytest.mark.parametrize("head", HEADS)
def test_the_unpadded_path_takes_its_tokens_from_the_host_and_gives_the_rows_logits(inits, head, monkeypatch):
    from workflow.train.models import kit
    import workflow.train.models.modernbert as modernbert

    model, _ = {"squad": lambda d: load_qa_model(d),
                "token_classification": lambda d: load_classifier(d, 3, heads=TOKEN_CLASSIFIERS),
                "regression": lambda d: load_classifier(d, 1)}.get(head, lambda d: load_classifier(d, 3))(inits["mean"])
    model.eval()
    task = finetuning.FeatureTask(features(head, inits["vocab"], 4), ("input_ids", "token_type_ids", "attention_mask"),
                                  (), 4, 0)
    task.rows_host_indices = directory_family(inits["mean"]).rows_host_indices
    batch = task.read(0, 4)
    with torch.no_grad():
        rows = outputs(model, batch)
        # The unpadded (CUDA) path on CPU in fp32 through the varlen op's CPU reference; unpad on the device would fail.
        monkeypatch.setattr(kit, "VARLEN_DEVICE_TYPES", ("cuda", "cpu"))
        monkeypatch.setattr(modernbert, "VARLEN_DTYPES", (torch.float32,))
        monkeypatch.setattr(modernbert, "unpad", lambda *_: pytest.fail("unpadded on the device"))
        unpadded = model(*task.inputs(batch))
    unpadded = torch.stack(unpadded, -1) if isinstance(unpadded, tuple) else unpadded
    if rows.dim() > 2:  # padding's logits are no one's
        rows, unpadded = rows[batch["attention_mask"].bool()], unpadded[batch["attention_mask"].bool()]
    assert (rows - unpadded).abs().max() < 1e-5


def snakemake_dry_run(root, target: str, overlay: dict) -> subprocess.CompletedProcess:
    (root / "overlay.yaml").write_text(json.dumps(overlay))
    return subprocess.run([sys.executable, "-m", "snakemake", target, "-n", "-p", "--configfile", "sample/config.yaml",
                           "overlay.yaml"], cwd=root, env=snakemake_env(), capture_output=True, text=True, timeout=300)


def test_glue_from_a_modernbert_directory_plans_its_tokenizer_json_and_a_dle_checkpoint_is_refused(inits,
                                                                                                 workflow_copy):
    # vocab.type left at wordpiece: the directory's own tokenizer.json makes the features
    result = snakemake_dry_run(workflow_copy, "glue", {"glue": {"init_from": str(inits["cls"]), "tasks": ["SST-2"]}})
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"--vocab {inits['cls'] / 'tokenizer.json'}" in result.stdout and "rule pretrain" not in result.stdout

    (workflow_copy / "ckpt.pt").write_bytes(b"")
    result = snakemake_dry_run(workflow_copy, "squad", {
        "squad": {"init_from": "ckpt.pt"}, "vocab": {"type": "bpe"}, "encode": {"objective": "full_sentences"},
        "model": {"family": "modernbert", "preset": "modernbert-tiny"}})
    assert result.returncode != 0
    assert ("config key 'squad.init_from': ckpt.pt is a file, read as an NVIDIA DLE checkpoint, which model.family "
            "modernbert does not read; it fine-tunes from a Hugging Face directory (config.json, model.safetensors)"
            ) in result.stdout + result.stderr


def test_squad_and_glue_run_through_the_rules_from_a_modernbert_directory(inits, workflow_copy):
    """ModernBERT's heads fine-tuned and scored by the rules themselves (issue 44 item 6), as BERT's are: SQuAD's
    EM/F1 are the official metric of its predictions, GLUE's SST-2 scores every dev example; the features made with
    the directory's own tokenizer.json, nothing pretrained."""
    squad_and_glue_through_the_rules(inits["cls"], workflow_copy, "modernbert")


def squad_and_glue_through_the_rules(init, workflow_copy, model_type: str) -> None:
    """SQuAD and GLUE's SST-2 fine-tuned from the HF directory `init` (of `model_type`) and scored by the rules."""
    from tests.conftest import official_squad_v11

    overlay = {"squad": {"init_from": str(init), "epochs": 1},
               "glue": {"init_from": str(init), "tasks": ["SST-2"], "epochs": 1}}
    (workflow_copy / "overlay.yaml").write_text(json.dumps(overlay))
    result = subprocess.run([sys.executable, "-m", "snakemake", "squad", "glue", "--cores", "2", "--configfile",
                             "sample/config.yaml", "overlay.yaml"], cwd=workflow_copy, env=snakemake_env(),
                            capture_output=True, text=True, timeout=900)  # ~100 s alone
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rule pretrain" not in result.stdout + result.stderr
    evaluation = json.loads((workflow_copy / "results/squad/eval.json").read_text())
    predictions = json.loads((workflow_copy / "results/squad/predictions.json").read_text())
    official = official_squad_v11(json.loads((workflow_copy / "sample/squad/dev-sample.json").read_text()),
                                  predictions)
    assert (evaluation["total"], evaluation["missing"]) == (45, 0)
    assert (evaluation["exact_match"], evaluation["f1"]) == pytest.approx(
        (official["exact_match"], official["f1"]), abs=1e-9)
    scored = json.loads((workflow_copy / "results/glue/SST-2/eval.json").read_text())
    dev = (workflow_copy / "sample/glue/SST-2/dev.tsv").read_text().strip().splitlines()[1:]
    assert scored["task"] == "SST-2" and scored["splits"]["dev"]["examples"] == len(dev), scored
    assert json.loads((workflow_copy / "results/glue/SST-2/model/config.json").read_text())["model_type"] == \
        model_type
