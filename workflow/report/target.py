"""The held-out masked-LM accuracy curve of a pretraining run and its time to a target accuracy (MLPerf's measure).

API:
    accuracy_curve(phases) -> [dict]   phases: [(phase, metrics.jsonl records, summary.json dict)] in training order.
        Every held-out evaluation (the metrics lines with test_mlm_accuracy) as {phase, step, train_time_s (the phase's
        own training time), run_time_s (since the first phase began: earlier phases' train_time_s added),
        test_mlm_accuracy}; a phase's final evaluation (summary.json) closes its part when its last step was none.
        A phase trained before training times were recorded has none: its times, and every later one, are None.
    time_to_target(curve, target) -> dict | None   the first point at or above `target`, None when none reached it

Times are training time, summed over a run's resumed attempts (checkpointed), evaluation and checkpointing excluded,
so a run's time to target does not depend on how often it evaluates.
"""
from __future__ import annotations


def accuracy_curve(phases) -> list[dict]:
    curve, offset = [], 0.0
    for phase, records, summary in phases:
        points = [{"step": r["step"], "train_time_s": r.get("train_time_s"),
                   "test_mlm_accuracy": r["test_mlm_accuracy"]} for r in records if "test_mlm_accuracy" in r]
        if "test_mlm_accuracy" in summary and (not points or points[-1]["step"] < summary["steps"]):
            points.append({"step": summary["steps"], "train_time_s": summary.get("train_time_s"),
                           "test_mlm_accuracy": summary["test_mlm_accuracy"]})
        curve += [{"phase": phase, **point, "run_time_s": _add(offset, point["train_time_s"])} for point in points]
        offset = _add(offset, summary.get("train_time_s", points[-1]["train_time_s"] if points else 0.0))
    return curve


def _add(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def time_to_target(curve: list[dict], target: float) -> dict | None:
    return next((point for point in curve if point["test_mlm_accuracy"] >= target), None)


def describe(curve: list[dict], target: float) -> str:
    """One line: when the run reached `target`, or that it did not (and its best)."""
    reached = time_to_target(curve, target)
    if reached:
        after = "an unrecorded time" if reached["run_time_s"] is None else f"{reached['run_time_s']:.1f} s"
        return (f"held-out MLM accuracy {target:.3f} reached after {after} of training "
                f"({reached['phase']} step {reached['step']}: {reached['test_mlm_accuracy']:.4f})")
    best = max((point["test_mlm_accuracy"] for point in curve), default=float("nan"))
    return f"held-out MLM accuracy {target:.3f} not reached (best {best:.4f})"
