"""Read a task's labelled (or, for `test`, unlabelled) examples from CSV, TSV, JSONL or CoNLL, one at a time.

CSV and TSV have a header row naming the fields (TSV: tab-separated, no quoting). JSONL: one JSON object per line.
CoNLL (tokens only): the word is the first column, the tag the last, a blank line ends a sentence, `-DOCSTART-`
lines are skipped. Token examples hold a list of words and a list of tags (JSONL: the text field is a list of words,
the label field a list of tags). Every bad record is one UserError naming file:line and the config key; a labelled
file's empty label or tag is one (an unlabelled row is not skipped: it would silently shrink the training set).

API:
    Example(line, texts, label)         line: where the example starts (1-based); texts: 1 or 2 strings, or (words,)
    read_examples(path, form, fields, label_field, key, tokens=False, labelled=True) -> iterator of Example
"""
import csv
import json
from dataclasses import dataclass
from typing import Iterator

from workflow.cli import UserError


@dataclass(frozen=True)
class Example:
    line: int
    texts: tuple
    label: object  # a label name, a number (as text), a list of tags, or None (a test file)


def _open(path):
    try:
        return open(path, encoding="utf-8", newline="")
    except OSError as error:
        raise UserError(f"{path}: cannot read: {error.strerror}") from error


def _field(record: dict, name: str, path, line: int, key: str):
    value = record.get(name)
    if value is None:
        raise UserError(f"{path}:{line}: no field {name!r} (config key '{key}')")
    return value


def _rows(path, form: str) -> Iterator[tuple[int, dict]]:
    """(line, record) of a CSV, TSV or JSONL file."""
    with _open(path) as handle:
        if form == "jsonl":
            for line, text in enumerate(handle, 1):
                if not text.strip():
                    continue
                try:
                    record = json.loads(text)
                except json.JSONDecodeError as error:
                    raise UserError(f"{path}:{line}: not valid JSON: {error.msg}") from None
                if not isinstance(record, dict):
                    raise UserError(f"{path}:{line}: not a JSON object")
                yield line, record
            return
        reader = csv.DictReader(handle, delimiter="\t" if form == "tsv" else ",",
                                quoting=csv.QUOTE_NONE if form == "tsv" else csv.QUOTE_MINIMAL)
        try:
            start = 2
            for record in reader:
                yield start, record
                start = reader.line_num + 1
        except csv.Error as error:
            raise UserError(f"{path}:{reader.line_num}: {error}") from None


def _conll(path) -> Iterator[tuple[int, list[list[str]]]]:
    """(first line, [columns per word]) of each sentence of a CoNLL file."""
    sentence, start = [], None
    with _open(path) as handle:
        for line, text in enumerate(handle, 1):
            columns = text.split()
            if columns and columns[0] == "-DOCSTART-":
                continue
            if columns:
                start = start or line
                sentence.append(columns)
            elif sentence:
                yield start, sentence
                sentence, start = [], None
    if sentence:
        yield start, sentence


def _token_example(path, line, words, tags, key: str, labelled: bool) -> Example:
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words) or not words:
        raise UserError(f"{path}:{line}: the words are not a non-empty list of strings (config key '{key}')")
    if labelled and (not isinstance(tags, list) or len(tags) != len(words)):
        raise UserError(f"{path}:{line}: {len(words)} words but tags {tags!r:.60} (config key '{key}')")
    if labelled and any(not str(tag).strip() for tag in tags):
        raise UserError(f"{path}:{line}: an empty tag (config key '{key}'; every word needs one)")
    return Example(line, (words,), [str(tag) for tag in tags] if labelled else None)


def read_examples(path, form: str, fields: list, label_field: str, key: str, tokens: bool = False,
                  labelled: bool = True) -> Iterator[Example]:
    """The examples of `path`, streamed; `key` is the task's config key (tasks.<name>), named in errors."""
    if form == "conll":
        for line, sentence in _conll(path):
            if labelled and any(len(columns) < 2 for columns in sentence):
                raise UserError(f"{path}:{line}: a sentence has a word without a tag column (config key '{key}')")
            yield Example(line, ([columns[0] for columns in sentence],),
                          [columns[-1] for columns in sentence] if labelled else None)
        return
    for line, record in _rows(path, form):
        texts = tuple(_field(record, name, path, line, f"{key}.text_fields") for name in fields)
        label = _field(record, label_field, path, line, f"{key}.label_field") if labelled else None
        if tokens:
            yield _token_example(path, line, texts[0], label, f"{key}.label_field", labelled)
            continue
        if labelled and not str(label).strip():  # else a class "" of its own, or a float("") error
            raise UserError(f"{path}:{line}: the label field {label_field!r} is empty (config key '{key}.label_field'; "
                            "a labelled file needs a label on every row: remove the row or label it)")
        yield Example(line, tuple(str(text) for text in texts), None if label is None else str(label).strip())
