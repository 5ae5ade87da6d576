"""The SQuAD evaluator equals hand-computed EM/F1 (official v1.1/v2.0 semantics)."""
import json
import subprocess
import sys

import pytest

from workflow.squad.evaluate import evaluate, exact_match_score, f1_score, normalize_answer


def _dataset(questions, version="1.1"):
    """A one-paragraph SQuAD dataset: questions = [(id, [answer texts])] (answer_start is not evaluated)."""
    qas = [{"id": qid, "question": "?", "answers": [{"text": t, "answer_start": 0} for t in answers]}
           for qid, answers in questions]
    return {"version": version, "data": [{"title": "t", "paragraphs": [{"context": "c", "qas": qas}]}]}


@pytest.mark.parametrize("raw, normalised", [
    ("Paris", "paris"),                                   # lower-case
    ("U.S.A.", "usa"),                                    # punctuation stripped, not replaced by spaces
    ("rock-and-roll!", "rockandroll"),
    ("The Eiffel Tower", "eiffel tower"),                 # articles a/an/the removed (after lower-casing)
    ("an apple a day", "apple day"),
    ("theatre Anna anthem", "theatre anna anthem"),       # only whole-word articles
    ("the, the.", ""),                                    # punctuation goes first, then the articles
    ("  New \t York\n City ", "new york city"),           # whitespace collapsed
])
def test_normalize_answer_applies_each_official_rule(raw, normalised):
    assert normalize_answer(raw) == normalised


def test_exact_match_after_normalisation():
    assert exact_match_score("the  Denver Broncos.", "Denver broncos") == 1.0
    assert exact_match_score("Denver", "Denver Broncos") == 0.0


@pytest.mark.parametrize("prediction, truth, f1", [
    ("the big red dog", "a red dog barked", 2 / 3),       # 2 common of 3 and 3: P = R = 2/3
    ("dog dog dog", "dog cat", 0.4),                       # multiset overlap 1: P 1/3, R 1/2 -> 0.4
    ("Broncos", "Denver Broncos", 2 / 3),                 # P 1, R 1/2
    ("rock and roll", "rock-and-roll", 0.0),              # hyphens vanish: one token "rockandroll"
    ("", "Denver", 0.0),                                   # v1.1: empty prediction scores 0
])
def test_f1_token_level(prediction, truth, f1):
    assert f1_score(prediction, truth) == pytest.approx(f1)


def test_dataset_scores_take_the_max_over_ground_truths_and_average_over_all_questions():
    dataset = _dataset([
        ("q1", ["Denver Broncos", "The Broncos", "Broncos"]),  # "Broncos team": F1 max(1/2, 2/3, 2/3), EM 0
        ("q2", ["Santa Clara, California", "Levi's Stadium"]),  # "levis stadium" EM 1 via the second answer
        ("q3", ["1990"]),                                        # wrong: 0, 0
        ("q4", ["gold"]),                                        # no prediction: 0, 0, still counted
    ])
    predictions = {"q1": "Broncos team", "q2": "levis stadium", "q3": "1991"}
    result = evaluate(dataset, predictions)
    assert result["total"] == 4 and result["missing"] == 1
    assert result["exact_match"] == pytest.approx(100 * 1 / 4)
    assert result["f1"] == pytest.approx(100 * (2 / 3 + 1) / 4)


def test_squad2_splits_has_answer_and_no_answer_questions():
    dataset = _dataset([
        ("h1", ["Normandy", "in Normandy"]),  # "Normandy": 1, 1
        ("h2", ["10th century"]),             # "10th and 11th centuries": P 1/4, R 1/2 -> 1/3; EM 0
        ("h3", ["the"]),                      # normalises to nothing -> gold "" (still a HasAns question)
        ("n1", []),                           # unanswerable, predicted "": 1, 1
        ("n2", []),                           # unanswerable, predicted a span: 0, 0
    ], version="v2.0")
    predictions = {"h1": "Normandy", "h2": "10th and 11th centuries", "h3": "", "n1": "", "n2": "France"}
    result = evaluate(dataset, predictions, version="2.0")
    assert result["HasAns_total"] == 3 and result["NoAns_total"] == 2 and result["total"] == 5
    assert result["HasAns_exact_match"] == pytest.approx(100 * 2 / 3)
    assert result["HasAns_f1"] == pytest.approx(100 * (1 + 1 / 3 + 1) / 3)
    assert result["NoAns_exact_match"] == pytest.approx(50.0)
    assert result["NoAns_f1"] == pytest.approx(50.0)
    assert result["exact_match"] == pytest.approx(100 * 3 / 5)
    assert result["f1"] == pytest.approx(100 * (1 + 1 / 3 + 1 + 1) / 5)


def test_squad2_empty_prediction_against_an_answer_scores_zero():
    assert f1_score("", "Normandy", version="2.0") == 0.0
    assert f1_score("", "", version="2.0") == 1.0


def test_cli_writes_eval_json_and_rejects_bad_predictions(tmp_path, repo_env):
    dataset = tmp_path / "dev.json"
    dataset.write_text(json.dumps(_dataset([("q1", ["The Moon"]), ("q2", ["Neil Armstrong"])])))
    predictions = tmp_path / "predictions.json"
    predictions.write_text(json.dumps({"q1": "moon", "q2": "Armstrong"}))
    output = tmp_path / "eval.json"
    command = [sys.executable, "-m", "workflow.squad.evaluate", "--dataset", str(dataset),
               "--predictions", str(predictions), "--output", str(output)]
    subprocess.run(command, check=True, env=repo_env, capture_output=True)
    result = json.loads(output.read_text())
    assert result["exact_match"] == pytest.approx(50.0)
    assert result["f1"] == pytest.approx(100 * (1 + 2 / 3) / 2)

    predictions.write_text(json.dumps(["not", "a", "mapping"]))
    output.unlink()
    failed = subprocess.run(command, env=repo_env, capture_output=True, text=True)
    assert failed.returncode == 1
    assert failed.stderr.strip().splitlines()[-1].startswith(f"error: {predictions}")
    assert not output.exists()
