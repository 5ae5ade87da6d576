"""Scaling study: fixed-iteration pretraining benchmarks per layout (nodes x GPUs) and their table.

API:
    benchmark(config, phase, layout, data_dir, vocab, run_dir, output, threads)  one layout's job (every rank runs
        it): `warmup_steps` untimed steps, then `max_steps` timed ones, through workflow.train.pretrain on the real
        shards; rank 0 writes the job's measurements (world size and nodes as the trainer saw them) to `output`
    scaling_rows(results) -> rows      speedup over the layout with the smallest world size (per phase) and
                                       efficiency = speedup / (world size / that smallest world size)
    write_table(results, output)       results/scaling/scaling.csv

    python -m workflow.train.scaling benchmark --phase phase1 --layout 1x2 --config '{"seed":..,"model":..,
        "pretrain":..,"scaling":..}' --data-dir data/hdf5_seq128 --vocab data/vocab.txt --run-dir runs/scaling/...
        --output results/scaling/phase1/1x2.json
    python -m workflow.train.scaling table results/scaling/phase1/*.json --output results/scaling/scaling.csv

Timing: the trainer logs a metrics line after every step (log_every 1) with that step's seq/s, so each step's wall
time is global batch / seq/s; the timed steps are those after the warm-up (checkpoint writes and the final evaluation
are outside every step's window). Real tokens are the non-padding tokens (attention mask) of exactly the sequences the
timed steps consumed, re-read from the same global order. The run directory is the benchmark's own scratch space
(never a phase's): emptied before and removed after the job.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import logging
import shutil
from pathlib import Path

from workflow.atomic import atomic_path, write_json
from workflow.cli import UserError, run
from workflow.config import PHASES
from workflow.train import distributed
from workflow.train.pretrain import TrainSettings, pretrain
from workflow.train.pretraining_data import PretrainingSequences, list_shards

log = logging.getLogger("scaling")
COLUMNS = ["phase", "layout", "nodes", "gpus_per_node", "world_size", "global_batch_size", "timed_steps",
           "timed_time_s", "seq_per_s", "real_tokens_per_s", "padded_tokens_per_s", "speedup", "efficiency"]


def parse_layout(name: str) -> tuple[int, int]:
    """`2x8` -> (2 nodes, 8 GPUs per node)."""
    nodes, _, gpus = name.partition("x")
    if not (nodes.isdigit() and gpus.isdigit() and int(nodes) > 0 and int(gpus) > 0):
        raise UserError(f"layout {name!r}: expected <nodes>x<gpus_per_node>, e.g. 2x8")
    return int(nodes), int(gpus)


def timed_seconds(metrics_path: Path, warmup_steps: int, timed_steps: int, global_batch_size: int) -> float:
    """Wall time of steps warmup+1 .. warmup+timed from per-step metrics lines (seq/s of one step each)."""
    lines = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    per_step = {line["step"]: global_batch_size / line["seq_per_s"] for line in lines}
    wanted = range(warmup_steps + 1, warmup_steps + timed_steps + 1)
    missing = [step for step in wanted if step not in per_step]
    if missing:
        raise UserError(f"{metrics_path}: no metrics line for timed step(s) {missing[:5]} (log_every must be 1)")
    return sum(per_step[step] for step in wanted)


def real_tokens(data_dir: str, seed: int, start: int, count: int, chunk: int) -> int:
    """Non-padding tokens of sequences [start, start + count) of the training order (what those steps consumed)."""
    sequences = PretrainingSequences(list_shards(data_dir, "training"), seed)
    try:
        return sum(int(sequences.read(first, min(chunk, start + count - first))["attention_mask"].sum())
                   for first in range(start, start + count, chunk))
    finally:
        sequences.close()


def benchmark(config: dict, phase: str, layout: str, data_dir: str, vocab: str, run_dir: str, output: str,
              threads: int | None = None, device: str = "auto") -> dict | None:
    """One layout's benchmark job (call it on every rank); rank 0 writes and returns the measurements."""
    nodes, gpus_per_node = parse_layout(layout)
    study = config["scaling"]
    warmup, timed = study["warmup_steps"], study["max_steps"]
    _, world, _ = distributed.read_environment()
    if world != nodes * gpus_per_node:
        raise UserError(f"layout {layout}: the job runs {world} rank(s), not {nodes * gpus_per_node}; the profile's "
                        f"set-resources for scaling_benchmark must not set nodes, gres or tasks")
    scratch = Path(run_dir)
    settings = TrainSettings.from_config(
        config, phase, data_dir=data_dir, vocab=vocab, run_dir=str(scratch / "run"),
        out_model=str(scratch / "out" / "model"), out_metrics=str(scratch / "out" / "metrics.jsonl"),
        out_summary=str(scratch / "out" / "summary.json"), threads=threads, device=device)
    steps = warmup + timed
    # Weak scaling: each rank's work per step is fixed; log every step so that each step is timed on its own.
    global_batch = settings.phase.micro_batch_size * study["accumulation_steps"] * world
    # (no batch-size warm-up: every timed step has the layout's full batch)
    settings = dataclasses.replace(
        settings, phase=dataclasses.replace(settings.phase, total_steps=steps, max_steps=steps,
                                            global_batch_size=global_batch, batch_size_warmup=None),
        pretrain=dataclasses.replace(settings.pretrain, log_every=1, checkpoint_every=steps, keep_checkpoints=1,
                                     eval_max_sequences=world), out_optimizer=None, out_telemetry=None)
    if distributed.read_environment()[0] == 0 and scratch.exists():
        shutil.rmtree(scratch)  # a crashed earlier benchmark must not be resumed: its timing would be partial
    summary = pretrain(settings)
    if summary["world_size"] != world or summary["steps"] != steps:
        raise UserError(f"layout {layout}: the trainer ran {summary['steps']} steps on {summary['world_size']} ranks, "
                        f"expected {steps} on {world}")
    if world > 1 and distributed.read_environment()[0] != 0:
        return None
    seconds = timed_seconds(scratch / "run" / "metrics.jsonl", warmup, timed, global_batch)
    sequences = timed * global_batch
    tokens = real_tokens(data_dir, settings.seed, warmup * global_batch, sequences, global_batch)
    result = {
        "phase": phase, "layout": layout, "nodes": world // distributed.local_world_size(),
        "gpus_per_node": distributed.local_world_size(), "world_size": summary["world_size"],
        "device": summary["device"], "precision": summary["precision"], "global_batch_size": global_batch,
        "micro_batch_size": settings.phase.micro_batch_size, "seq_length": summary["seq_length"], "warmup_steps": warmup,
        "timed_steps": timed, "timed_time_s": seconds, "sequences": sequences, "real_tokens": tokens,
        "seq_per_s": sequences / seconds, "real_tokens_per_s": tokens / seconds,
        "padded_tokens_per_s": sequences * summary["seq_length"] / seconds,
    }
    write_json(output, result)
    shutil.rmtree(scratch)  # the benchmark's checkpoints and export are worth nothing once measured
    log.info("%s %s: %d ranks, %.1f seq/s, %.0f real tokens/s", phase, layout, world, result["seq_per_s"],
             result["real_tokens_per_s"])
    return result


