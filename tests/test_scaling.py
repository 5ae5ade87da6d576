"""The scaling study: the table's math (speedup, efficiency, timed steps), a layout job's checks, and `snakemake
scaling` on the real multi-node Slurm test cluster with layouts 1x2, 2x1 and 2x2 (gloo, CPU).

The cluster test uses tests/test_slurm.py's cluster and profile (skipped where no cluster can be had, failing
under CI=true).
"""
from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import copy_workflow
from workflow.cli import UserError
from workflow.slurm.profile import derive
from workflow.train import scaling
from workflow.train.pretraining_data import PretrainingSequences, list_shards

REPO = Path(__file__).resolve().parents[1]


def _result(phase, layout, world, seq_per_s):
    return {"phase": phase, "layout": layout, "nodes": 1, "gpus_per_node": world, "world_size": world,
            "global_batch_size": 16 * world, "timed_steps": 5, "timed_time_s": 5 * 16 * world / seq_per_s,
            "seq_per_s": seq_per_s, "real_tokens_per_s": 100.0 * seq_per_s, "padded_tokens_per_s": 128.0 * seq_per_s}


def test_speedup_and_efficiency_are_relative_to_the_phases_smallest_world_size():
    results = [_result("phase1", "1x4", 4, 300.0), _result("phase1", "1x1", 1, 100.0),
               _result("phase1", "2x4", 8, 480.0), _result("phase2", "1x2", 2, 40.0), _result("phase2", "1x4", 4, 60.0)]
    rows = {(r["phase"], r["layout"]): r for r in scaling.scaling_rows(results)}
    assert rows["phase1", "1x1"]["speedup"] == 1.0 and rows["phase1", "1x1"]["efficiency"] == 1.0
    assert rows["phase1", "1x4"]["speedup"] == pytest.approx(3.0)
    assert rows["phase1", "1x4"]["efficiency"] == pytest.approx(0.75)
    assert rows["phase1", "2x4"]["speedup"] == pytest.approx(4.8)
    assert rows["phase1", "2x4"]["efficiency"] == pytest.approx(0.6)
    # phase 2's baseline is its own smallest layout (2 ranks), not phase 1's
    assert rows["phase2", "1x4"]["speedup"] == pytest.approx(1.5)
    assert rows["phase2", "1x4"]["efficiency"] == pytest.approx(0.75)
    assert [r["layout"] for r in scaling.scaling_rows(results)] == ["1x1", "1x4", "2x4", "1x2", "1x4"]


