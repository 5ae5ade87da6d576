"""Benchmark: peak memory of the GPU telemetry merge (workflow/train/telemetry.py merge_node_files) against a merge
that holds every row, on the same node files, in one run.

    python benchmarks/telemetry_merge.py [--rows 8300000] [--nodes 4] [--gpus 8] [--baseline-rows N]

Writes node files of `--rows` rows in all (the default: a 3-day phase on 4 nodes x 8 GPUs, one row per GPU and
second) to a temporary folder, as the sampler writes them, then runs each merge in a subprocess of its own and
prints its peak RSS, its wall time, and the bytes of the files. The baseline (`merge_in_memory`: every row parsed
into a list, sorted, written) runs on the first `--baseline-rows` rows of each node's share (default: all), so
that its ~1 KB per row fits the machine; its peak is also printed per row. Both outputs must be byte-identical
where both merge the same rows.
"""
from __future__ import annotations

import argparse
import csv
import filecmp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workflow.atomic import atomic_path  # noqa: E402
from workflow.train.telemetry import COLUMNS, node_files  # noqa: E402

START = 1_790_000_000.0  # a unix time: rows carry 3 decimals as the sampler's round(time.time(), 3)


def merge_in_memory(path) -> bool:
    """The merge as it was before streaming: every node's rows in one list, sorted by (time, host, GPU)."""
    rows = []
    for node in sorted(node_files(path).glob("*.csv")):
        with open(node, newline="") as handle:
            reader = csv.reader(handle)
            if next(reader, None) != COLUMNS:
                continue
            rows.extend(((float(row[0]), row[1], int(row[2])), row) for row in reader if len(row) == len(COLUMNS))
    if not rows:
        return False
    rows.sort(key=lambda r: r[0])
    with atomic_path(path) as temporary, open(temporary, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        writer.writerows(row for _, row in rows)
    return True


def write_node_files(path: Path, rows: int, nodes: int, gpus: int) -> None:
    """Node files beside the telemetry CSV `path` holding `rows` rows in all, one sample per second of each node's
    `gpus` GPUs, each node's clock a few milliseconds off the others' (so that their rows interleave)."""
    folder = node_files(path)
    folder.mkdir(parents=True, exist_ok=True)
    samples = rows // (nodes * gpus)
    for node in range(nodes):
        host = f"gpu{node + 1:03d}"
        with open(folder / f"{host}.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(COLUMNS)
            for second in range(samples):
                now = round(START + second + 0.007 * node, 3)
                writer.writerows([now, host, gpu, 250.0 + (second * 7 + gpu) % 150 + 0.125, 60 + (second + gpu) % 20,
                                  1980, 2619, 90 + gpu % 10, 40, 60000 + (second + gpu) % 2000, 81559]
                                 for gpu in range(gpus))


def peak_of(command: list[str]) -> tuple[float, float]:
    """(peak RSS in MiB, wall seconds) of a subprocess."""
    started = time.perf_counter()
    process = subprocess.Popen(command)
    _, status, usage = os.wait4(process.pid, 0)
    if status:
        raise SystemExit(f"{' '.join(command)} failed ({status})")
    return usage.ru_maxrss / 1024, time.perf_counter() - started


def truncate(source: Path, target: Path, rows_per_node: int) -> None:
    """Each node file of `source` cut to its first `rows_per_node` rows, beside `target`."""
    node_files(target).mkdir(parents=True)
    for node in node_files(source).glob("*.csv"):
        with open(node) as inp, open(node_files(target) / node.name, "w") as out:
            for number, line in enumerate(inp):
                if number > rows_per_node:
                    break
                out.write(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8_300_000, help="rows in all node files together")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    parser.add_argument("--baseline-rows", type=int, default=None, help="rows the in-memory merge gets (default: all)")
    args = parser.parse_args()
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "full" / "gpu_telemetry.csv"
        started = time.perf_counter()
        write_node_files(path, args.rows, args.nodes, args.gpus)
        rows = args.rows // (args.nodes * args.gpus) * args.nodes * args.gpus
        size = sum(f.stat().st_size for f in node_files(path).glob("*.csv"))
        print(f"node files: {rows:,} rows on {args.nodes} nodes x {args.gpus} GPUs, {size / 1e6:,.0f} MB "
              f"({size / rows:.0f} B per row), written in {time.perf_counter() - started:.0f} s")
        streaming = f"from workflow.train.telemetry import merge_node_files; merge_node_files({str(path)!r})"
        peak, wall = peak_of([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(repo)!r}); {streaming}"])
        print(f"streaming merge (merge_node_files): {rows:,} rows, peak RSS {peak:,.0f} MiB, {wall:.0f} s")
        base_rows = min(args.baseline_rows or rows, rows)
        base_path = path
        if base_rows < rows:
            base_path = Path(folder) / "baseline" / "gpu_telemetry.csv"
            truncate(path, base_path, base_rows // args.nodes)
            base_rows = base_rows // args.nodes * args.nodes
        in_memory = (f"from benchmarks.telemetry_merge import merge_in_memory; "
                     f"merge_in_memory({str(base_path.with_name('in_memory.csv'))!r})")
        os.symlink(node_files(base_path), node_files(base_path.with_name("in_memory.csv")))
        peak_base, wall_base = peak_of([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(repo)!r}); "
                                        f"{in_memory}"])
        print(f"in-memory merge (baseline): {base_rows:,} rows, peak RSS {peak_base:,.0f} MiB "
              f"({(peak_base - peak) * 2**20 / base_rows:.0f} B per row over the streaming peak), {wall_base:.0f} s")
        if base_path == path:
            same = filecmp.cmp(path, path.with_name("in_memory.csv"), shallow=False)
            print(f"outputs byte-identical: {same}")
            if not same:
                raise SystemExit("the streaming merge differs from the in-memory merge")


if __name__ == "__main__":
    main()
