"""Benchmark: the encode stage (one job, one core) at seq 128 and 512, and HDF5 layouts for a training loader.

    python benchmarks/encode_throughput.py [--mb 26] [--vocab data/vocab.txt]

Text as in tokenize_throughput.py (sample shards repeated, else synthetic English-like), tokenized once. Each
encode runs as its own process (`python -m workflow.data.encode`, as the rule does): wall time, CPU time and peak RSS
come from that process's rusage. NVIDIA DLE's create_pretraining_data.py, measured on this machine by the issue
(one core, 26 MB of Wikipedia text): 3,837 instances/s at 128, 1,370 at 512, 1.66 GB peak. Targets: >= 75k/s at
128, >= 27k/s at 512, peak RSS <= 0.4 GB.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

NVIDIA = {128: 3837, 512: 1370}
NVIDIA_PEAK_GB = 1.66
TARGET = {128: 75_000, 512: 27_000}
PREDICTIONS = {128: 20, 512: 80}


def run_encode(tokenized: Path, vocab: Path, output: Path, length: int, whole_word_masking: bool) -> dict:
    """One encode job in its own process: wall/CPU seconds, peak RSS, instances, bytes written."""
    command = [sys.executable, "-m", "workflow.data.encode", "--tokenized", str(tokenized), "--vocab", str(vocab),
               "--output", str(output), "--max-seq-length", str(length), "--max-predictions-per-seq",
               str(PREDICTIONS[length]), "--split", "training", "--shard-index", "0"]
    command += ["--whole-word-masking"] if whole_word_masking else []
    start = time.perf_counter()
    process = subprocess.Popen(command, env=dict(os.environ, PYTHONPATH=str(ROOT)), stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    if status:
        raise SystemExit(f"encode failed with status {status}")
    with h5py.File(output, "r") as handle:
        n = handle["input_ids"].shape[0]
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "rss_mb": usage.ru_maxrss / 1024, "n": n,
            "mb": output.stat().st_size / 1e6}


LAYOUTS = {
    "NVIDIA: gzip-4, h5py auto chunks": lambda shape: {"compression": "gzip"},
    "ours: gzip-1+shuffle, 64-row chunks": lambda shape: {"compression": "gzip", "compression_opts": 1, "shuffle": True,
                                                          "chunks": (64,) + shape[1:] if len(shape) > 1 else (16384,)},
    "uncompressed, contiguous": lambda shape: {},
    "lzf, 64-row chunks (bytes vary run to run)": lambda shape: {"compression": "lzf",
                                                                  "chunks": (64,) + shape[1:] if len(shape) > 1 else (16384,)},
}


def compare_layouts(source: Path, directory: Path, rows: int = 50_000, reads: int = 2000) -> None:
    with h5py.File(source, "r") as handle:
        arrays = {name: handle[name][:rows] for name in handle}
    raw_mb = sum(array.nbytes for array in arrays.values()) / 1e6
    order = np.random.default_rng(0).integers(0, rows, reads)
    print(f"\nHDF5 layouts, {rows:,} instances of seq {arrays['input_ids'].shape[1]} ({raw_mb:.0f} MB raw):")
    print(f"  {'layout':44s} {'size':>7s} {'write MB/s':>10s} {'random rows/s':>14s} {'full load s':>11s}")
    for name, layout in LAYOUTS.items():
        path = directory / "layout.hdf5"
        start = time.perf_counter()
        with h5py.File(path, "w") as handle:
            for key, array in arrays.items():
                handle.create_dataset(key, data=array, **layout(array.shape))
        write = time.perf_counter() - start
        with h5py.File(path, "r") as handle:
            datasets = [handle[key] for key in arrays]
            start = time.perf_counter()
            for row in order:
                for dataset in datasets:
                    dataset[row]
            random_rate = reads / (time.perf_counter() - start)
            start = time.perf_counter()
            for dataset in datasets:
                dataset[:]
            load = time.perf_counter() - start
        print(f"  {name:44s} {path.stat().st_size / 1e6 / raw_mb:6.2f}x {raw_mb / write:10.0f} {random_rate:14,.0f}"
              f" {load:11.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=26.0, help="MB of text (the issue measured 26 MB)")
    parser.add_argument("--vocab", help="vocab.txt (default: train a 30,522-token one on the text)")
    parser.add_argument("--seq", type=int, nargs="+", default=[128, 512], choices=[128, 512])
    parser.add_argument("--whole-word-masking", action="store_true", help="encode with whole-word masking")
    args = parser.parse_args()

    from tokenize_throughput import english_like_text
    from workflow.data.tokenize import tokenize_shard
    from workflow.data.vocab import train_vocab

    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        text = directory / "shard_0.txt"
        text.write_text(english_like_text(args.mb), encoding="utf-8")
        vocab = Path(args.vocab) if args.vocab else directory / "vocab.txt"
        if not args.vocab:
            train_vocab([text], vocab, size=30522, lowercase=True)
        counts = tokenize_shard(text, vocab, directory / "shard_0.npz")
        print(f"text: {text.stat().st_size / 1e6:.1f} MB, {counts['tokens']:,} tokens, {counts['sentences']:,} "
              f"sentences, {counts['documents']:,} documents; dupe_factor 5, one encode process per length"
              + (", whole-word masking" if args.whole_word_masking else ""))
        for length in args.seq:
            result = run_encode(directory / "shard_0.npz", vocab, directory / f"seq{length}.hdf5", length,
                                args.whole_word_masking)
            per_core = result["n"] / result["cpu"]
            print(f"\nseq {length}: {result['n']:,} instances in {result['wall']:.2f} s wall, {result['cpu']:.2f} s CPU")
            print(f"  instances/s/core (CPU time): {per_core:9,.0f}   target >= {TARGET[length]:,}  "
                  f"{'OK' if per_core >= TARGET[length] else 'MISSED'}")
            print(f"  instances/s (wall):          {result['n'] / result['wall']:9,.0f}")
            print(f"  vs NVIDIA's {NVIDIA[length]:,}/s:            {per_core / NVIDIA[length]:9.1f}x  (target >= 20x)")
            raw_mb = result["n"] * (length * 6 + PREDICTIONS[length] * 8 + 1) / 1e6  # the arrays, uncompressed
            print(f"  output: {result['mb']:.0f} MB on disk ({raw_mb:.0f} MB of arrays): {result['mb'] / result['cpu']:.0f}"
                  f" MB/s written, {raw_mb / result['cpu']:.0f} MB/s of arrays (per CPU second)")
            print(f"  peak RSS: {result['rss_mb']:.0f} MB = {result['rss_mb'] / 1024 / NVIDIA_PEAK_GB:.2f}x NVIDIA's "
                  f"{NVIDIA_PEAK_GB} GB  (target <= 400 MB, 0.25x)")
        compare_layouts(directory / f"seq{args.seq[0]}.hdf5", directory)


if __name__ == "__main__":
    main()
