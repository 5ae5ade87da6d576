"""Your own tasks (config tasks) under Snakemake for real: a CSV sentiment task (with a test file) and a CoNLL NER task
fine-tuned from a stand-in phase-2 export; Hugging Face's Auto classes and pipeline() load each model and predict what
our evaluation scored; entity scores equal seqeval's; bad input stops in one line naming file, line and key; the
targets plan what the config names (no English download for a German corpus with SQuAD and GLUE off)."""
import csv
import io
import json
import random
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from seqeval import metrics as seqeval
from seqeval.metrics.sequence_labeling import precision_recall_fscore_support
from sklearn import metrics as sk

from tests.conftest import copy_workflow, official_squad_v11, snakemake_env
from workflow.cli import UserError
from workflow.data.features import load_features
from workflow.data.vocab import Normalization
from workflow.report import summary
from workflow.tasks import data as task_data
from workflow.tasks.config import task_config_error
from workflow.tasks.tokens import entity_scores
from workflow.train.models.bert import BertConfig, BertForPreTraining, save_pretrained

GOOD, BAD = "fine nice good fair".split(), "poor sad bad grim".split()
NAMES, CITIES = "anna berta carl dora".split(), "berlin bonn essen ulm".split()
WORDS = {"the", "day", "was", "said", "yesterday", "schmidt", "went", "to", ".", ",", *GOOD, *BAD, *NAMES, *CITIES}


def sentiment_csv(path, n, rng, labelled=True):
    lines = ["text,label" if labelled else "text"]
    for _ in range(n):
        positive = rng.random() < 0.5
        text = f'"the day was {rng.choice(GOOD if positive else BAD)}, said {rng.choice(NAMES)}"'
        lines.append(f"{text},{'pos' if positive else 'neg'}" if labelled else text)
    path.write_text("\n".join(lines) + "\n")


def ner_sentence(rng):
    return [("yesterday", "O"), (rng.choice(NAMES), "B-PER"), ("schmidt", "I-PER"), ("went", "O"), ("to", "O"),
            (rng.choice(CITIES), "B-LOC"), (".", "O")]


def ner_conll(path, n, rng):
    sentences = ["\n".join(f"{word} NN {tag}" for word, tag in ner_sentence(rng)) for _ in range(n)]
    path.write_text("-DOCSTART- -X- O\n\n" + "\n\n".join(sentences) + "\n")


