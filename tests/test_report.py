"""results/summary.csv, its printout, and the report figures made from the metrics files."""
import csv
import json
import subprocess
import sys

import matplotlib.pyplot as plt
import pytest
import yaml

from workflow.report import report, summary
from workflow.cli import UserError


def _phase(directory, steps, batch=32, telemetry=False):
    """A pretraining result directory as the pretrain stage writes it (metrics every 5 steps)."""
    directory.mkdir(parents=True)
    with open(directory / "metrics.jsonl", "w") as handle:
        for step in range(5, steps + 1, 5):
            handle.write(json.dumps({"step": step, "loss": 10 - step / 10, "mlm_loss": 9 - step / 10,
                                     "nsp_loss": 0.69, "mlm_accuracy": step / 100, "lr": 1e-3, "grad_norm": 1.0,
                                     "seq_per_s": 80.0 if step <= 10 else 160.0,
                                     "tokens_per_s": 128 * (80.0 if step <= 10 else 160.0)}) + "\n")
    (directory / "summary.json").write_text(json.dumps({
        "steps": steps, "seq_per_s": 150.5, "tokens_per_s": 19264.0, "real_tokens_per_s": 18880.5, "packed": True,
        "train_time_s": 12.0,
        "global_batch_size": batch, "test_mlm_accuracy": 0.25, "test_nsp_accuracy": 0.6, "device": "cpu"}))
    if telemetry:
        lines = ["time,gpu,power_w,temperature_c,sm_clock_mhz,memory_clock_mhz,utilization_gpu_pct,"
                 "utilization_memory_pct,memory_used_mib,memory_total_mib"]
        lines += [f"{1000 + t},{g},{300 + t},{60 + g},1980,2619,{90 + g},40,{50000 + t},143771"
                  for t in range(20) for g in range(2)]
        (directory / "gpu_telemetry.csv").write_text("\n".join(lines) + "\n")
    return directory


@pytest.fixture
def run(tmp_path):
    phase1 = _phase(tmp_path / "pretrain" / "phase1", 60)
    phase2 = _phase(tmp_path / "pretrain" / "phase2", 20, batch=16)
    squad = tmp_path / "squad"
    squad.mkdir()
    (squad / "eval.json").write_text(json.dumps({"version": "1.1", "exact_match": 12.5, "f1": 34.5678,
                                                 "total": 40, "missing": 0}))
    (squad / "finetune_metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "epoch": s / 10, "loss": 5 / s, "lr": 1e-4, "grad_norm": 1.0,
                            "seq_per_s": 100.0}) + "\n" for s in (10, 20, 30)))
    return tmp_path, phase1, phase2, squad


def test_summary_table_holds_the_key_numbers_of_each_stage(run, tmp_path, repo_env):
    _, phase1, phase2, squad = run
    output = tmp_path / "summary.csv"
    subprocess.run([sys.executable, "-m", "workflow.report.summary", "--phase", f"phase1={phase1}",
                    "--phase", f"phase2={phase2}", "--squad-eval", str(squad / "eval.json"),
                    "--squad-metrics", str(squad / "finetune_metrics.jsonl"), "--output", str(output)],
                   check=True, env=repo_env, capture_output=True)
    with open(output, newline="") as handle:
        table = {(r["stage"], r["metric"]): r["value"] for r in csv.DictReader(handle)}
    assert table[("phase1", "steps")] == "60" and table[("phase2", "steps")] == "20"
    assert table[("phase1", "final_loss")] == "4" and table[("phase2", "final_loss")] == "8"  # last lines
    assert table[("phase1", "final_mlm_accuracy")] == "0.6"
    assert table[("phase2", "seq_per_s")] == "150.5" and table[("phase1", "test_mlm_accuracy")] == "0.25"
    assert table[("phase1", "real_tokens_per_s")] == "18880.5" and table[("phase1", "packed")] == "True"
    assert table[("squad", "exact_match")] == "12.5" and table[("squad", "f1")] == "34.5678"
    assert table[("squad", "finetune_final_loss")] == "0.166667"

    printed = subprocess.run([sys.executable, "-m", "workflow.report.summary", "--print", str(output), "--report",
                              str(tmp_path / "report.html")], check=True, env=repo_env, capture_output=True,
                             text=True).stdout
    assert "SQuAD v1.1 dev: EM 12.50  F1 34.57  (40 questions)" in printed
    assert f"snakemake --report {tmp_path / 'report.html'}" in printed
    (tmp_path / "report.html").write_text("<html></html>")
    printed = summary.render(summary.read_summary(output), tmp_path / "report.html")
    assert printed.splitlines()[-1] == f"Report: {tmp_path / 'report.html'}"


def test_summary_names_the_bad_metrics_line(run):
    _, phase1, _, _ = run
    with open(phase1 / "metrics.jsonl", "a") as handle:
        handle.write("{not json\n")
    with pytest.raises(UserError, match=r"metrics.jsonl:13: not valid JSON"):
        summary.summarize({"phase1": phase1}, None)


