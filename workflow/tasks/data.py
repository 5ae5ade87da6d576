"""A task's data: its label list (data/tasks/<name>/labels.json) and its features, made with the fine-tuned model's
vocab and casing. Classification and regression are featurized by the shared classification code
(workflow.classify.features: one text or a pair, the longer text truncated first), as the GLUE presets are; such a
task is a SentenceTask made from its config entry. Token classification labels the first sub-word of each word
(workflow.tasks.tokens).

    python -m workflow.tasks.data labels --task '{"type": ...}' --name sentiment --output data/tasks/sentiment/labels.json
    python -m workflow.tasks.data featurize --task '{...}' --name sentiment --split train --labels LABELS_JSON \
        --vocab data/vocab.txt --max-seq-length 128 --output data/tasks/sentiment/train_features.npz

Features of a test file (no labels) hold `line` (the example's first line in the file) instead of labels.
"""
import argparse
import json
import logging
from typing import Sequence

import numpy as np

from workflow.atomic import write_json
from workflow.classify.features import featurize
from workflow.classify.task import SentenceTask
from workflow.cli import UserError, run
from workflow.data.features import add_tokenizer_arguments, save_features, tokenizer_from_args
from workflow.tasks.config import task_format
from workflow.tasks.readers import read_examples
from workflow.tasks.tokens import featurize_tokens

log = logging.getLogger(__name__)
METRICS = {"classification": ("accuracy", "macro_f1"), "regression": ("pearson", "spearman")}


def examples(task: dict, name: str, split: str, labelled: bool = True):
    """The examples of the task's `split` file (streamed)."""
    return read_examples(task[split], task_format(task), task["text_fields"], task["label_field"], f"tasks.{name}",
                         tokens=task["type"] == "token_classification", labelled=labelled)


def label_list(task: dict, name: str) -> list[str] | None:
    """The task's labels: `labels` if given, else those of its train file, sorted (None: a regression)."""
    if task["type"] == "regression":
        return None
    if task.get("labels"):
        return list(task["labels"])
    found = set()
    for example in examples(task, name, "train"):
        found.update(example.label if isinstance(example.label, list) else [example.label])
    if not found:
        raise UserError(f"{task['train']}: no examples (config key 'tasks.{name}.train')")
    return sorted(found)


def sentence_task(task: dict, name: str, labels: list[str] | None) -> SentenceTask:
    """The SentenceTask a classification or regression task is."""
    return SentenceTask(name, tuple(labels) if labels else None, METRICS[task["type"]])


def _class_rows(items, task: dict, name: str, split: str, labels: list | None, labelled: bool):
    """(text pairs, label ids or scores, lines) of a classification or regression file."""
    pairs, values, lines = [], [], []
    key = f"tasks.{name}"
    for example in items:
        pairs.append((example.texts[0], example.texts[1] if len(example.texts) > 1 else None))
        lines.append(example.line)
        if not labelled:
            continue
        if labels is None:
            try:
                values.append(float(example.label))
            except ValueError:
                raise UserError(f"{task[split]}:{example.line}: label {example.label!r} is not a number (config key "
                                f"'{key}.type': regression)") from None
        elif example.label in labels:
            values.append(labels.index(example.label))
        else:
            raise UserError(f"{task[split]}:{example.line}: label {example.label!r} is not in the label list "
                            f"({', '.join(labels)}) (config key '{key}.labels')")
    dtype = np.float32 if labels is None else np.int64
    return pairs, np.asarray(values if labelled else np.zeros(len(pairs)), dtype=dtype), lines


def task_features(task: dict, name: str, split: str, labels: list | None, tokenizer, max_seq_length: int) -> dict:
    """The features of the task's `split` file (train, dev: labelled; test: `line` instead of labels)."""
    labelled = split != "test"
    items = list(examples(task, name, split, labelled))
    if not items:
        raise UserError(f"{task[split]}: no examples (config key 'tasks.{name}.{split}')")
    if task["type"] == "token_classification":
        tag_ids = {tag: i for i, tag in enumerate(labels)} if labelled else None
        features = featurize_tokens(items, tag_ids, tokenizer, max_seq_length, task[split], f"tasks.{name}")
    else:
        pairs, values, _ = _class_rows(items, task, name, split, labels, labelled)
        features = featurize(pairs, values, tokenizer, max_seq_length)
    if not labelled:
        if task["type"] != "token_classification":  # token features keep their first sub-words' positions
            del features["labels"]
        features["line"] = np.asarray([example.line for example in items], dtype=np.int64)
    return features


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    labels = commands.add_parser("labels", help="the task's label list as JSON")
    featurizer = commands.add_parser("featurize", help="features .npz of one of the task's files")
    for command in (labels, featurizer):
        command.add_argument("--task", required=True, type=json.loads, help="the task's config entry as JSON")
        command.add_argument("--name", required=True, help="the task's name (its key under tasks)")
        command.add_argument("--output", required=True)
    featurizer.add_argument("--split", required=True, choices=["train", "dev", "test"])
    featurizer.add_argument("--labels", required=True, help="the task's labels.json")
    featurizer.add_argument("--max-seq-length", type=int, required=True)
    add_tokenizer_arguments(featurizer)
    args = parser.parse_args(argv)
    if args.command == "labels":
        found = label_list(args.task, args.name)
        write_json(args.output, {"labels": found})
        log.info("%s: labels %s -> %s", args.name, found, args.output)
        return
    with open(args.labels, encoding="utf-8") as handle:
        found = json.load(handle)["labels"]
    features = task_features(args.task, args.name, args.split, found, tokenizer_from_args(args), args.max_seq_length)
    save_features(args.output, features)
    log.info("%s %s: %d examples -> %s", args.name, args.split, len(features["input_ids"]), args.output)


if __name__ == "__main__":
    run(main)
