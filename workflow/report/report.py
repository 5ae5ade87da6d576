"""Report figures from the metrics files (pandas + matplotlib, Agg backend) and the run's effective config.

    python -m workflow.report.report pretrain --phase phase1=results/pretrain/phase1 --phase phase2=results/pretrain/phase2 \
        --loss loss.png --accuracy mlm_accuracy.png --throughput throughput.png
    python -m workflow.report.report heldout --phase phase1=results/pretrain/phase1 ... --target 0.72 \
        --output heldout_accuracy.png
    python -m workflow.report.report telemetry --phase phase1=results/pretrain/phase1 ... --output gpu_telemetry.png
    python -m workflow.report.report squad --metrics results/squad/finetune_metrics.jsonl --eval results/squad/eval.json \
        --output squad.png
    python -m workflow.report.report config --json '{...}' --output config.yaml
    python -m workflow.report.report scaling --table results/scaling/scaling.csv --output scaling.png

A phase directory holds metrics.jsonl, summary.json and, only when a GPU was used, gpu_telemetry.csv; without
telemetry the figure says so instead of failing.
"""
import argparse
import json
import logging
import math
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from workflow.atomic import atomic_path, write_text  # noqa: E402
from workflow.cli import UserError, phase_directory, run  # noqa: E402
from workflow.report.summary import read_json, read_jsonl  # noqa: E402
from workflow.report.target import accuracy_curve, describe  # noqa: E402

log = logging.getLogger(__name__)

TELEMETRY_PANELS = [("power_w", "power (W)"), ("utilization_gpu_pct", "GPU utilisation (%)"),
                    ("memory_used_mib", "memory used (MiB)"), ("temperature_c", "temperature (°C)")]


def read_metrics(path: str | Path) -> pd.DataFrame:
    """A metrics JSONL file as a DataFrame sorted by step (UserError when missing, empty or without steps)."""
    path = Path(path)
    try:
        frame = pd.read_json(path, lines=True)
    except (OSError, ValueError) as error:
        raise UserError(f"{path}: cannot read metrics: {error}") from error
    if frame.empty or "step" not in frame:
        raise UserError(f"{path}: no metrics lines with a 'step'")
    return frame.sort_values("step", kind="stable").reset_index(drop=True)


def training_time(frame: pd.DataFrame, global_batch_size: int) -> pd.Series:
    """Seconds of training at each logged step, from the sequences and the throughput of each logging window (its
    steps x global_batch_size, or a batch-size warm-up's window_sequences)."""
    steps = frame["step"].diff().fillna(frame["step"].iloc[0])
    sequences = frame["window_sequences"] if "window_sequences" in frame else steps * global_batch_size
    return (sequences / frame["seq_per_s"].clip(lower=1e-9)).cumsum()


def _save(figure, output: str | Path) -> None:
    with atomic_path(output) as temporary:
        figure.savefig(temporary, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(figure)


def _phases(pairs: list[tuple[str, str]]) -> list[tuple[str, pd.DataFrame, dict]]:
    phases = []
    for phase, directory in pairs:
        directory = Path(directory)
        summary = {}
        if (directory / "summary.json").is_file():
            summary = json.loads((directory / "summary.json").read_text(encoding="utf-8"))
        phases.append((phase, read_metrics(directory / "metrics.jsonl"), summary))
    return phases


def plot_pretrain(pairs, loss_png, accuracy_png, throughput_png) -> None:
    """Loss curves (total, MLM, NSP), MLM accuracy and throughput over training time, one panel per phase."""
    figures = pretrain_figures(pairs)
    for name, output in (("loss", loss_png), ("accuracy", accuracy_png), ("throughput", throughput_png)):
        _save(figures[name], output)


def pretrain_figures(pairs) -> dict:
    """The figures of plot_pretrain, by name ("loss", "accuracy", "throughput"), unsaved."""
    phases = _phases(pairs)
    figures = {}
    figures["loss"], axes = plt.subplots(1, len(phases), figsize=(6 * len(phases), 4), squeeze=False)
    for axis, (phase, frame, _) in zip(axes[0], phases):
        for column, style in (("loss", "-"), ("mlm_loss", "--"), ("nsp_loss", ":")):
            if column in frame:
                axis.plot(frame["step"], frame[column], style, label=column)
        axis.set(title=f"{phase}: training loss", xlabel="step", ylabel="loss")
        axis.legend()
        axis.grid(alpha=0.3)

    figures["accuracy"], axis = plt.subplots(figsize=(7, 4))
    for phase, frame, _ in phases:
        if "mlm_accuracy" in frame:
            axis.plot(frame["step"], frame["mlm_accuracy"], label=phase)
    axis.set(title="masked-LM accuracy (training batches)", xlabel="step", ylabel="accuracy")
    axis.legend()
    axis.grid(alpha=0.3)

    figures["throughput"], axes = plt.subplots(1, len(phases), figsize=(6 * len(phases), 4), squeeze=False)
    for axis, (phase, frame, summary) in zip(axes[0], phases):
        batch = summary.get("global_batch_size")
        x = training_time(frame, batch) if batch else frame["step"]
        axis.plot(x, frame["seq_per_s"])
        title = f"{phase}: throughput"
        if "tokens_per_s" in frame:  # proportional to sequences/s, so a number in the title, not a second curve
            title += f" (mean {frame['tokens_per_s'].mean():,.0f} tokens/s)"
        axis.set(title=title, xlabel="training time (s)" if batch else "step", ylabel="sequences / s")
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
    return figures


def plot_heldout(pairs, target: float, output) -> None:
    """Held-out MLM accuracy against step and against training time, the target line, the time to target."""
    _save(heldout_figure(pairs, target), output)


def heldout_figure(pairs, target: float):
    """The figure of plot_heldout, unsaved: the accuracy curve (workflow/report/target.py) of each phase by step,
    and of the whole run by training time (later phases after earlier ones), the time to target as its title."""
    phases = [(phase, read_jsonl(Path(directory) / "metrics.jsonl"),
               read_json(Path(directory) / "summary.json") if (Path(directory) / "summary.json").is_file() else {})
              for phase, directory in pairs]
    curve = accuracy_curve(phases)
    figure, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4))
    for phase, _, _ in phases:
        points = [point for point in curve if point["phase"] == phase]
        accuracy = [point["test_mlm_accuracy"] for point in points]
        by_step.plot([point["step"] for point in points], accuracy, "o-", label=phase)
        timed = [point for point in points if point["run_time_s"] is not None]  # untimed: trained before times were kept
        by_time.plot([point["run_time_s"] for point in timed], [point["test_mlm_accuracy"] for point in timed], "o-",
                     label=phase)
    for axis in (by_step, by_time):
        axis.axhline(target, color="grey", linestyle="--", label=f"target {target:.3f}")
        axis.set_ylabel("held-out masked-LM accuracy")
        axis.legend()
        axis.grid(alpha=0.3)
    by_step.set(title="by step (each phase)", xlabel="step")
    by_time.set(title="by training time (the whole run)", xlabel="training time (s)")
    figure.suptitle(describe(curve, target))
    return figure


