"""GLUE data: the GLUE tasks as presets of the shared classification code (workflow.classify), and their TSV files
read as the GLUE distribution lays them out, turned into BERT classification features (workflow.classify.features).

The files are those `download_glue_data.py` writes: `<Task>/train.tsv`, `<Task>/dev.tsv` (MNLI: `dev_matched.tsv`
and `dev_mismatched.tsv`). Fields are tab-separated with no quoting (sentences contain `"`), so a line is split on
tabs, never parsed as CSV. Quirks kept as the reference processors (Google's run_classifier, HF's glue processors):
CoLA's train/dev have no header row; QQP has rows with missing fields, which are skipped (counted and logged);
MNLI's label is its last column (gold_label); STS-B's label is a float score (a regression task). Any other bad row
is one UserError naming file:line.

    python -m workflow.glue.data --task MRPC --input data/download/glue/MRPC/train.tsv --vocab data/vocab.txt \
        --output data/glue/MRPC/train_features.npz [--tokenizer-config MODEL/tokenizer_config.json]
"""
import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from workflow.classify.features import featurize
from workflow.classify.task import SentenceTask
from workflow.cli import UserError, run
from workflow.data.features import add_tokenizer_arguments, save_features, tokenizer_from_args

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GlueTask(SentenceTask):
    """A GLUE preset: a sentence task and where its TSV's fields are (0-based columns; -1: last)."""

    text_a: int = 0
    text_b: int | None = None
    label: int = -1
    header: bool = True
    dev_splits: tuple[str, ...] = ("dev",)
    skip_short_rows: bool = False  # QQP: rows with missing fields are dropped, as the reference processors do


BINARY = ("0", "1")
NLI = ("contradiction", "entailment", "neutral")
ENTAILMENT = ("entailment", "not_entailment")
TASKS = {task.name: task for task in (
    GlueTask("CoLA", BINARY, ("matthews_corr",), text_a=3, label=1, header=False),
    GlueTask("SST-2", BINARY, ("accuracy",), text_a=0, label=1),
    GlueTask("MRPC", BINARY, ("accuracy", "f1"), text_a=3, text_b=4, label=0),
    GlueTask("STS-B", None, ("pearson", "spearman"), text_a=7, text_b=8, label=9),
    GlueTask("QQP", BINARY, ("accuracy", "f1"), text_a=3, text_b=4, label=5, skip_short_rows=True),
    GlueTask("MNLI", NLI, ("accuracy",), text_a=8, text_b=9, label=-1, dev_splits=("dev_matched", "dev_mismatched")),
    GlueTask("QNLI", ENTAILMENT, ("accuracy",), text_a=1, text_b=2, label=3),
    GlueTask("RTE", ENTAILMENT, ("accuracy",), text_a=1, text_b=2, label=3),
    GlueTask("WNLI", BINARY, ("accuracy",), text_a=1, text_b=2, label=3),
)}


def task_of(name: str) -> GlueTask:
    if name not in TASKS:
        raise UserError(f"unknown GLUE task {name!r} (known: {', '.join(TASKS)})")
    return TASKS[name]


def _read_row(line: str, number: int, path, task: GlueTask, needed: int, pairs: list, labels: list) -> int:
    """Append one row's texts and label; 1 if it is a row with missing fields the task skips, else 0."""
    fields = line.split("\t")
    if len(fields) < needed:
        if task.skip_short_rows:
            return 1
        raise UserError(f"{path}:{number}: {len(fields)} tab-separated fields, {task.name} needs at least {needed}")
    text = fields[task.text_a], (fields[task.text_b] if task.text_b is not None else None)
    label = fields[task.label].strip()
    if task.labels is None:
        try:
            labels.append(float(label))
        except ValueError:
            raise UserError(f"{path}:{number}: label {label!r} is not a number ({task.name} is a regression "
                            "task)") from None
    elif label in task.labels:
        labels.append(task.labels.index(label))
    else:
        raise UserError(f"{path}:{number}: label {label!r} is not one of {', '.join(task.labels)}")
    pairs.append(text)
    return 0


def read_tsv(path: str | Path, task: GlueTask) -> tuple[list[tuple[str, str | None]], np.ndarray, int]:
    """(text pairs, labels (int64 class ids, or float32 scores), rows skipped) of a GLUE train/dev TSV file."""
    pairs, labels, skipped = [], [], 0
    # fields a row needs; a label in the last column (-1) comes after the texts
    needed = max(task.text_a, task.text_b or 0, task.label) + 1 + (task.label < 0)
    try:
        with open(path, "rb") as handle:  # binary: lines end at \n only (a stray \r inside a field stays there)
            for number, raw in enumerate(handle, 1):
                if number == 1 and task.header:
                    continue
                try:
                    line = raw.decode("utf-8").rstrip("\n").rstrip("\r")
                except UnicodeDecodeError as error:
                    raise UserError(f"{path}:{number}: not UTF-8 text ({error.reason})") from None
                skipped += _read_row(line, number, path, task, needed, pairs, labels)
    except OSError as error:
        raise UserError(f"{path}: cannot read: {error.strerror}") from error
    if not pairs:
        raise UserError(f"{path}: no {task.name} examples")
    if skipped:
        log.warning("%s: skipped %d rows with missing fields (as the GLUE reference processors do)", path, skipped)
    dtype = np.float32 if task.labels is None else np.int64
    return pairs, np.asarray(labels, dtype=dtype), skipped


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", required=True, choices=sorted(TASKS))
    parser.add_argument("--input", required=True, help="the task's train or dev TSV")
    parser.add_argument("--output", required=True, help="features .npz")
    add_tokenizer_arguments(parser)
    parser.add_argument("--max-seq-length", type=int, default=128)
    args = parser.parse_args(argv)
    task = task_of(args.task)
    pairs, labels, skipped = read_tsv(args.input, task)
    features = featurize(pairs, labels, tokenizer_from_args(args), args.max_seq_length)
    save_features(args.output, features)
    truncated = int((features["attention_mask"][:, -1] == 1).sum())
    log.info("%s %s: %d examples (%d rows skipped, %d filling all %d tokens) -> %s", task.name, args.input, len(pairs),
             skipped, truncated, args.max_seq_length, args.output)


if __name__ == "__main__":
    run(main)
