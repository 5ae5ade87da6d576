"""Answer-span selection from start/end logits: run_squad.py's rules, n-best lists and the SQuAD 2.0 null threshold."""
import json

import numpy as np
import pytest

from workflow.data import features as feature_files
from workflow.squad import data as squad_data
from workflow.squad.predict import postprocess

WORDS = "the cat sat on mat today . where did what ? a b c d e f g h i j k l m n o p".split()
CONTEXT = "The cat sat on the mat today."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    vocab = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    return feature_files.load_tokenizer(vocab, lowercase=True)


def _one(tokenizer, context=CONTEXT, question="where did the cat sit ?", version="1.1", impossible=False,
         max_seq_length=32, doc_stride=16, max_query_length=8):
    answers = [] if impossible else [{"text": "mat", "answer_start": context.index("mat")}]
    example = squad_data.SquadExample("q1", question, context, answers, impossible)
    features = squad_data.featurize([example], tokenizer, max_seq_length, doc_stride, max_query_length,
                                     training=False)
    return [example], features


def _position(features, example, word, feature=0, occurrence=0):
    """Token position of the `occurrence`-th context token whose text is `word` in window `feature`."""
    hits = [i for i, (s, e) in enumerate(features["offsets"][feature])
            if s >= 0 and example.context[s:e].lower() == word]
    return hits[occurrence]


def _logits(features, peaks):
    logits = np.full(features["input_ids"].shape, -10.0, dtype=np.float32)
    for (feature, position), value in peaks.items():
        logits[feature, position] = value
    return logits


def test_best_valid_span_is_the_text_between_its_offsets(tokenizer):
    examples, features = _one(tokenizer)
    start = _logits(features, {(0, _position(features, examples[0], "the", occurrence=1)): 5.0})
    end = _logits(features, {(0, _position(features, examples[0], "mat")): 5.0})
    predictions, nbest, _ = postprocess(examples, features, start, end, n_best_size=5, max_answer_length=30)
    assert predictions == {"q1": "the mat"}
    entries = nbest["q1"]
    assert entries[0]["text"] == "the mat" and entries[0]["start_logit"] == 5.0 and entries[0]["end_logit"] == 5.0
    assert sum(e["probability"] for e in entries) == pytest.approx(1.0)
    assert len({e["text"] for e in entries}) == len(entries) <= 5
    assert [e["probability"] for e in entries] == sorted((e["probability"] for e in entries), reverse=True)


def test_question_tokens_reversed_and_overlong_spans_are_skipped(tokenizer):
    examples, features = _one(tokenizer)
    cat, sat, mat, today = (_position(features, examples[0], w) for w in ("cat", "sat", "mat", "today"))

    def predict(start_peaks, end_peaks, max_answer_length=30):
        start, end = _logits(features, start_peaks), _logits(features, end_peaks)
        return postprocess(examples, features, start, end, 20, max_answer_length)[0]["q1"]

    # [CLS] and question tokens are not context
    assert predict({(0, 0): 9.0, (0, 1): 9.0, (0, mat): 1.0}, {(0, 0): 9.0, (0, 2): 9.0, (0, mat): 1.0}) == "mat"
    # mat..cat (score 16) ends before it starts
    assert predict({(0, mat): 8.0, (0, cat): 1.0}, {(0, cat): 8.0}) == "cat"
    # cat..today (16) is 6 tokens long
    assert predict({(0, cat): 8.0}, {(0, today): 8.0, (0, sat): 1.0}, max_answer_length=3) == "cat sat"
    assert predict({(0, cat): 8.0}, {(0, today): 8.0, (0, sat): 1.0}) == "cat sat on the mat today"


def test_a_span_counts_only_from_the_window_where_its_start_has_most_context(tokenizer):
    context = "a b c d e f g h i j k l m n o p the mat"
    examples, features = _one(tokenizer, context=context, question="what ?", max_seq_length=16, doc_stride=4)
    example = examples[0]
    windows = len(features["input_ids"])
    assert windows > 2
    # "h" appears in several windows; give every window the same strong span h..h, but a weaker span
    # elsewhere; the prediction must be "h" (from its max-context window), never a span starting at "h"
    # in another window with a bigger score.
    peaks_start, peaks_end = {}, {}
    for f in range(windows):
        positions = [i for i, (s, e) in enumerate(features["offsets"][f]) if s >= 0 and context[s:e] == "h"]
        for p in positions:
            is_max = bool(features["token_is_max_context"][f, p])
            peaks_start[(f, p)] = 3.0 if is_max else 9.0
            peaks_end[(f, p)] = 3.0 if is_max else 9.0
    start, end = _logits(features, peaks_start), _logits(features, peaks_end)
    _, nbest, _ = postprocess(examples, features, start, end, n_best_size=20, max_answer_length=30)
    best = nbest["q1"][0]
    assert best["text"] == "h" and best["start_logit"] == 3.0  # the 9.0 copies were rejected


def test_squad2_predicts_no_answer_when_the_null_score_wins_by_the_threshold(tokenizer):
    examples, features = _one(tokenizer, version="2.0")
    mat = _position(features, examples[0], "mat")
    start = _logits(features, {(0, 0): 4.0, (0, mat): 3.0})
    end = _logits(features, {(0, 0): 4.0, (0, mat): 3.0})  # null 8.0, best span 6.0: difference 2.0
    predictions, nbest, null_odds = postprocess(examples, features, start, end, version="2.0",
                                                null_score_diff_threshold=1.0)
    assert predictions == {"q1": ""} and null_odds == {"q1": pytest.approx(2.0)}
    assert "" in {e["text"] for e in nbest["q1"]}
    predictions, _, _ = postprocess(examples, features, start, end, version="2.0", null_score_diff_threshold=2.5)
    assert predictions == {"q1": "mat"}


def test_outputs_are_json_serialisable_and_deterministic(tokenizer):
    examples, features = _one(tokenizer)
    rng = np.random.default_rng(0)
    start = rng.normal(size=features["input_ids"].shape).astype(np.float32)
    end = rng.normal(size=features["input_ids"].shape).astype(np.float32)
    first = json.dumps(postprocess(examples, features, start, end))
    assert first == json.dumps(postprocess(examples, features, start.copy(), end.copy()))