def plot_telemetry(pairs, output) -> None:
    """Power, utilisation, memory and temperature of every GPU over time; a note when no phase recorded any."""
    _save(telemetry_figure(pairs), output)


def telemetry_figure(pairs):
    """The figure of plot_telemetry, unsaved: a row per quantity, a column per phase that recorded telemetry."""
    frames = []
    for phase, directory in pairs:
        path = Path(directory) / "gpu_telemetry.csv"
        if path.is_file():
            frame = pd.read_csv(path)
            if not frame.empty:
                frame["phase"] = phase
                frames.append(frame)
    if not frames:
        figure, axis = plt.subplots(figsize=(7, 2))
        axis.axis("off")
        axis.text(0.5, 0.5, "No GPU telemetry: the pretraining phases ran without a GPU.", ha="center",
                  va="center", fontsize=12)
        return figure
    figure, axes = plt.subplots(len(TELEMETRY_PANELS), len(frames), figsize=(6 * len(frames), 2.6 * 4),
                                squeeze=False, sharex="col")
    for column, frame in enumerate(frames):
        # Every node records its GPUs (the host column): a line per host and GPU, the host named when several.
        frame = frame.assign(seconds=frame["time"] - frame["time"].min(), host=frame.get("host", ""))
        series = frame.groupby(["host", "gpu"])
        named = frame["host"].nunique() > 1
        for row, (key, label) in enumerate(TELEMETRY_PANELS):
            axis = axes[row][column]
            if key in frame:
                for (host, gpu), part in series:
                    axis.plot(part["seconds"], part[key], label=f"{host} GPU {gpu}" if named else f"GPU {gpu}",
                              linewidth=0.8)
            axis.set_ylabel(label)
            axis.grid(alpha=0.3)
        axes[0][column].set_title(f"{frame['phase'].iloc[0]}: GPU telemetry")
        axes[-1][column].set_xlabel("time (s)")
        if series.ngroups <= 8:
            axes[0][column].legend(fontsize=7)
    return figure


def plot_squad(metrics, eval_json, output) -> None:
    """Fine-tuning loss over steps, with the dev EM/F1 in the title."""
    _save(squad_figure(metrics, eval_json), output)


def squad_figure(metrics, eval_json):
    """The figure of plot_squad, unsaved."""
    frame = read_metrics(metrics)
    result = json.loads(Path(eval_json).read_text(encoding="utf-8"))
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(frame["step"], frame["loss"])
    axis.set(title=f"SQuAD v{result.get('version', '1.1')} fine-tuning: dev EM {result['exact_match']:.2f}, "
                   f"F1 {result['f1']:.2f}", xlabel="step", ylabel="loss (start/end cross-entropy)")
    axis.grid(alpha=0.3)
    return figure


def plot_scaling(table, output) -> None:
    """Throughput against world size (with ideal linear scaling from the smallest layout) and efficiency."""
    _save(scaling_figure(table), output)


