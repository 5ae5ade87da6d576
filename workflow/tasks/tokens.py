"""Token classification (NER) without torch (the data env's): features that label the first sub-word of each word
(the others -100, ignored by the loss) and entity-level precision/recall/F1 as seqeval computes them (its default,
conlleval-style chunking of IOB/IOBES tags; micro-averaged over entity types; 0 where undefined). The head and the
training task are workflow.tasks.token_model's.

API:
    featurize_tokens(examples, tag_ids, tokenizer, max_seq_length, path, key) -> features (+ word_count per row)
    word_tags(logits, labels, id2label) -> one predicted tag list per row (its words' first sub-words)
    entities(tag_sequences) -> set of (type, start, end); entity_scores(gold, predicted) -> {precision, recall, f1}
"""
import logging

import numpy as np

from workflow.cli import UserError
from workflow.data.layout import SequenceLayout

log = logging.getLogger(__name__)
IGNORE = -100  # the label of sub-words after a word's first, of [CLS]/[SEP] and of padding


def featurize_tokens(examples, tag_ids: dict | None, tokenizer, max_seq_length: int, path, key: str) -> dict:
    """input_ids, token_type_ids, attention_mask, labels [N, max_seq_length] and word_count [N]; tag_ids None: an
    unlabelled (test) file, labels all -100 but first sub-words 0. A sentence longer than max_seq_length is refused."""
    layout = SequenceLayout.of(tokenizer)
    rows, labels, counts, empty_words = [], [], [], 0
    for example in examples:
        words = example.texts[0]
        encoding = tokenizer.encode(words, is_pretokenized=True, add_special_tokens=False)
        if len(encoding.ids) + 2 > max_seq_length:
            raise UserError(f"{path}:{example.line}: a sentence of {len(words)} words is {len(encoding.ids)} sub-words "
                            f"+ [CLS] and [SEP], over max_seq_length {max_seq_length} (config key "
                            f"'{key}.max_seq_length'; split the sentence or raise the key)")
        row_labels, previous = [IGNORE] * len(encoding.ids), None
        for position, word in enumerate(encoding.word_ids):
            if word is not None and word != previous:
                tag = example.label[word] if tag_ids is not None else None
                if tag is not None and tag not in tag_ids:
                    raise UserError(f"{path}:{example.line}: tag {tag!r} is not in the label list "
                                    f"({', '.join(tag_ids)}) (config key '{key}.labels')")
                row_labels[position] = tag_ids[tag] if tag is not None else 0
            previous = word
        empty_words += len(words) - len(set(w for w in encoding.word_ids if w is not None))
        rows.append(layout.row(encoding.ids))
        labels.append([IGNORE, *row_labels, IGNORE])
        counts.append(len(words))
    if empty_words:  # a word of control characters only: no sub-word to label; scored as absent
        log.warning("%s: %d words have no sub-word (control characters only); they are not scored", path, empty_words)
    n = len(rows)
    input_ids = np.full((n, max_seq_length), layout.pad, dtype=np.int32)
    label_ids = np.full((n, max_seq_length), IGNORE, dtype=np.int64)
    attention_mask = np.zeros((n, max_seq_length), dtype=np.int8)
    for row, (ids, tags) in enumerate(zip(rows, labels)):
        input_ids[row, :len(ids)], label_ids[row, :len(ids)], attention_mask[row, :len(ids)] = ids, tags, 1
    return {"input_ids": input_ids, "token_type_ids": np.zeros_like(attention_mask), "attention_mask": attention_mask,
            "labels": label_ids, "word_count": np.asarray(counts, dtype=np.int32)}


def word_tags(logits: np.ndarray, labels: np.ndarray, id2label: list) -> list[list[str]]:
    """Per row, the predicted tag of each labelled position (a word's first sub-word), in order."""
    predicted = logits.argmax(-1)
    return [[id2label[i] for i in predicted[row][labels[row] != IGNORE]] for row in range(len(labels))]


def _split_tag(tag: str) -> tuple[str, str]:
    return tag[0], tag[1:].split("-", maxsplit=1)[-1] or "_"


def entities(sequences: list[list[str]]) -> set:
    """(type, start, end) of each entity, the sentences joined with an `O` between them (seqeval's get_entities)."""
    tags = [tag for sentence in sequences for tag in [*sentence, "O"]]
    found, previous, previous_type, begin = set(), "O", "", 0
    for i, (tag, kind) in enumerate(map(_split_tag, tags + ["O"])):
        if (previous in "ES" or (previous in "BI" and tag in "BSO")
                or (previous not in ("O", ".") and previous_type != kind)):
            found.add((previous_type, begin, i - 1))
        if tag in "BS" or (previous in "ESO" and tag in "EI") or (tag not in ("O", ".") and previous_type != kind):
            begin = i
        previous, previous_type = tag, kind
    return found


def entity_scores(gold: list[list[str]], predicted: list[list[str]]) -> dict:
    """Entity-level micro precision, recall and F1 (seqeval's defaults: 0 where a denominator is 0)."""
    true, guessed = entities(gold), entities(predicted)
    hits = len(true & guessed)
    precision = hits / len(guessed) if guessed else 0.0
    recall = hits / len(true) if true else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1, "entities": len(true)}
