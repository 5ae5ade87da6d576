"""The run in one table: pretraining losses/accuracies/throughput per phase, the SQuAD EM/F1, the GLUE dev scores and
those of the config's own tasks.

    python -m workflow.report.summary --phase phase1=results/pretrain/phase1 --phase phase2=results/pretrain/phase2 \
        --squad-eval results/squad/eval.json --squad-metrics results/squad/finetune_metrics.jsonl \
        --glue-eval results/glue/MRPC/eval.json --target-mlm-accuracy 0.72 --output results/summary.csv
    python -m workflow.report.summary --print results/summary.csv      # the table, EM/F1 and where the report is

results/summary.csv has the columns stage, metric, value (one row per number; floats to 6 significant digits).
GLUE rows: stage `glue`, metric `<task>.<metric>` (MNLI's dev sets as the GLUE leaderboard names them: MNLI-m, MNLI-mm).
Rows of the config's tasks: stage `tasks`, metric `<name>.<metric>`.
A pretraining directory holds metrics.jsonl (one line per logged step) and summary.json (the phase's totals).
With --target-mlm-accuracy, stage `pretrain` rows: target_mlm_accuracy, time_to_target_s (training time of both phases
until the first held-out evaluation at or above it; `not reached` otherwise) and time_to_target_step (phase:step).
"""
import argparse
import csv
import io
import json
import logging
from pathlib import Path
from typing import Sequence

from workflow.atomic import write_text
from workflow.cli import UserError, phase_directory, run
from workflow.report.target import accuracy_curve, time_to_target

log = logging.getLogger(__name__)

# (metric in summary.csv, key in the phase's summary.json)
PHASE_TOTALS = [
    ("steps", "steps"), ("train_time_s", "train_time_s"), ("seq_per_s", "seq_per_s"),
    ("tokens_per_s", "tokens_per_s"), ("real_tokens_per_s", "real_tokens_per_s"), ("packed", "packed"),
    ("test_mlm_accuracy", "test_mlm_accuracy"),
    ("test_nsp_accuracy", "test_nsp_accuracy"), ("test_mlm_loss", "test_mlm_loss"), ("parameters", "parameters"),
    ("world_size", "world_size"), ("device", "device"), ("precision", "precision"),
]
# (metric in summary.csv, key of the last metrics.jsonl line)
PHASE_FINAL = [("final_loss", "loss"), ("final_mlm_loss", "mlm_loss"), ("final_nsp_loss", "nsp_loss"),
               ("final_mlm_accuracy", "mlm_accuracy")]
# GLUE dev split -> the name of its column in the GLUE leaderboard ("dev": the task's own name)
GLUE_SPLIT_NAMES = {"dev_matched": "-m", "dev_mismatched": "-mm"}
SQUAD_KEYS = ["exact_match", "f1", "total", "HasAns_exact_match", "HasAns_f1", "HasAns_total",
              "NoAns_exact_match", "NoAns_f1", "NoAns_total"]


def read_json(path: str | Path) -> dict:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise UserError(f"{path}: cannot read: {error.strerror}") from error
    except json.JSONDecodeError as error:
        raise UserError(f"{path}: not valid JSON: {error}") from error


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a JSONL file (blank lines skipped); UserError naming the line of a bad one."""
    records = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise UserError(f"{path}: cannot read: {error.strerror}") from error
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise UserError(f"{path}:{number}: not valid JSON: {error}") from error
    return records


def glue_rows(eval_json: str | Path, stage: str = "glue", result: dict | None = None) -> list[tuple[str, str, object]]:
    """(stage, "<task>.<metric>", value) rows of one task's eval.json (workflow.glue.evaluate, workflow.tasks.run)."""
    result = read_json(eval_json) if result is None else result
    if "task" not in result or not isinstance(result.get("splits"), dict):
        raise UserError(f"{eval_json}: not a GLUE evaluation (keys task, splits)")
    rows = []
    for split, scores in result["splits"].items():
        name = result["task"] + GLUE_SPLIT_NAMES.get(split, "")
        rows.extend((stage, f"{name}.{metric}", value) for metric, value in scores.items())
    return rows


def task_rows(eval_json: str | Path) -> list[tuple[str, str, object]]:
    """("tasks", "<name>.<metric>", value) rows of a task's results/tasks/<name>/eval.json: a classification,
    regression or token classification evaluation (as GLUE's), or a question-answering one (SQuAD's)."""
    result = read_json(eval_json)
    if "splits" in result:
        return glue_rows(eval_json, "tasks", result)
    name = Path(eval_json).parent.name
    return [("tasks", f"{name}.{key}", result[key]) for key in SQUAD_KEYS if key in result]