TASKS = {"sentiment": {"type": "classification", "train": "own/train.csv", "dev": "own/dev.csv",
                       "test": "own/test.csv", "format": "csv", "text_fields": ["text"], "label_field": "label"},
         "ner": {"type": "token_classification", "train": "own/train.conll", "dev": "own/dev.conll", "epochs": 6},
         "qa": {"type": "question_answering", "train": "sample/squad/train-sample.json",
                "dev": "sample/squad/dev-sample.json", "epochs": 0.5, "max_seq_length": 64}}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """`snakemake tasks` on both tasks in a workflow copy, from a tiny randomly initialised phase-2 export."""
    root = copy_workflow(tmp_path_factory.mktemp("tasks"))
    rng = random.Random(0)
    (root / "own").mkdir()
    sentiment_csv(root / "own/train.csv", 120, rng)
    sentiment_csv(root / "own/dev.csv", 40, rng)
    sentiment_csv(root / "own/test.csv", 10, rng, labelled=False)
    ner_conll(root / "own/train.conll", 80, rng)
    ner_conll(root / "own/dev.conll", 30, rng)
    (root / "data").mkdir()
    (root / "data/vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(WORDS)]) + "\n")
    torch.manual_seed(0)
    config = BertConfig.preset("tiny", vocab_size=len(WORDS) + 5, max_position_embeddings=64)
    save_pretrained(BertForPreTraining(config), config, root / "data/vocab.txt",
                    root / "results/pretrain/phase2/model", normalization=Normalization(lowercase=True))
    (root / "own.yaml").write_text(json.dumps({
        "squad": {"enabled": False}, "tasks": TASKS,
        "glue": {"tasks": [], "learning_rate": 1e-3, "epochs": 4, "max_seq_length": 32, "batch_size": 16,
                 "micro_batch_size": 16}}))
    result = subprocess.run([sys.executable, "-m", "snakemake", "tasks", "--cores", "2", "--set-threads",
                             "task_finetune=1", "task_eval=1", "task_predict=1", "qa_task_finetune=1", "qa_task_predict=1",
                             "--configfile", "sample/config.yaml",
                             "own.yaml"], cwd=root, env=snakemake_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def test_a_classification_task_loads_in_hugging_face_and_predicts_what_we_scored(run):
    transformers = pytest.importorskip("transformers")
    model_dir = run / "results/tasks/sentiment/model"
    evaluation = json.loads((run / "results/tasks/sentiment/eval.json").read_text())
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    assert model.config.id2label == {0: "neg", 1: "pos"} and model.config.label2id == {"neg": 0, "pos": 1}
    features = load_features(run / "data/tasks/sentiment/dev_features.npz")
    with torch.no_grad():
        logits = model(**{k: torch.from_numpy(features[k].astype(np.int64))
                          for k in ("input_ids", "token_type_ids", "attention_mask")}).logits
    predicted = logits.argmax(-1).numpy()
    assert evaluation["splits"]["dev"] == {
        "accuracy": pytest.approx(sk.accuracy_score(features["labels"], predicted), abs=1e-9),
        "macro_f1": pytest.approx(sk.f1_score(features["labels"], predicted, average="macro"), abs=1e-9),
        "examples": 40}

    test_texts = (run / "own/test.csv").read_text().splitlines()[1:]
    ours = [json.loads(line) for line in (run / "results/tasks/sentiment/predictions.jsonl").read_text().splitlines()]
    assert [record["line"] for record in ours] == list(range(2, 12))
    classifier = transformers.pipeline("text-classification", model=str(model_dir), device="cpu")
    theirs = classifier([text.strip('"') for text in test_texts])
    assert [record["label"] for record in ours] == [answer["label"] for answer in theirs]


def test_a_token_task_scores_entities_as_seqeval_and_loads_in_hugging_face(run):
    transformers = pytest.importorskip("transformers")
    model_dir = run / "results/tasks/ner/model"
    evaluation = json.loads((run / "results/tasks/ner/eval.json").read_text())["splits"]["dev"]
    model = transformers.AutoModelForTokenClassification.from_pretrained(model_dir).eval()
    labels = [model.config.id2label[i] for i in range(model.config.num_labels)]
    assert labels == ["B-LOC", "B-PER", "I-PER", "O"]  # read from the train file, sorted

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    sentences = [[line.split() for line in block.splitlines()]
                 for block in (run / "own/dev.conll").read_text().split("\n\n")[1:]]
    gold, predicted = [], []
    for sentence in sentences:
        encoded = tokenizer([columns[0] for columns in sentence], is_split_into_words=True, return_tensors="pt")
        with torch.no_grad():
            tags = model(**encoded).logits[0].argmax(-1).tolist()
        words = encoded.word_ids()
        first = [i for i, word in enumerate(words) if word is not None and word != words[i - 1]]
        predicted.append([labels[tags[i]] for i in first])
        gold.append([columns[-1] for columns in sentence])
    assert evaluation == {"precision": pytest.approx(seqeval.precision_score(gold, predicted), abs=1e-9),
                          "recall": pytest.approx(seqeval.recall_score(gold, predicted), abs=1e-9),
                          "f1": pytest.approx(seqeval.f1_score(gold, predicted), abs=1e-9),
                          "accuracy": pytest.approx(seqeval.accuracy_score(gold, predicted), abs=1e-9),
                          "entities": 60, "examples": 30}
    assert evaluation["f1"] >= 0.9  # the name and city words are learnt (measured: 1.0)

    tagger = transformers.pipeline("token-classification", model=str(model_dir), device="cpu")
    words = [columns[0] for columns in sentences[0]]
    answer = tagger(" ".join(words))
    assert [entity["entity"] for entity in answer] == [tag for tag in predicted[0] if tag != "O"]

    rows = summary.summarize({}, None, None, (), None, [run / f"results/tasks/{name}/eval.json" for name in TASKS])
    table = {(stage, metric): value for stage, metric, value in rows}
    assert table[("tasks", "ner.f1")] == evaluation["f1"] and ("tasks", "sentiment.accuracy") in table
    printed = summary.render(list(csv.DictReader(io.StringIO(summary.to_csv(rows)))), "none.html")
    assert f"ner f1 {evaluation['f1']:.4f}" in printed.split("Tasks dev: ")[1]


def test_a_question_answering_task_runs_through_the_squad_code_and_is_scored_officially(run):
    evaluation = json.loads((run / "results/tasks/qa/eval.json").read_text())
    predictions = json.loads((run / "results/tasks/qa/predictions.json").read_text())
    official = official_squad_v11(json.loads((run / "sample/squad/dev-sample.json").read_text()), predictions)
    assert evaluation["total"] == len(predictions) > 0 and evaluation["missing"] == 0
    assert (evaluation["exact_match"], evaluation["f1"]) == pytest.approx((official["exact_match"], official["f1"]))
    assert not (run / "results/squad").exists()  # squad.enabled: false; the task has its own model
    config = json.loads((run / "results/tasks/qa/model/config.json").read_text())
    assert config["architectures"] == ["BertForQuestionAnswering"]
    rows = summary.summarize({}, None, None, (), None, [run / "results/tasks/qa/eval.json"])
    assert ("tasks", "qa.f1", evaluation["f1"]) in rows


def test_entity_scores_equal_seqevals_on_random_tag_sequences():
    rng = random.Random(1)
    tags = ["O", "B-PER", "I-PER", "E-PER", "S-PER", "B-LOC", "I-LOC", "I-MISC", "B", "I", "O"]
    for _ in range(200):
        gold = [[rng.choice(tags) for _ in range(rng.randint(1, 8))] for _ in range(rng.randint(1, 4))]
        predicted = [[rng.choice(tags) for _ in sentence] for sentence in gold]
        ours = entity_scores(gold, predicted)
        with warnings.catch_warnings():  # seqeval warns of tags that are not IOB ones ("B", "I")
            warnings.simplefilter("ignore")
            reference = precision_recall_fscore_support(gold, predicted, average="micro", zero_division=0)
        assert (ours["precision"], ours["recall"], ours["f1"]) == pytest.approx(reference[:3], abs=1e-12)


def featurize(tmp_path, task, split="train", labels=None, max_seq_length=32):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(WORDS)]) + "\n")
    (tmp_path / "labels.json").write_text(json.dumps({"labels": labels}))
    output = tmp_path / "out.npz"
    with pytest.raises(UserError) as error:
        task_data.main(["featurize", "--task", json.dumps(task), "--name", "mine", "--split", split, "--labels",
                        str(tmp_path / "labels.json"), "--vocab", str(vocab), "--max-seq-length",
                        str(max_seq_length), "--output", str(output)])
    assert not output.exists() and not list(tmp_path.glob("*.tmp*"))  # nothing that looks complete
    return str(error.value)


