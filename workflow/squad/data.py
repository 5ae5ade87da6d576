"""SQuAD data: read and validate a SQuAD v1.1/v2.0 JSON file, turn it into BERT question-answering features.

A feature is one window of `[CLS] question [SEP] context-window [SEP]` (RoBERTa's vocab: `<s> question </s></s>
context-window </s>`, workflow.data.layout), `max_seq_length` tokens, windows `doc_stride` tokens apart (Google's
run_squad.py). Character->token alignment uses the `tokenizers` offsets.
A training answer outside a window is labelled (0, 0), i.e. [CLS], as the reference implementations do.

    python -m workflow.squad.data --input data/download/squad/train.json --vocab data/vocab.txt \
        --version 1.1 --split train --output data/squad/train_features.npz
        [--tokenizer-config MODEL/tokenizer_config.json]   (the fine-tuned model's casing; else --[no-]lowercase)
"""
import argparse
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
from tqdm import tqdm

from workflow.cli import UserError, run
from workflow.data.features import add_tokenizer_arguments, save_features, tokenizer_from_args
from workflow.data.layout import SequenceLayout

log = logging.getLogger(__name__)

# The "version" field of the official files, per config squad.version.
FILE_VERSIONS = {"1.1": {"1.1", "v1.1"}, "2.0": {"2.0", "v2.0"}}


@dataclass
class SquadExample:
    """One question about one context. `answers` are {"text", "answer_start"} dicts (empty if impossible)."""

    qas_id: str
    question: str
    context: str
    answers: list = field(default_factory=list)
    is_impossible: bool = False


