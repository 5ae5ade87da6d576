"""SQuAD evaluation with the official scripts' semantics (v1.1 evaluate-v1.1.py, v2.0 evaluate-v2.0.py).

Answers are normalised (lower-case, strip punctuation, remove the articles a/an/the, collapse whitespace);
EM and token-level F1 take the maximum over a question's ground-truth answers; scores are percentages over
all questions of the dataset (a question without a prediction scores 0). SQuAD 2.0 adds the HasAns/NoAns
split; an unanswerable question's only ground truth is "" (and an empty prediction scores 1).

    python -m workflow.squad.evaluate --dataset data/download/squad/dev.json \
        --predictions results/squad/predictions.json --version 1.1 --output results/squad/eval.json
"""
import argparse
import collections
import json
import logging
import re
import string
from typing import Sequence

from workflow.atomic import write_json
from workflow.cli import UserError, run

log = logging.getLogger(__name__)

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower-case, strip punctuation, remove articles, collapse whitespace (in the official order)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match_score(prediction: str, ground_truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def f1_score(prediction: str, ground_truth: str, version: str = "1.1") -> float:
    """Token-level F1 of the normalised answers. v2.0: two empty answers agree (1), one empty scores 0."""
    prediction_tokens = normalize_answer(prediction).split()
    truth_tokens = normalize_answer(ground_truth).split()
    if version == "2.0" and (not prediction_tokens or not truth_tokens):
        return float(prediction_tokens == truth_tokens)
    common = collections.Counter(prediction_tokens) & collections.Counter(truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(truth_tokens)
    return 2 * precision * recall / (precision + recall)


def _questions(dataset: dict, source: str):
    """(id, ground-truth texts) of every question; v2.0 conventions applied by the caller."""
    try:
        for article in dataset["data"]:
            for paragraph in article["paragraphs"]:
                for qa in paragraph["qas"]:
                    yield str(qa["id"]), [answer["text"] for answer in qa["answers"]]
    except (KeyError, TypeError) as error:
        raise UserError(f"{source}: not a SQuAD dataset (missing key {error})") from error


def evaluate(dataset: dict, predictions: dict[str, str], version: str = "1.1", source: str = "<dataset>") -> dict:
    """EM and F1 (percent) of `predictions` (question id -> answer text) against a SQuAD dataset.

    Keys: exact_match, f1, total, missing; for v2.0 also HasAns_exact_match, HasAns_f1, HasAns_total and
    the same for NoAns.
    """
    scores: dict[str, list] = {"all": [], "HasAns": [], "NoAns": []}
    missing = 0
    for qas_id, truths in _questions(dataset, source):
        has_answer = bool(truths)  # the official split: by the raw answers list
        if version == "2.0":
            truths = [t for t in truths if normalize_answer(t)] or [""]
        if qas_id in predictions:
            prediction = predictions[qas_id]
            exact = max(exact_match_score(prediction, t) for t in truths)
            f1 = max(f1_score(prediction, t, version) for t in truths)
        else:
            log.warning("unanswered question %s will receive score 0", qas_id)
            missing += 1
            exact = f1 = 0.0
        scores["all"].append((exact, f1))
        scores["HasAns" if has_answer else "NoAns"].append((exact, f1))
    if not scores["all"]:
        raise UserError(f"{source}: no questions")

    def percent(pairs, i):
        return 100.0 * sum(p[i] for p in pairs) / len(pairs)

    result = {
        "version": version,
        "exact_match": percent(scores["all"], 0),
        "f1": percent(scores["all"], 1),
        "total": len(scores["all"]),
        "missing": missing,
    }
    if version == "2.0":
        for split in ("HasAns", "NoAns"):
            if scores[split]:
                result[f"{split}_exact_match"] = percent(scores[split], 0)
                result[f"{split}_f1"] = percent(scores[split], 1)
            result[f"{split}_total"] = len(scores[split])
    return result


def _load_json(path: str, what: str):
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except OSError as error:
        raise UserError(f"{path}: cannot read {what}: {error.strerror}") from error
    except json.JSONDecodeError as error:
        raise UserError(f"{path}: {what} is not valid JSON: {error}") from error


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", required=True, help="SQuAD dev JSON (ground truth)")
    parser.add_argument("--predictions", required=True, help="predictions.json: question id -> answer text")
    parser.add_argument("--version", default="1.1", choices=["1.1", "2.0"])
    parser.add_argument("--output", required=True, help="eval.json")
    args = parser.parse_args(argv)

    dataset = _load_json(args.dataset, "SQuAD dataset")
    predictions = _load_json(args.predictions, "predictions")
    if not isinstance(predictions, dict) or not all(isinstance(v, str) for v in predictions.values()):
        raise UserError(f"{args.predictions}: expected a JSON object of question id -> answer text")
    result = evaluate(dataset, predictions, args.version, args.dataset)
    write_json(args.output, result)
    log.info("EM %.2f  F1 %.2f  over %d questions -> %s", result["exact_match"], result["f1"], result["total"],
             args.output)


if __name__ == "__main__":
    run(main)