def entry(tmp_path, **keys):
    return {"type": "classification", "train": str(tmp_path / "train.csv"), "dev": str(tmp_path / "dev.csv"),
            "test": None, "format": None, "text_fields": ["text"], "label_field": "label", "labels": None, **keys}


def test_bad_input_stops_in_one_line_naming_the_file_line_and_key(tmp_path):
    (tmp_path / "dev.csv").write_text('text,label\n"a good day",pos\n"a\nbad day",meh\n')
    assert featurize(tmp_path, entry(tmp_path), "dev", ["neg", "pos"]) == (
        f"{tmp_path / 'dev.csv'}:3: label 'meh' is not in the label list (neg, pos) (config key 'tasks.mine.labels')")
    (tmp_path / "train.csv").write_text('words,label\n"a good day",pos\n')
    assert featurize(tmp_path, entry(tmp_path), "train", ["neg", "pos"]) == (
        f"{tmp_path / 'train.csv'}:2: no field 'text' (config key 'tasks.mine.text_fields')")
    (tmp_path / "train.csv").write_text("text,label\n")
    assert featurize(tmp_path, entry(tmp_path), "train", ["neg", "pos"]) == (
        f"{tmp_path / 'train.csv'}: no examples (config key 'tasks.mine.train')")
    with pytest.raises(UserError, match=re.escape(f"{tmp_path / 'train.csv'}: no examples (config key "
                                                  "'tasks.mine.train')")):
        task_data.label_list(entry(tmp_path), "mine")
    (tmp_path / "train.jsonl").write_text('{"tokens": ["anna"], "tags": ["B-PER"]}\n{"tokens": ["ulm"]}\n')
    tokens = entry(tmp_path, type="token_classification", train=str(tmp_path / "train.jsonl"),
                   text_fields=["tokens"], label_field="tags")
    assert featurize(tmp_path, tokens, "train", ["B-PER", "O"]) == (
        f"{tmp_path / 'train.jsonl'}:2: no field 'tags' (config key 'tasks.mine.label_field')")
    (tmp_path / "train.conll").write_text("anna B-PER\n\n" + "".join(f"{NAMES[i % 4]} B-PER\n" for i in range(20)))
    conll = entry(tmp_path, type="token_classification", train=str(tmp_path / "train.conll"))
    assert featurize(tmp_path, conll, "train", ["B-PER"], max_seq_length=16) == (
        f"{tmp_path / 'train.conll'}:3: a sentence of 20 words is 20 sub-words + [CLS] and [SEP], over "
        "max_seq_length 16 (config key 'tasks.mine.max_seq_length'; split the sentence or raise the key)")