def test_training_time_integrates_steps_over_throughput(run):
    _, phase1, _, _ = run
    frame = report.read_metrics(phase1 / "metrics.jsonl")
    seconds = report.training_time(frame, 32)
    # 5 steps x 32 sequences at 80/s = 2 s per window for the first two windows, then 1 s per window
    assert seconds.tolist()[:4] == pytest.approx([2.0, 4.0, 5.0, 6.0])
    assert seconds.iloc[-1] == pytest.approx(4.0 + 10 * 1.0)


def _lines(axis) -> dict[str, list[float]]:
    """What an axis plots: each line's label -> its points x0, y0, x1, y1, ..."""
    return {line.get_label(): line.get_xydata().ravel().tolist() for line in axis.get_lines()}


def _points(points) -> list[float]:
    """(x, y) pairs as _lines spells them, compared to within rounding (pandas reads JSON floats fast, not exact)."""
    return pytest.approx([value for point in points for value in point], rel=1e-12)


def test_pretrain_figures_plot_each_phases_metrics(run):
    _, phase1, phase2, _ = run
    figures = report.pretrain_figures([("phase1", phase1), ("phase2", phase2)])
    steps = {"phase1": range(5, 61, 5), "phase2": range(5, 21, 5)}
    loss = figures["loss"].axes
    assert [axis.get_title() for axis in loss] == ["phase1: training loss", "phase2: training loss"]
    for axis, phase in zip(loss, steps):
        assert _lines(axis) == {"loss": _points((s, 10 - s / 10) for s in steps[phase]),
                                "mlm_loss": _points((s, 9 - s / 10) for s in steps[phase]),
                                "nsp_loss": _points((s, 0.69) for s in steps[phase])}
    (accuracy,) = figures["accuracy"].axes
    assert _lines(accuracy) == {phase: _points((s, s / 100) for s in steps[phase]) for phase in steps}
    # x is training time: 5 steps x batch sequences at 80 seq/s up to step 10, at 160 seq/s after
    phase1, phase2 = figures["throughput"].axes
    assert list(_lines(phase1).values()) == [_points([(2, 80), (4, 80)] + [(4 + i, 160) for i in range(1, 11)])]
    assert list(_lines(phase2).values()) == [_points([(1, 80), (2, 80), (2.5, 160), (3, 160)])]
    assert phase1.get_title() == "phase1: throughput (mean 18,773 tokens/s)"  # 128 x (2 x 80 + 10 x 160) / 12
    single = report.pretrain_figures([("phase2", run[2])])
    assert [axis.get_title() for axis in single["loss"].axes] == ["phase2: training loss"]
    plt.close("all")


def test_telemetry_figure_plots_each_gpus_readings_or_says_there_are_none(run, tmp_path):
    _, phase1, phase2, _ = run
    without = report.telemetry_figure([("phase1", phase1), ("phase2", phase2)])
    assert not any(axis.get_lines() for axis in without.axes)
    assert [text.get_text() for text in without.axes[0].texts] == [
        "No GPU telemetry: the pretraining phases ran without a GPU."]
    gpu_phase = _phase(tmp_path / "gpu" / "phase1", 20, telemetry=True)
    figure = report.telemetry_figure([("phase1", gpu_phase), ("phase2", phase2)])  # only phase1 recorded any
    assert [axis.get_ylabel() for axis in figure.axes] == [label for _, label in report.TELEMETRY_PANELS]
    assert figure.axes[0].get_title() == "phase1: GPU telemetry"
    power, utilisation, memory, temperature = (_lines(axis) for axis in figure.axes)
    seconds = range(20)  # the CSV's time 1000..1019, from its first reading
    assert power == {f"GPU {g}": _points((t, 300 + t) for t in seconds) for g in range(2)}
    assert utilisation == {f"GPU {g}": _points((t, 90 + g) for t in seconds) for g in range(2)}
    assert memory == {f"GPU {g}": _points((t, 50000 + t) for t in seconds) for g in range(2)}
    assert temperature == {f"GPU {g}": _points((t, 60 + g) for t in seconds) for g in range(2)}
    plt.close("all")


def test_squad_figure_plots_the_finetune_loss_with_the_dev_scores(run):
    _, _, _, squad = run
    figure = report.squad_figure(squad / "finetune_metrics.jsonl", squad / "eval.json")
    (axis,) = figure.axes
    assert list(_lines(axis).values()) == [_points([(10, 0.5), (20, 0.25), (30, 5 / 30)])]
    assert axis.get_title() == "SQuAD v1.1 fine-tuning: dev EM 12.50, F1 34.57"
    plt.close(figure)


def test_config_yaml_reads_back_as_the_config(tmp_path):
    config = {"seed": 1, "squad": {"version": "1.1", "init_from": None, "learning_rate": 3e-5, "big": 1e20, "tiny": 1.5e-7},
              "encode": {"phase1": {"max_seq_length": 128}}, "empty": {}}
    report.write_config(json.dumps(config), tmp_path / "config.yaml")
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == config


def test_missing_metrics_are_a_clear_error(tmp_path):
    with pytest.raises(UserError, match=str(tmp_path / "metrics.jsonl")):
        report.read_metrics(tmp_path / "metrics.jsonl")