def summarize(pretrain: dict[str, str | Path], squad_eval: str | Path | None,
              squad_metrics: str | Path | None = None,
              glue_evals: Sequence[str | Path] = (), target: float | None = None,
              task_evals: Sequence[str | Path] = ()) -> list[tuple[str, str, object]]:
    """(stage, metric, value) rows: per phase its totals and final training numbers, the time to `target` held-out
    accuracy, then SQuAD, then GLUE, then the config's own tasks."""
    rows: list[tuple[str, str, object]] = []
    phases = []
    for phase, directory in pretrain.items():
        totals = read_json(Path(directory) / "summary.json")
        metrics = read_jsonl(Path(directory) / "metrics.jsonl")
        phases.append((phase, metrics, totals))
        for metric, key in PHASE_TOTALS:
            if key in totals:
                rows.append((phase, metric, totals[key]))
        if metrics:
            for metric, key in PHASE_FINAL:
                if key in metrics[-1]:
                    rows.append((phase, metric, metrics[-1][key]))
    if target is not None and phases:
        reached = time_to_target(accuracy_curve(phases), target)
        rows += [("pretrain", "target_mlm_accuracy", target),
                 ("pretrain", "time_to_target_s", ("not reached" if not reached else "not recorded"
                                                    if reached["run_time_s"] is None else reached["run_time_s"])),
                 ("pretrain", "time_to_target_step", f"{reached['phase']}:{reached['step']}" if reached else "")]
    if squad_metrics:
        records = read_jsonl(squad_metrics)
        if records:
            rows.append(("squad", "finetune_steps", records[-1]["step"]))
            rows.append(("squad", "finetune_final_loss", records[-1]["loss"]))
            rows.append(("squad", "finetune_seq_per_s", sum(r["seq_per_s"] for r in records) / len(records)))
    if squad_eval:
        result = read_json(squad_eval)
        rows.append(("squad", "version", result.get("version", "1.1")))
        for key in SQUAD_KEYS:
            if key in result:
                rows.append(("squad", key, result[key]))
    for path in glue_evals:
        rows.extend(glue_rows(path))
    for path in task_evals:
        rows.extend(task_rows(path))
    return rows


def _format(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def to_csv(rows: list[tuple[str, str, object]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["stage", "metric", "value"])
    for stage, metric, value in rows:
        writer.writerow([stage, metric, _format(value)])
    return buffer.getvalue()


def read_summary(path: str | Path) -> list[dict]:
    try:
        with open(path, newline="", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle))
    except OSError as error:
        raise UserError(f"{path}: cannot read: {error.strerror}") from error
    if rows and set(rows[0]) != {"stage", "metric", "value"}:
        raise UserError(f"{path}: not a summary table (columns stage, metric, value)")
    return rows


def render(rows: list[dict], report: str | Path = "report.html") -> str:
    """The table, aligned, then the SQuAD EM/F1 and GLUE lines and where the report is (or how to make it)."""
    width = max([len(r["stage"]) + len(r["metric"]) + 1 for r in rows] + [10])
    lines = [f"{r['stage'] + '.' + r['metric']:<{width}}  {r['value']}" for r in rows]
    squad = {r["metric"]: r["value"] for r in rows if r["stage"] == "squad"}
    if "exact_match" in squad and "f1" in squad:
        lines.append("")
        lines.append(f"SQuAD v{squad.get('version', '1.1')} dev: EM {float(squad['exact_match']):.2f}  "
                     f"F1 {float(squad['f1']):.2f}  ({squad.get('total', '?')} questions)")
    pretrain = {r["metric"]: r["value"] for r in rows if r["stage"] == "pretrain"}
    if "time_to_target_s" in pretrain:
        lines.append("")
        reached, step = pretrain["time_to_target_s"], pretrain["time_to_target_step"]
        when = {"not reached": "not reached", "not recorded": f"at a time not recorded ({step})"}.get(reached) \
            or f"{float(reached):.1f} s of training ({step})"
        lines.append(f"Time to held-out MLM accuracy {pretrain['target_mlm_accuracy']}: {when}")
    glue = [r["metric"].rsplit(".", 1) + [r["value"]] for r in rows if r["stage"] == "glue"]
    scores = [f"{task} {metric} {float(value):.4f}" for task, metric, value in glue if metric != "examples"]
    if scores:
        lines.append("GLUE dev: " + "  ".join(scores))
    tasks = [r["metric"].rsplit(".", 1) + [r["value"]] for r in rows if r["stage"] == "tasks"]
    scores = [f"{task} {metric} {float(value):.4f}" for task, metric, value in tasks
              if metric in ("accuracy", "macro_f1", "pearson", "spearman", "f1", "precision", "recall", "exact_match")]
    if scores:
        lines.append("Tasks dev: " + "  ".join(scores))
    report = Path(report)
    if report.is_file():
        lines.append(f"Report: {report.resolve()}")
    else:
        lines.append(f"Report: not built yet; `snakemake --report {report}` (with the run's --configfile) writes it")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--print", dest="print_path", metavar="CSV", help="print an existing summary.csv")
    parser.add_argument("--report", default="report.html", help="the report file --print points to")
    parser.add_argument("--phase", action="append", type=phase_directory, default=[], metavar="PHASE=DIR",
                        help="a pretraining result directory (metrics.jsonl, summary.json); repeatable")
    parser.add_argument("--squad-eval", help="results/squad/eval.json")
    parser.add_argument("--squad-metrics", help="fine-tuning metrics JSONL")
    parser.add_argument("--glue-eval", action="append", default=[], metavar="EVAL_JSON",
                        help="a GLUE task's results/glue/<task>/eval.json; repeatable")
    parser.add_argument("--task-eval", action="append", default=[], metavar="EVAL_JSON",
                        help="a task's results/tasks/<name>/eval.json (config tasks); repeatable")
    parser.add_argument("--target-mlm-accuracy", type=float, help="held-out MLM accuracy whose time to reach the "
                        "table gives (config pretrain.target_mlm_accuracy)")
    parser.add_argument("--output", help="summary.csv to write")
    args = parser.parse_args(argv)

    if args.print_path:
        print(render(read_summary(args.print_path), args.report))
        return
    if not args.output:
        parser.error("--output is required unless --print is given")
    rows = summarize(dict(args.phase), args.squad_eval, args.squad_metrics, args.glue_eval, args.target_mlm_accuracy,
                     args.task_eval)
    write_text(args.output, to_csv(rows))
    log.info("%d numbers -> %s", len(rows), args.output)


if __name__ == "__main__":
    run(main)