def _require(mapping, key, kind, where):
    if not isinstance(mapping, dict):
        raise UserError(f"{where}: expected a JSON object, found {type(mapping).__name__}")
    if key not in mapping:
        raise UserError(f"{where}: missing key {key!r}")
    value = mapping[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or isinstance(value, bool):
        expected = " or ".join(k.__name__ for k in kinds)
        raise UserError(f"{where}: key {key!r} is {type(value).__name__}, expected {expected}")
    return value


def parse_squad(data: dict, version: str, source: str = "<squad>") -> list[SquadExample]:
    """Validate a loaded SQuAD JSON document and return its examples in file order.

    Raises UserError naming `source` and the question id (or its position when the id itself is missing)
    for a wrong version, a missing key, or an answer whose `answer_start` is outside the context or does
    not point at the answer text.
    """
    if version not in FILE_VERSIONS:
        raise UserError(f"unknown SQuAD version {version!r} (expected 1.1 or 2.0)")
    if not isinstance(data, dict):
        raise UserError(f"{source}: not a SQuAD JSON object")
    file_version = data.get("version")
    if str(file_version) not in FILE_VERSIONS[version]:
        raise UserError(
            f"{source}: SQuAD version {file_version!r} in the file, but config squad.version is {version!r}"
        )
    examples: list[SquadExample] = []
    seen: set[str] = set()
    for a, article in enumerate(_require(data, "data", list, source)):
        for p, paragraph in enumerate(_require(article, "paragraphs", list, f"{source}: data[{a}]")):
            where_paragraph = f"{source}: data[{a}].paragraphs[{p}]"
            context = _require(paragraph, "context", str, where_paragraph)
            for q, qa in enumerate(_require(paragraph, "qas", list, where_paragraph)):
                where = f"{where_paragraph}.qas[{q}]"
                qas_id = str(_require(qa, "id", (str, int), where))
                where = f"{source}: question id {qas_id!r}"
                if qas_id in seen:
                    raise UserError(f"{where}: duplicate question id")
                seen.add(qas_id)
                question = _require(qa, "question", str, where)
                is_impossible = False
                if version == "2.0":
                    is_impossible = bool(qa.get("is_impossible", False))
                answers = _require(qa, "answers", list, where)
                if not answers and not is_impossible:
                    raise UserError(f"{where}: no answers (and not marked is_impossible)")
                if is_impossible and answers:
                    raise UserError(f"{where}: marked is_impossible but has answers")
                checked = []
                for n, answer in enumerate(answers):
                    text = _require(answer, "text", str, f"{where} answers[{n}]")
                    start = _require(answer, "answer_start", int, f"{where} answers[{n}]")
                    if not text.strip():
                        raise UserError(f"{where} answers[{n}]: empty answer text")
                    if start < 0 or start + len(text) > len(context):
                        raise UserError(
                            f"{where} answers[{n}]: answer_start {start} (+{len(text)} chars) is outside "
                            f"the context ({len(context)} chars)"
                        )
                    if context[start : start + len(text)] != text:
                        raise UserError(
                            f"{where} answers[{n}]: answer_start {start} points at "
                            f"{context[start:start + len(text)]!r}, not the answer text {text!r}"
                        )
                    checked.append({"text": text, "answer_start": start})
                examples.append(SquadExample(qas_id, question, context, checked, is_impossible))
    if not examples:
        raise UserError(f"{source}: no questions")
    return examples


def load_squad(path: str | Path, version: str) -> list[SquadExample]:
    """Read and validate a SQuAD JSON file (see parse_squad)."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except OSError as error:
        raise UserError(f"{path}: cannot read: {error.strerror}") from error
    except json.JSONDecodeError as error:
        raise UserError(f"{path}: not valid JSON: {error}") from error
    return parse_squad(data, version, str(path))


def doc_spans(n_tokens: int, max_tokens_for_doc: int, doc_stride: int) -> list[tuple[int, int]]:
    """(start, length) windows over the context tokens, as Google's run_squad.py slides them."""
    spans, start = [], 0
    while start < n_tokens:
        length = min(n_tokens - start, max_tokens_for_doc)
        spans.append((start, length))
        if start + length == n_tokens:
            break
        start += min(length, doc_stride)
    return spans or [(0, 0)]


def max_context_flags(spans: list[tuple[int, int]], span_index: int) -> np.ndarray:
    """Per token of window `span_index`: is this the window where the token has the most context?"""
    start, length = spans[span_index]
    flags = np.zeros(length, dtype=bool)
    for i in range(length):
        position = start + i
        best_score, best_index = None, None
        for j, (other_start, other_length) in enumerate(spans):
            end = other_start + other_length - 1
            if position < other_start or position > end:
                continue
            score = min(position - other_start, end - position) + 0.01 * other_length
            if best_score is None or score > best_score:
                best_score, best_index = score, j
        flags[i] = best_index == span_index
    return flags


def char_span_to_tokens(offsets: Sequence[tuple[int, int]], start_char: int, end_char: int) -> tuple[int, int]:
    """Context-token span covering characters [start_char, end_char), or (-1, -1) if no token overlaps."""
    non_empty = [i for i, (s, e) in enumerate(offsets) if e > s]
    start = next((i for i in non_empty if offsets[i][1] > start_char), -1)
    end = next((i for i in reversed(non_empty) if offsets[i][0] < end_char), -1)
    if start < 0 or end < start:
        return -1, -1
    return start, end


def featurize(
    examples: list[SquadExample],
    tokenizer,
    max_seq_length: int = 384,
    doc_stride: int = 128,
    max_query_length: int = 64,
    training: bool = False,
) -> dict[str, np.ndarray]:
    """BERT QA features of `examples` as arrays (one row per window).

    Always: input_ids, token_type_ids, attention_mask [N, L]; example_index [N]; example_ids (qas ids, per
    example); start_positions, end_positions [N] (labels of the first answer; 0 = [CLS] when the answer is
    outside the window or the question is impossible). Evaluation features (training=False) also hold
    offsets [N, L, 2] (character span of each context token, -1 elsewhere) and token_is_max_context [N, L].
    """
    layout = SequenceLayout.of(tokenizer)
    max_tokens_for_doc = max_seq_length - max_query_length - layout.specials(paired=True)
    if max_tokens_for_doc < 1:
        raise UserError(f"max_seq_length {max_seq_length} leaves no room for the context after "
                        f"max_query_length {max_query_length}")
    contexts = sorted({e.context for e in examples})
    encoded_contexts = dict(zip(contexts, tokenizer.encode_batch(contexts, add_special_tokens=False)))
    questions = tokenizer.encode_batch([e.question for e in examples], add_special_tokens=False)

    rows: dict[str, list] = {k: [] for k in ("input_ids", "token_type_ids", "attention_mask", "start_positions",
                                             "end_positions", "example_index", "offsets", "token_is_max_context")}
    for index, (example, question) in enumerate(tqdm(list(zip(examples, questions)), desc="featurize", unit="q",
                                                     disable=None)):
        query_ids = question.ids[:max_query_length]
        context = encoded_contexts[example.context]
        doc_ids, doc_offsets = context.ids, context.offsets
        answer_start = answer_end = -1
        if example.answers and not example.is_impossible:
            first = example.answers[0]
            answer_start, answer_end = char_span_to_tokens(
                doc_offsets, first["answer_start"], first["answer_start"] + len(first["text"])
            )
        spans = doc_spans(len(doc_ids), max_seq_length - len(query_ids) - layout.specials(paired=True), doc_stride)
        for span_index, (span_start, span_length) in enumerate(spans):
            # one compact numpy row per window: python lists of ints would take GBs for SQuAD's 88k questions
            ids = np.full(max_seq_length, layout.pad, dtype=np.int32)
            doc_offset = layout.second_start(len(query_ids))
            length = doc_offset + span_length + 1
            ids[:length] = layout.row(query_ids, doc_ids[span_start : span_start + span_length])
            types = np.zeros(max_seq_length, dtype=np.int8)
            types[doc_offset:length] = layout.second_type
            mask = np.zeros(max_seq_length, dtype=np.int8)
            mask[:length] = 1
            rows["input_ids"].append(ids)
            rows["token_type_ids"].append(types)
            rows["attention_mask"].append(mask)
            span_end = span_start + span_length - 1
            if answer_start >= 0 and span_start <= answer_start and answer_end <= span_end:
                rows["start_positions"].append(answer_start - span_start + doc_offset)
                rows["end_positions"].append(answer_end - span_start + doc_offset)
            else:
                rows["start_positions"].append(0)
                rows["end_positions"].append(0)
            rows["example_index"].append(index)
            if not training:
                offsets = np.full((max_seq_length, 2), -1, dtype=np.int32)
                if span_length:
                    offsets[doc_offset : doc_offset + span_length] = doc_offsets[span_start : span_start + span_length]
                flags = np.zeros(max_seq_length, dtype=bool)
                flags[doc_offset : doc_offset + span_length] = max_context_flags(spans, span_index)
                rows["offsets"].append(offsets)
                rows["token_is_max_context"].append(flags)

    features = {
        "input_ids": np.stack(rows["input_ids"]),
        "token_type_ids": np.stack(rows["token_type_ids"]),
        "attention_mask": np.stack(rows["attention_mask"]),
        "start_positions": np.asarray(rows["start_positions"], dtype=np.int32),
        "end_positions": np.asarray(rows["end_positions"], dtype=np.int32),
        "example_index": np.asarray(rows["example_index"], dtype=np.int32),
        "example_ids": np.asarray([e.qas_id for e in examples], dtype=np.str_),
    }
    if not training:
        features["offsets"] = np.stack(rows["offsets"])
        features["token_is_max_context"] = np.stack(rows["token_is_max_context"])
    return features


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="SQuAD JSON file")
    parser.add_argument("--output", required=True, help="features .npz")
    parser.add_argument("--version", default="1.1", choices=sorted(FILE_VERSIONS))
    parser.add_argument("--split", choices=["train", "dev"], default="dev",
                        help="train: training features (labels, no offsets); dev: evaluation features")
    add_tokenizer_arguments(parser)
    parser.add_argument("--max-seq-length", type=int, default=384)
    parser.add_argument("--doc-stride", type=int, default=128)
    parser.add_argument("--max-query-length", type=int, default=64)
    args = parser.parse_args(argv)

    examples = load_squad(args.input, args.version)
    tokenizer = tokenizer_from_args(args)
    features = featurize(
        examples, tokenizer, args.max_seq_length, args.doc_stride, args.max_query_length, args.split == "train"
    )
    save_features(args.output, features)
    labelled = int((features["start_positions"] > 0).sum())
    log.info(
        "%d questions -> %d features (%d with the answer inside the window) -> %s",
        len(examples), len(features["input_ids"]), labelled, args.output,
    )


if __name__ == "__main__":
    run(main)
