"""Benchmark: packed sequences per second that ONE loader core delivers to the trainer, at seq 128 and 512.

    python benchmarks/input_pipeline.py [--megabytes 8] [--micro-batch 64 --micro-batch-512 16]

Real Wikipedia text from the bundled sample (benchmarks/wikipedia_sample.real_text: the real extract and format
stages) is given a vocab, tokenized, and encoded with packing into gzip shards, as the DAG does. Then one process
with one torch thread reads the whole epoch of the training order in micro-batches, exactly as a DataLoader worker
does (workflow.train.pretraining_data.PretrainingSequences.read: HDF5 read + gzip decompression of the shard,
shuffled row selection, straddling rows trimmed, int64 tensors). Printed: sequences per CPU second of that process
(all its threads: the shard prefetch thread included; CPU time, since the machine is shared), real tokens per CPU
second, and against the targets of issue 9 (3x an H100's consumption: 6,000 seq/s at 128, 3,000 at 512) the
loader cores one GPU needs. Pinned-memory copies (CUDA only) are not included.
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.wikipedia_sample import real_text  # noqa: E402
from workflow.data.encode import EncodeSettings, encode_shard  # noqa: E402
from workflow.data.pack import PackSettings  # noqa: E402
from workflow.data.tokenize import tokenize_shard  # noqa: E402
from workflow.data.vocab import train_vocab  # noqa: E402
from workflow.train.pretraining_data import PretrainingSequences, list_shards  # noqa: E402

TARGETS = {128: 6000, 512: 3000}  # issue 9: 3x what one H100 consumes
PREDICTIONS = {128: 20, 512: 80}


def loader_rate(directory: Path, micro_batch: int) -> dict:
    """One epoch read in micro-batches by one process: sequences and real tokens per CPU second."""
    shards = list_shards(directory, "training")
    sequences = PretrainingSequences(shards, seed=1)
    total = sequences.epoch_length
    cpu, wall, real = time.process_time(), time.perf_counter(), 0
    for start in range(0, total - micro_batch + 1, micro_batch):
        real += int((sequences.read(start, micro_batch)["attention_mask"] > 0).sum())
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    sequences.close()
    done = total // micro_batch * micro_batch
    return {"sequences": done, "rows": sum(s.rows for s in shards), "cpu_s": cpu, "wall_s": wall,
            "seq_per_cpu_s": done / cpu, "real_tokens_per_cpu_s": real / cpu}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=8.0, help="text to encode (the sample, repeated)")
    parser.add_argument("--micro-batch", type=int, default=64, help="sequences per read at 128")
    parser.add_argument("--micro-batch-512", type=int, default=16, help="sequences per read at 512")
    parser.add_argument("--shards", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as temporary:
        work = Path(temporary)
        text = real_text(args.megabytes, work / "text.txt")
        train_vocab([text], work / "vocab.txt", size=30522, lowercase=True)
        tokenize_shard(text, work / "vocab.txt", work / "tokenized.npz")
        print(f"one loader core (1 process, 1 torch thread), {args.megabytes} MB of real text, packed shards "
              f"({PackSettings().algorithm}, <= 3 per row, gzip):")
        for length, micro in ((128, args.micro_batch), (512, args.micro_batch_512)):
            directory = work / f"hdf5_seq{length}"
            (directory / "training").mkdir(parents=True)
            settings = EncodeSettings(max_seq_length=length, max_predictions_per_seq=PREDICTIONS[length])
            for index in range(args.shards):  # other shard seeds: other instances of the same text
                encode_shard(work / "tokenized.npz", work / "vocab.txt", directory / "training" / f"shard_{index}.hdf5",
                             settings, seed=12345, split="training", shard_index=index, packing=PackSettings())
            rate = loader_rate(directory, micro)
            cores = math.ceil(TARGETS[length] / rate["seq_per_cpu_s"])
            print(f"  seq {length}: {rate['sequences']} sequences in {rate['rows']} rows, micro-batch {micro}: "
                  f"{rate['seq_per_cpu_s']:,.0f} seq per CPU s, {rate['real_tokens_per_cpu_s']:,.0f} real tokens per "
                  f"CPU s (wall {rate['wall_s']:.2f} s for {rate['cpu_s']:.2f} CPU s); target {TARGETS[length]:,} "
                  f"seq/s per GPU -> {cores} loader core(s) per GPU")


if __name__ == "__main__":
    main()
