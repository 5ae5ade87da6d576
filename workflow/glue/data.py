"""GLUE data: read a task's TSV file as the GLUE distribution lays it out, turn it into BERT classification features.
GlueTask and featurize are the classification code every sentence (pair) task uses: the GLUE tasks (TASKS) are its
presets, a classification or regression task of the config's tasks section is one more (workflow.tasks.data).

The files are those `download_glue_data.py` writes: `<Task>/train.tsv`, `<Task>/dev.tsv` (MNLI: `dev_matched.tsv`
and `dev_mismatched.tsv`). Fields are tab-separated with no quoting (sentences contain `"`), so a line is split on
tabs, never parsed as CSV. Quirks kept as the reference processors (Google's run_classifier, HF's glue processors):
CoLA's train/dev have no header row; QQP has rows with missing fields, which are skipped (counted and logged);
MNLI's label is its last column (gold_label); STS-B's label is a float score (a regression task). Any other bad row
is one UserError naming file:line.

A feature row is `[CLS] a [SEP] (b [SEP])`, `max_seq_length` tokens, the longer of a/b truncated first (run_classifier).

    python -m workflow.glue.data --task MRPC --input data/download/glue/MRPC/train.tsv --vocab data/vocab.txt \
        --output data/glue/MRPC/train_features.npz [--tokenizer-config MODEL/tokenizer_config.json]
"""
import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from workflow.cli import UserError, run
from workflow.data.features import add_tokenizer_arguments, save_features, tokenizer_from_args

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GlueTask:
    """Where a task's fields are (0-based columns; -1: last), its labels (None: a float score) and its metrics."""

    name: str
    text_a: int
    text_b: int | None
    label: int
    labels: tuple[str, ...] | None
    metrics: tuple[str, ...]
    header: bool = True
    dev_splits: tuple[str, ...] = ("dev",)
    skip_short_rows: bool = False  # QQP: rows with missing fields are dropped, as the reference processors do

    @property
    def num_labels(self) -> int:
        return len(self.labels) if self.labels else 1


NLI = ("contradiction", "entailment", "neutral")
TASKS = {task.name: task for task in (
    GlueTask("CoLA", 3, None, 1, ("0", "1"), ("matthews_corr",), header=False),
    GlueTask("SST-2", 0, None, 1, ("0", "1"), ("accuracy",)),
    GlueTask("MRPC", 3, 4, 0, ("0", "1"), ("accuracy", "f1")),
    GlueTask("STS-B", 7, 8, 9, None, ("pearson", "spearman")),
    GlueTask("QQP", 3, 4, 5, ("0", "1"), ("accuracy", "f1"), skip_short_rows=True),
    GlueTask("MNLI", 8, 9, -1, NLI, ("accuracy",), dev_splits=("dev_matched", "dev_mismatched")),
    GlueTask("QNLI", 1, 2, 3, ("entailment", "not_entailment"), ("accuracy",)),
    GlueTask("RTE", 1, 2, 3, ("entailment", "not_entailment"), ("accuracy",)),
    GlueTask("WNLI", 1, 2, 3, ("0", "1"), ("accuracy",)),
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


def _truncate_pair(a: list, b: list, max_tokens: int) -> None:
    """Pop from the longer list until both fit (run_classifier's _truncate_seq_pair)."""
    while len(a) + len(b) > max_tokens:
        (a if len(a) > len(b) else b).pop()


def featurize(pairs: list[tuple[str, str | None]], labels: np.ndarray, tokenizer, max_seq_length: int = 128) -> dict:
    """input_ids, token_type_ids, attention_mask [N, max_seq_length] (int32/int8) and labels [N]."""
    cls_id, sep_id, pad_id = (tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]", "[PAD]"))
    if None in (cls_id, sep_id, pad_id):
        raise UserError("vocab lacks one of [CLS], [SEP], [PAD]")
    encoded_a = tokenizer.encode_batch([a for a, _ in pairs], add_special_tokens=False)
    paired = pairs[0][1] is not None
    encoded_b = tokenizer.encode_batch([b for _, b in pairs], add_special_tokens=False) if paired else None
    n = len(pairs)
    input_ids = np.full((n, max_seq_length), pad_id, dtype=np.int32)
    token_type_ids = np.zeros((n, max_seq_length), dtype=np.int8)
    attention_mask = np.zeros((n, max_seq_length), dtype=np.int8)
    for row in range(n):
        a = list(encoded_a[row].ids)
        b = list(encoded_b[row].ids) if paired else []
        _truncate_pair(a, b, max_seq_length - (3 if paired else 2))
        ids = [cls_id, *a, sep_id] + ([*b, sep_id] if paired else [])
        input_ids[row, :len(ids)] = ids
        token_type_ids[row, len(a) + 2:len(ids)] = 1
        attention_mask[row, :len(ids)] = 1
    return {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": attention_mask,
            "labels": labels}


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
