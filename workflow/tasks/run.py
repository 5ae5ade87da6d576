"""Fine-tune, evaluate and predict a task of the config's tasks section (classification, regression, token
classification); question answering runs through workflow.squad. Classification and regression run the shared
classification code (workflow.classify, as the GLUE presets do) on the task's SentenceTask; token classification adds
its own head and entity scores.

    python -m workflow.tasks.run finetune --config '{"seed": .., "glue": {..}, "squad": {..}, "tasks": {..}}' \
        --name ner --labels data/tasks/ner/labels.json --init results/pretrain/phase2/model \
        --features data/tasks/ner/train_features.npz --output results/tasks/ner/model --run-dir runs/tasks/ner
    python -m workflow.tasks.run evaluate --config .. --name ner --labels .. --model results/tasks/ner/model \
        --features data/tasks/ner/dev_features.npz --output results/tasks/ner/eval.json
    python -m workflow.tasks.run predict --config .. --name ner --labels .. --model results/tasks/ner/model \
        --features data/tasks/ner/test_features.npz --output results/tasks/ner/predictions.jsonl

eval.json: `{"task": NAME, "type": TYPE, "splits": {"dev": {METRIC: VALUE, ..., "examples": N}}}`, as GLUE's.
predictions.jsonl: one line per test example in file order, `{"line": L, "label": ..}` (regression: "score",
token classification: "tags", one per word).
"""
import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from workflow.atomic import write_json, write_text
from workflow.cli import UserError, config_sections, run
from workflow.data.features import load_features
from workflow.classify import evaluate as classify_evaluate
from workflow.classify.model import SEQUENCE_CLASSIFIERS, ClassifierSettings, job_of, load_classifier
from workflow.tasks.config import task_section
from workflow.tasks.data import sentence_task
from workflow.tasks.token_model import TOKEN_CLASSIFIERS, TokenTask
from workflow.tasks.tokens import IGNORE, entity_scores, word_tags
from workflow.train import finetune as finetuning
from workflow.train.finetune import FinetuneJob, finetune_parser

log = logging.getLogger(__name__)


def token_job(name: str, labels: list[str]) -> FinetuneJob:
    """The driver's view of a token classification task."""

    def make_task(features: dict, features_path: Path, s) -> TokenTask:
        if features.get("labels") is None or features["labels"].ndim != 2:
            raise UserError(f"{features_path}: no per-token labels (not token classification features)")
        return TokenTask(features, s.batch_size, s.seed)

    return FinetuneJob(
        config_key=f"tasks.{name}", section="glue", batch_key=f"tasks.{name}", unit="sentences", make_task=make_task,
        load_model=lambda init: load_classifier(init, len(labels), heads=TOKEN_CLASSIFIERS),
        fingerprint={"task": name, "labels": labels}, config_json=dict(
            finetuning_task=name,
            id2label=dict(enumerate(labels)), label2id={label: i for i, label in enumerate(labels)}))


def finetune(config: dict, name: str, labels, init, features, output, run_dir, vocab=None, metrics=None,
             device: str = "auto", threads: int | None = None) -> int:
    task = config["tasks"][name]
    settings = ClassifierSettings.from_section({"seed": config["seed"], "glue": task_section(config, name)}, "glue")
    job = (token_job(name, labels) if task["type"] == "token_classification" else
           job_of(sentence_task(task, name, labels), config_key=f"tasks.{name}", batch_key=f"tasks.{name}"))
    return finetuning.finetune(job, init, features, output, run_dir, settings, vocab, metrics, device, threads)


def _model(task: dict, labels, model_dir, device: str):
    import torch

    heads = TOKEN_CLASSIFIERS if task["type"] == "token_classification" else SEQUENCE_CLASSIFIERS
    model, _ = load_classifier(model_dir, len(labels) if labels else 1, require_head=True, heads=heads)
    device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                          "cpu" if device == "auto" else device)
    return model.to(device), device