def test_the_csv_holds_the_rows_of_the_results(tmp_path):
    paths = []
    for result in (_result("phase1", "1x2", 2, 150.0), _result("phase1", "1x1", 1, 100.0)):
        paths.append(tmp_path / f"{result['layout']}.json")
        paths[-1].write_text(json.dumps({**result, "device": "cpu"}))
    scaling.write_table([str(p) for p in paths], str(tmp_path / "scaling.csv"))
    with open(tmp_path / "scaling.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == scaling.COLUMNS
    assert [(r["layout"], int(r["world_size"]), float(r["speedup"]), float(r["efficiency"])) for r in rows] == [
        ("1x1", 1, 1.0, 1.0), ("1x2", 2, 1.5, 0.75)]


def test_an_unreadable_result_is_named(tmp_path):
    (tmp_path / "1x1.json").write_text("{not json")
    with pytest.raises(UserError, match="1x1.json: cannot read a benchmark result"):
        scaling.write_table([str(tmp_path / "1x1.json")], str(tmp_path / "scaling.csv"))
    assert not (tmp_path / "scaling.csv").exists()


def test_the_plot_shows_measured_and_ideal_throughput_and_efficiency_by_world_size(tmp_path):
    from workflow.report import report

    paths = []
    for result in (_result("phase1", "1x1", 1, 100.0), _result("phase1", "1x2", 2, 150.0),
                   _result("phase1", "1x4", 4, 200.0)):
        paths.append(tmp_path / f"{result['layout']}.json")
        paths[-1].write_text(json.dumps(result))
    scaling.write_table([str(p) for p in paths], str(tmp_path / "scaling.csv"))
    throughput, efficiency = report.scaling_figure(tmp_path / "scaling.csv").axes
    measured, ideal = ([list(line.get_xdata()), list(line.get_ydata())] for line in throughput.get_lines())
    assert measured == [[1, 2, 4], [100.0, 150.0, 200.0]] and ideal == [[1, 2, 4], [100.0, 200.0, 400.0]]
    assert list(efficiency.get_lines()[0].get_ydata()) == pytest.approx([1.0, 0.75, 0.5])


def test_only_the_steps_after_the_warmup_are_timed(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    # 32 sequences per step; steps 1-2 (warm-up) slow, steps 3-5 take 0.5, 1.0 and 2.0 s
    seconds = {1: 10.0, 2: 8.0, 3: 0.5, 4: 1.0, 5: 2.0}
    metrics.write_text("".join(json.dumps({"step": step, "seq_per_s": 32 / s}) + "\n" for step, s in seconds.items()))
    assert scaling.timed_seconds(metrics, 2, 3, 32) == pytest.approx(3.5)
    with pytest.raises(UserError, match=r"no metrics line for timed step\(s\) \[6\]"):
        scaling.timed_seconds(metrics, 2, 4, 32)


@pytest.mark.parametrize("name", ["2x", "x8", "0x1", "2*8", "two"])
def test_a_malformed_layout_name_is_refused(name):
    with pytest.raises(UserError, match="expected <nodes>x<gpus_per_node>"):
        scaling.parse_layout(name)


def test_a_job_with_fewer_ranks_than_its_layout_stops_before_training(tmp_path, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "SLURM_STEP_ID"):
        monkeypatch.delenv(key, raising=False)
    config = {"scaling": {"warmup_steps": 1, "max_steps": 2, "accumulation_steps": 1}}
    with pytest.raises(UserError, match="layout 1x2: the job runs 1 rank\\(s\\), not 2"):
        scaling.benchmark(config, "phase1", "1x2", str(tmp_path), "vocab.txt", str(tmp_path / "run"),
                          str(tmp_path / "1x2.json"))
    assert not (tmp_path / "1x2.json").exists()


# ---- on the real Slurm test cluster -------------------------------------------------------------------------------

TIMEOUT_S = 600
# 2 ranks on one node, 2 ranks on two nodes, 2 x 2 ranks (the test nodes: 2 CPUs, 2 fake GPUs each); a few steps of
# the demo's tiny model on the demo data.
LAYOUTS = ("1x2", "2x1", "2x2")
STUDY = {"scaling": {"layouts": [{"nodes": int(n), "gpus_per_node": int(g)} for n, g in (l.split("x") for l in LAYOUTS)],
                     "phases": ["phase1"], "warmup_steps": 2, "max_steps": 4, "accumulation_steps": 1}}


def _snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "SNAKEBERT_FAIL_AT_STEP"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    result = subprocess.run(["timeout", "-k", "20", str(TIMEOUT_S), "snakemake", *args, "--configfile",
                             "sample/config.yaml", "study.yaml"], cwd=workdir, env=env, capture_output=True, text=True)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result


def _jobs(workdir: Path, since: str) -> list[dict]:
    fields = ["JobID", "Comment", "State", "AllocTRES", "WorkDir"]
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-S", since, "-o", ",".join(fields)], capture_output=True,
                         text=True, check=True).stdout
    rows = [dict(zip(fields, line.split("|", len(fields) - 1))) for line in out.splitlines() if line]
    return [r for r in rows if Path(r["WorkDir"]).resolve() == workdir.resolve()]


def test_scaling_on_slurm_measures_one_and_two_node_layouts_and_derives_speedup_and_efficiency(tmp_path, cluster):
    workdir = copy_workflow(tmp_path / "study")
    (workdir / "study.yaml").write_text(yaml.safe_dump(STUDY))
    # The demo data, built locally (test_slurm proves the data rules on Slurm); then only the study goes to Slurm.
    _snakemake(workdir, "--cores", "2", "data/hdf5_seq128", "data/vocab.txt")
    derive(REPO / "profiles" / "slurm", REPO / "tests" / "slurm" / "profile.yaml", workdir / "profile")
    started = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 2))
    _snakemake(workdir, "scaling", "--profile", "profile")

    # Each layout ran as its own Slurm job holding its layout's nodes and GPUs.
    jobs = {job["Comment"].split("_wildcards_")[1].split("_")[-1]: job for job in _jobs(workdir, started)
            if "scaling_benchmark" in job["Comment"]}
    assert sorted(jobs) == sorted(LAYOUTS) and all(job["State"] == "COMPLETED" for job in jobs.values()), jobs
    for layout, job in jobs.items():
        nodes, gpus = (int(n) for n in layout.split("x"))
        assert f"gres/gpu={nodes * gpus}" in job["AllocTRES"] and f"node={nodes}" in job["AllocTRES"], job

    with open(workdir / "results" / "scaling" / "scaling.csv", newline="") as handle:
        rows = {row["layout"]: row for row in csv.DictReader(handle)}
    assert sorted(rows) == sorted(LAYOUTS)
    results = {layout: json.loads((workdir / "results" / "scaling" / "phase1" / f"{layout}.json").read_text())
               for layout in rows}
    # The world size is the trainers' own, not the config's; the ranks' hosts are those the layout asked for.
    assert [int(rows[layout]["world_size"]) for layout in LAYOUTS] == [2, 2, 4]
    for layout in LAYOUTS:
        log = (workdir / "logs" / "scaling" / "phase1" / f"{layout}.log").read_text()
        hosts = set(re.findall(r"rank \d+/\d+ \(local \d+\) on host (\S+),", log))
        assert len(hosts) == int(layout.split("x")[0]), (layout, log[-2000:])
    for layout, row in rows.items():
        result = results[layout]
        assert float(row["seq_per_s"]) > 0 and float(row["real_tokens_per_s"]) > 0
        assert float(row["seq_per_s"]) == pytest.approx(result["sequences"] / result["timed_time_s"])
        assert result["sequences"] == STUDY["scaling"]["max_steps"] * result["global_batch_size"]
        assert result["global_batch_size"] == 16 * int(row["world_size"])  # demo micro-batch 16 per rank
        # real tokens: the attention mask of exactly the sequences the timed steps consumed
        seed = yaml.safe_load((REPO / "config.yaml").read_text())["seed"]
        sequences = PretrainingSequences(list_shards(str(workdir / "data" / "hdf5_seq128"), "training"), seed)
        consumed = sequences.read(STUDY["scaling"]["warmup_steps"] * result["global_batch_size"], result["sequences"])
        sequences.close()
        assert result["real_tokens"] == int(consumed["attention_mask"].sum())
        assert result["real_tokens"] < result["sequences"] * 128  # padding is not counted
    # speedup and efficiency against the smallest world size (2 ranks; 1x2 and 2x1 tie, the first listed wins)
    base = float(rows["1x2"]["seq_per_s"])
    assert float(rows["1x2"]["speedup"]) == 1.0 and float(rows["1x2"]["efficiency"]) == 1.0
    for layout in ("2x1", "2x2"):
        speedup = float(rows[layout]["seq_per_s"]) / base
        assert float(rows[layout]["speedup"]) == pytest.approx(speedup)
        assert float(rows[layout]["efficiency"]) == pytest.approx(speedup / (int(rows[layout]["world_size"]) / 2))
    # The benchmarks' scratch runs are gone and no phase's run directory was touched.
    assert not (workdir / "runs" / "scaling" / "phase1").exists() or not any(
        (workdir / "runs" / "scaling" / "phase1").iterdir())
    assert not (workdir / "runs" / "pretrain").exists()


def test_a_layout_listed_twice_stops_snakemake_before_any_job(tmp_path):
    workdir = copy_workflow(tmp_path / "twice")
    (workdir / "twice.yaml").write_text(yaml.safe_dump({"scaling": {"layouts": [
        {"nodes": 1, "gpus_per_node": 2}, {"nodes": 2, "gpus_per_node": 1}, {"nodes": 1, "gpus_per_node": 2}]}}))
    result = subprocess.run([sys.executable, "-m", "snakemake", "-n", "scaling", "--configfile", "sample/config.yaml",
                             "twice.yaml"], cwd=workdir, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 1
    assert "config key 'scaling.layouts': a layout (nodes, gpus_per_node) is listed twice" in output.splitlines()
    assert "Job stats" not in output
