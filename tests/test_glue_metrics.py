"""The GLUE metrics, written in numpy, equal scikit-learn's and scipy's (what the GLUE reference calls) on the same
predictions, edge cases included; each task is scored with its own metrics."""
import numpy as np
import pytest
from scipy import stats
from sklearn import metrics as sk

from workflow.classify import metrics
from workflow.glue.data import TASKS


def binary_cases():
    rng = np.random.default_rng(7)
    labels = rng.integers(0, 2, 500)
    noisy = np.where(rng.random(500) < 0.3, 1 - labels, labels)
    yield "noisy", noisy, labels
    yield "all wrong", 1 - labels, labels
    yield "constant prediction", np.zeros(500, dtype=int), labels  # MCC's denominator is 0
    yield "no positives anywhere", np.zeros(20, dtype=int), np.zeros(20, dtype=int)  # F1's denominator is 0
    yield "biased", (rng.random(500) < 0.8).astype(int), labels


BINARY_CASES = list(binary_cases())


@pytest.mark.filterwarnings("ignore:A single label was found")
@pytest.mark.parametrize(("case", "predictions", "labels"), BINARY_CASES, ids=[c[0] for c in BINARY_CASES])
def test_classification_metrics_equal_scikit_learns(case, predictions, labels):
    assert metrics.accuracy(predictions, labels) == pytest.approx(sk.accuracy_score(labels, predictions), abs=1e-12)
    assert metrics.f1(predictions, labels) == pytest.approx(sk.f1_score(labels, predictions, zero_division=0),
                                                             abs=1e-12)
    assert metrics.matthews_corr(predictions, labels) == pytest.approx(sk.matthews_corrcoef(labels, predictions),
                                                                        abs=1e-12)


def test_multiclass_accuracy_equals_scikit_learns():
    rng = np.random.default_rng(3)
    labels, predictions = rng.integers(0, 3, 300), rng.integers(0, 3, 300)
    assert metrics.accuracy(predictions, labels) == pytest.approx(sk.accuracy_score(labels, predictions))


def test_correlations_equal_scipys_with_tied_scores():
    rng = np.random.default_rng(11)
    labels = np.round(rng.uniform(0, 5, 400) * 5) / 5  # STS-B gold scores repeat: ties in the ranks
    predictions = labels + rng.normal(0, 1.2, 400)
    predictions[:40] = np.round(predictions[:40])  # ties among the predictions too
    assert metrics.pearson(predictions, labels) == pytest.approx(stats.pearsonr(predictions, labels)[0], abs=1e-12)
    assert metrics.spearman(predictions, labels) == pytest.approx(stats.spearmanr(predictions, labels)[0],
                                                                   abs=1e-12)
    assert metrics.average_ranks(labels).tolist() == stats.rankdata(labels).tolist()


def test_each_task_is_scored_with_its_own_metrics():
    rng = np.random.default_rng(5)
    labels = rng.integers(0, 2, 100)
    logits = rng.normal(size=(100, 2))
    predictions = logits.argmax(-1)
    assert metrics.score(TASKS["CoLA"], logits, labels) == {
        "matthews_corr": pytest.approx(sk.matthews_corrcoef(labels, predictions)), "examples": 100}
    assert metrics.score(TASKS["MRPC"], logits, labels) == {
        "accuracy": pytest.approx(sk.accuracy_score(labels, predictions)),
        "f1": pytest.approx(sk.f1_score(labels, predictions)), "examples": 100}
    scores = rng.uniform(0, 5, 100)
    regression = scores[:, None] + rng.normal(0, 1, (100, 1))
    assert metrics.score(TASKS["STS-B"], regression, scores) == {
        "pearson": pytest.approx(stats.pearsonr(regression[:, 0], scores)[0]),
        "spearman": pytest.approx(stats.spearmanr(regression[:, 0], scores)[0]), "examples": 100}
    nli = rng.normal(size=(100, 3))
    three = rng.integers(0, 3, 100)
    assert metrics.score(TASKS["MNLI"], nli, three) == {
        "accuracy": pytest.approx(sk.accuracy_score(three, nli.argmax(-1))), "examples": 100}