@pytest.mark.parametrize("form, rows, line", [
    ("csv", 'text,label\n"a good day",pos\n"a bad day",\n', 3),
    ("tsv", "text\tlabel\na good day\tpos\na bad day\t \n", 3),
    ("jsonl", '{"text": "a good day", "label": "pos"}\n{"text": "a bad day", "label": ""}\n', 2)])
def test_an_empty_label_stops_in_one_line_naming_the_file_and_line(tmp_path, form, rows, line):
    # It became a class "" of its own: labels.json read ["", "pos"].
    (tmp_path / f"train.{form}").write_text(rows)
    task = entry(tmp_path, train=str(tmp_path / f"train.{form}"))
    message = (f"{tmp_path / f'train.{form}'}:{line}: the label field 'label' is empty (config key "
               "'tasks.mine.label_field'; a labelled file needs a label on every row: remove the row or label it)")
    with pytest.raises(UserError) as error:
        task_data.label_list(task, "mine")
    assert str(error.value) == message
    assert featurize(tmp_path, task, "train", ["neg", "pos"]) == message
    regression = entry(tmp_path, type="regression", train=str(tmp_path / f"train.{form}"))
    assert featurize(tmp_path, regression, "train").startswith(f"{tmp_path / f'train.{form}'}:{line}: the label field")
    (tmp_path / "train.jsonl").write_text('{"tokens": ["anna", "went"], "tags": ["B-PER", ""]}\n')
    tokens = entry(tmp_path, type="token_classification", train=str(tmp_path / "train.jsonl"),
                   text_fields=["tokens"], label_field="tags")
    assert featurize(tmp_path, tokens, "train", ["B-PER", "O"]) == (
        f"{tmp_path / 'train.jsonl'}:1: an empty tag (config key 'tasks.mine.label_field'; every word needs one)")


def test_a_task_named_as_a_glue_preset_is_refused_naming_the_key():
    config = {"glue": {"batch_size": 32, "micro_batch_size": 32}, "squad": {},
              "tasks": {"sst-2": {"type": "classification", "train": "a.csv", "dev": "b.csv"}}}
    assert task_config_error(config) == ("config key 'tasks.sst-2': the name of the GLUE preset SST-2 (list it in "
                                         "glue.tasks, or give your task another name)")


def planned_jobs(output: str) -> dict:
    table = output.split("Job stats:", 1)[1].split("total", 1)[0]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.MULTILINE)}


def dry_run(root, target, *configfiles):
    return subprocess.run([sys.executable, "-m", "snakemake", "-n", target, "--configfile", "sample/config.yaml",
                           *configfiles], cwd=root, env=snakemake_env(), capture_output=True, text=True, timeout=600)


def test_targets_plan_what_the_config_names(workflow_copy):
    (workflow_copy / "de").mkdir()
    (workflow_copy / "de/corpus.jsonl").write_text(json.dumps({"text": "Ein Satz. Noch ein Satz."}) + "\n")
    (workflow_copy / "german.yaml").write_text(json.dumps({
        "wikipedia": {"enabled": False}, "bookcorpus": {"enabled": False},
        "corpora": {"de": {"format": "jsonl", "path": "de/corpus.jsonl", "language": "de"}},
        "squad": {"enabled": False}, "glue": {"tasks": []}}))
    german = dry_run(workflow_copy, "all", "german.yaml")
    assert german.returncode == 0, german.stderr[-3000:]
    jobs = planned_jobs(german.stdout)
    assert [rule for rule in jobs if "download" in rule or rule.startswith(("squad", "glue"))] == []
    assert {"pretrain_phase", "summary", "report_pretrain_plots"} <= jobs.keys()

    pretraining = dry_run(workflow_copy, "pretrain")
    assert pretraining.returncode == 0, pretraining.stderr[-3000:]
    jobs = planned_jobs(pretraining.stdout)
    assert jobs["pretrain_phase"] == 2 and "report_heldout_accuracy" in jobs
    assert [rule for rule in jobs if rule.startswith(("squad", "glue", "task", "summary"))] == []

    everything = planned_jobs(dry_run(workflow_copy, "all").stdout)  # squad.enabled is true by default
    assert {"squad_download_train", "squad_eval", "report_squad_plot", "glue_eval"} <= everything.keys()