def logits_of(task: dict, labels, model_dir, features: dict, batch_size: int, precision: str, device: str):
    from workflow.train.precision import resolve_precision

    model, device = _model(task, labels, model_dir, device)
    return classify_evaluate.compute_logits(model, features, batch_size, device,
                                            resolve_precision(precision, device, "glue.precision"))


def evaluate(config: dict, name: str, labels, model_dir, features_path, batch_size=128, precision="auto",
             device="auto") -> dict:
    """eval.json's content: the task's scores on its dev features."""
    task = config["tasks"][name]
    if task["type"] != "token_classification":
        result = classify_evaluate.evaluate(sentence_task(task, name, labels), model_dir, {"dev": features_path},
                                            batch_size, precision, device)
        return {**result, "type": task["type"]}
    features = load_features(features_path)
    logits = logits_of(task, labels, model_dir, features, batch_size, precision, device)
    gold = [[labels[i] for i in row[row != IGNORE]] for row in features["labels"]]
    predicted = word_tags(logits, features["labels"], labels)
    words = sum(len(tags) for tags in gold)
    correct = sum(g == p for gold_row, predicted_row in zip(gold, predicted) for g, p in zip(gold_row, predicted_row))
    scores = {**entity_scores(gold, predicted), "accuracy": correct / words, "examples": len(gold)}
    log.info("%s dev: %s", name, scores)
    return {"task": name, "type": task["type"], "splits": {"dev": scores}}


def predict(config: dict, name: str, labels, model_dir, features_path, batch_size=128, precision="auto",
            device="auto") -> list[dict]:
    """One record per test example, in file order."""
    task = config["tasks"][name]
    features = load_features(features_path)
    logits = logits_of(task, labels, model_dir, features, batch_size, precision, device)
    lines = features["line"].tolist()
    if task["type"] == "token_classification":
        return [{"line": line, "tags": tags} for line, tags in zip(lines, word_tags(logits, features["labels"], labels))]
    if task["type"] == "regression":
        return [{"line": line, "score": float(score)} for line, score in zip(lines, logits[:, 0])]
    return [{"line": line, "label": labels[i]} for line, i in zip(lines, logits.argmax(-1).tolist())]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    tuner = finetune_parser("fine-tune the task", "seed, glue, squad and tasks", "workflow.tasks.data",
                            "step, epoch, loss, accuracy, lr, grad_norm, seq_per_s")
    commands.add_parser("finetune", parents=[tuner], add_help=False)
    for command in ("evaluate", "predict"):
        sub = commands.add_parser(command)
        sub.add_argument("--config", required=True, type=config_sections, help="JSON of seed, glue, squad, tasks")
        sub.add_argument("--model", required=True, help="the fine-tuned model directory")
        sub.add_argument("--features", required=True, help="dev (evaluate) or test (predict) features .npz")
        sub.add_argument("--output", required=True, help="eval.json or predictions.jsonl")
        sub.add_argument("--batch-size", type=int, default=128)
        sub.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
        sub.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
        sub.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    for sub in commands.choices.values():
        sub.add_argument("--name", required=True, help="the task's name (its key under tasks)")
        sub.add_argument("--labels", required=True, help="the task's labels.json (workflow.tasks.data labels)")
    args = parser.parse_args(argv)
    with open(args.labels, encoding="utf-8") as handle:
        labels = json.load(handle)["labels"]
    if args.command == "finetune":
        code = finetune(args.config, args.name, labels, args.init, args.features, args.output, args.run_dir,
                        args.vocab, args.metrics, args.device, args.threads)
        if code:
            sys.exit(code)
        return
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    work = evaluate if args.command == "evaluate" else predict
    result = work(args.config, args.name, labels, args.model, args.features, args.batch_size, args.precision,
                  args.device)
    if args.command == "evaluate":
        write_json(args.output, result)
    else:
        write_text(args.output, "".join(json.dumps(record) + "\n" for record in result))


if __name__ == "__main__":
    run(main)