def scaling_figure(table):
    """The figure of plot_scaling, unsaved: sequences/s and efficiency by world size, a line per phase."""
    frame = pd.read_csv(table)
    figure, (throughput, efficiency) = plt.subplots(1, 2, figsize=(12, 4))
    for phase, rows in frame.groupby("phase"):
        rows = rows.sort_values("world_size")
        line, = throughput.plot(rows["world_size"], rows["seq_per_s"], "o-", label=f"{phase} measured")
        base = rows.iloc[0]
        throughput.plot(rows["world_size"], base["seq_per_s"] * rows["world_size"] / base["world_size"], "--",
                        color=line.get_color(), alpha=0.5, label=f"{phase} ideal (linear)")
        efficiency.plot(rows["world_size"], rows["efficiency"], "o-", label=phase)
        for _, row in rows.iterrows():
            throughput.annotate(row["layout"], (row["world_size"], row["seq_per_s"]), fontsize=8,
                                textcoords="offset points", xytext=(4, -10))
    throughput.set(title="throughput by layout", xlabel="world size (GPUs)", ylabel="sequences / s")
    efficiency.set(title="scaling efficiency (speedup / GPU ratio)", xlabel="world size (GPUs)", ylabel="efficiency")
    efficiency.set_ylim(bottom=0)
    for axis in (throughput, efficiency):
        axis.set_xscale("log", base=2)
        axis.set_xticks(sorted(frame["world_size"].unique()), [str(n) for n in sorted(frame["world_size"].unique())])
        axis.minorticks_off()
        axis.legend()
        axis.grid(alpha=0.3)
    return figure


def _to_yaml(value, indent=0) -> str:
    """A small YAML writer for the config (dicts, lists, scalars), keys in the config's own order."""
    pad = "  " * indent
    lines = []
    for key, item in value.items():
        if isinstance(item, dict):
            lines.append(f"{pad}{key}:" + (" {}" if not item else ""))
            if item:
                lines.append(_to_yaml(item, indent + 1))
        else:
            lines.append(f"{pad}{key}: {_yaml_scalar(item)}")
    return "\n".join(lines)


def _yaml_scalar(value) -> str:
    """JSON spelling, except floats: YAML 1.1 reads 3e-05 as a string, so write 3.0e-05."""
    if isinstance(value, float) and math.isfinite(value):
        text = repr(value)
        mantissa, _, exponent = text.partition("e")
        if exponent and "." not in mantissa:
            text = f"{mantissa}.0e{exponent}"
        return text
    if isinstance(value, float):
        return ".nan" if math.isnan(value) else (".inf" if value > 0 else "-.inf")
    return json.dumps(value)


def write_config(config_json: str, output) -> None:
    try:
        config = json.loads(config_json)
    except json.JSONDecodeError as error:
        raise UserError(f"--json: not valid JSON: {error}") from error
    write_text(output, "# The effective configuration of this run (config.yaml + --configfile/--config).\n"
               + _to_yaml(config) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    pretrain = commands.add_parser("pretrain", help="loss, MLM accuracy and throughput plots")
    pretrain.add_argument("--phase", action="append", type=phase_directory, required=True, metavar="PHASE=DIR")
    pretrain.add_argument("--loss", required=True)
    pretrain.add_argument("--accuracy", required=True)
    pretrain.add_argument("--throughput", required=True)
    heldout = commands.add_parser("heldout", help="held-out MLM accuracy curve and the time to target")
    heldout.add_argument("--phase", action="append", type=phase_directory, required=True, metavar="PHASE=DIR")
    heldout.add_argument("--target", type=float, required=True, help="config pretrain.target_mlm_accuracy")
    heldout.add_argument("--output", required=True)
    telemetry = commands.add_parser("telemetry", help="GPU telemetry plot (or a note when there is none)")
    telemetry.add_argument("--phase", action="append", type=phase_directory, required=True, metavar="PHASE=DIR")
    telemetry.add_argument("--output", required=True)
    squad = commands.add_parser("squad", help="fine-tuning loss with the dev EM/F1")
    squad.add_argument("--metrics", required=True)
    squad.add_argument("--eval", required=True)
    squad.add_argument("--output", required=True)
    scaling = commands.add_parser("scaling", help="throughput and efficiency by layout (the scaling study)")
    scaling.add_argument("--table", required=True, help="results/scaling/scaling.csv")
    scaling.add_argument("--output", required=True)
    config = commands.add_parser("config", help="the effective config as YAML")
    config.add_argument("--json", required=True)
    config.add_argument("--output", required=True)
    args = parser.parse_args(argv)

    if args.command == "pretrain":
        plot_pretrain(args.phase, args.loss, args.accuracy, args.throughput)
    elif args.command == "heldout":
        plot_heldout(args.phase, args.target, args.output)
    elif args.command == "telemetry":
        plot_telemetry(args.phase, args.output)
    elif args.command == "squad":
        plot_squad(args.metrics, args.eval, args.output)
    elif args.command == "scaling":
        plot_scaling(args.table, args.output)
    else:
        write_config(args.json, args.output)


if __name__ == "__main__":
    run(main)