def scaling_rows(results: list[dict]) -> list[dict]:
    """Rows of the table, per phase by world size: speedup and efficiency against that phase's smallest layout."""
    rows = []
    for phase in sorted({r["phase"] for r in results}):
        runs = sorted((r for r in results if r["phase"] == phase), key=lambda r: (r["world_size"], r["layout"]))
        base = runs[0]
        for r in runs:
            speedup = r["seq_per_s"] / base["seq_per_s"]
            rows.append({**{key: r[key] for key in COLUMNS if key in r}, "speedup": speedup,
                         "efficiency": speedup / (r["world_size"] / base["world_size"])})
    return rows


def write_table(paths: list[str], output: str) -> list[dict]:
    results = []
    for path in paths:
        try:
            results.append(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as error:
            raise UserError(f"{path}: cannot read a benchmark result ({error})") from None
    rows = scaling_rows(results)
    with atomic_path(output) as temporary, open(temporary, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("benchmark", help="one layout's job (run under workflow.slurm.launch)")
    bench.add_argument("--phase", required=True, choices=PHASES)
    bench.add_argument("--layout", required=True, help="<nodes>x<gpus_per_node>")
    bench.add_argument("--config", required=True, help="JSON of the config sections seed, model, pretrain, scaling")
    bench.add_argument("--data-dir", required=True)
    bench.add_argument("--vocab", required=True)
    bench.add_argument("--run-dir", required=True, help="scratch directory of this benchmark (emptied, removed)")
    bench.add_argument("--output", required=True, help="the measurements (JSON)")
    bench.add_argument("--threads", type=int, default=None)
    bench.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    table = commands.add_parser("table", help="results/scaling/scaling.csv from the layouts' JSON results")
    table.add_argument("results", nargs="+")
    table.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    if args.command == "table":
        write_table(args.results, args.output)
        return
    try:
        config = json.loads(args.config)
    except json.JSONDecodeError as error:
        raise UserError(f"--config: not JSON ({error})") from None
    benchmark(config, args.phase, args.layout, args.data_dir, args.vocab, args.run_dir, args.output, args.threads,
              args.device)


if __name__ == "__main__":
    run(main)
