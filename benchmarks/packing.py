"""Benchmark: sequence packing, side by side in one run, at seq 128 and 512.

    python benchmarks/packing.py [--tokenized data/tokenized/training] [--vocab data/vocab.txt] [--instances 128]

1. Data: every tokenized shard is encoded and packed (workflow.data.encode, workflow.data.pack, in this process);
   printed: real tokens / slots unpacked and packed (the default, gapfill, per shard, as the stage runs; every
   algorithm on the histogram of all shards together, and the fill of `fewest_packs`, a bound no packing with 3
   sequences per row can beat on that histogram).
   Then one shard of a real run's size (the sample's shards, --repeat times over) is encoded, timed (fastest of 3
   runs each, packed and unpacked runs alternating): CPU seconds of the whole encode job unpacked (plan, build,
   gzip write) and packed (the same, packing and writing the packed format instead), and of the packing inside the
   packed job (pack_arrays as encode calls it: lengths from the plan, packs built in the instances' memory) as a
   share of the unpacked job; the gzip write of the same instances unpacked and packed (the packed format has more
   datasets); then, as shares of the unpacked job too, pack_arrays of the unpacked file's arrays (checks included)
   and the pack stage as a separate job (HDF5 read, packing, gzip write).
2. Model (CPU, fp32, tiny preset, same weights): the same instances trained on (forward, MLM + NSP loss,
   backward) as padded rows and as packed rows, on one thread; printed: real tokens per CPU second of each (CPU
   time, not wall time: the machine is shared) and the fill ratios beside.
   Packed rows run through the CPU path (block-diagonal SDPA mask) and through the unpadded variable-length path
   the model takes on CUDA (run here with SDPA's per-sequence CPU fallback). Passes alternate so machine noise
   hits all sides alike; the best pass of each is printed.

Defaults read the demo's data (`make demo`, or `snakemake data/tokenized/training/shard_0.npz ...`).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import workflow.data.encode as encode_module  # noqa: E402
from workflow.train.models import kit  # noqa: E402
from workflow.data.encode import EncodeSettings, encode_shard  # noqa: E402
from workflow.data.hdf5 import read_encoded, write_shard  # noqa: E402
from workflow.data.pack import (ALGORITHMS, PackSettings, fewest_packs, histogram_packing, pack_arrays,  # noqa: E402
                                 pack_shard)
from workflow.data.tokenize import load_tokenized  # noqa: E402
from workflow.data.vocab import read_vocab  # noqa: E402
from workflow.train.models.bert import BertConfig, BertForPreTraining  # noqa: E402
from workflow.train.pretrain import pretraining_forward  # noqa: E402
from workflow.train.pretraining_data import make_batch  # noqa: E402

PREDICTIONS = {128: 20, 512: 80}
SEQUENCES_PER_PACK = 3


def timed(function, *args, repeat: int = 3, **kwargs):
    """(result, cpu seconds, wall seconds) of the fastest of `repeat` calls (the machine is shared)."""
    best_cpu = best_wall = float("inf")
    for _ in range(repeat):
        cpu, wall = time.process_time(), time.perf_counter()
        result = function(*args, **kwargs)
        best_cpu, best_wall = min(best_cpu, time.process_time() - cpu), min(best_wall, time.perf_counter() - wall)
    return result, best_cpu, best_wall


@contextmanager
def cpu_spent_in(module, name: str):
    """The CPU seconds of each call of `module.name` (as the module itself calls it) while the block runs."""
    original, spent = getattr(module, name), []

    def timed_call(*args, **kwargs):
        started = time.process_time()
        try:
            return original(*args, **kwargs)
        finally:
            spent.append(time.process_time() - started)

    setattr(module, name, timed_call)
    try:
        yield spent
    finally:
        setattr(module, name, original)


def encode_jobs(big: Path, vocab: Path, settings: EncodeSettings, directory: Path, repeat: int = 3) -> dict:
    """CPU s of the fastest of `repeat` encode jobs unpacked and packed (alternating, so machine noise hits both
    alike), and of the fastest packing (pack_arrays) inside the packed ones."""
    best = {"unpacked": float("inf"), "packed": float("inf")}
    with cpu_spent_in(encode_module, "pack_arrays") as packing:
        for _ in range(repeat):
            for side, pack_settings in (("unpacked", None), ("packed", PackSettings(SEQUENCES_PER_PACK))):
                started = time.process_time()
                encode_shard(big, vocab, directory / f"{side}_{settings.max_seq_length}_big.hdf5", settings, 12345,
                             "training", 0, packing=pack_settings)
                best[side] = min(best[side], time.process_time() - started)
    return {**best, "packing": min(packing)}


def fills(lengths: np.ndarray, length: int) -> str:
    """Real tokens / slots of every algorithm on these lengths, and of the fewest packs any packing needs."""
    histogram = np.bincount(lengths, minlength=length + 1)
    rows = {algorithm: sum(count for _, count in histogram_packing(histogram, length, SEQUENCES_PER_PACK, algorithm))
            for algorithm in ALGORITHMS}
    rows["bound (fewest_packs)"] = fewest_packs(histogram, length, SEQUENCES_PER_PACK)
    return ", ".join(f"{name} {lengths.sum() / (n * length):.4f}" for name, n in rows.items())


def repeated_shard(tokenized: list[Path], times: int, output: Path) -> Path:
    """One tokenized shard holding every document of `tokenized`, `times` over: a shard of the real run's size."""
    ids, sentences, documents = [], [], []
    n_tokens = n_sentences = 0
    for _ in range(times):
        for path in tokenized:
            shard_ids, sentence_offsets, document_offsets = load_tokenized(path)
            ids.append(shard_ids)
            sentences.append(sentence_offsets[:-1] + n_tokens)
            documents.append(document_offsets[:-1] + n_sentences)
            n_tokens += len(shard_ids)
            n_sentences += len(sentence_offsets) - 1
    np.savez(output, ids=np.concatenate(ids), sentence_offsets=np.append(np.concatenate(sentences), n_tokens),
             document_offsets=np.append(np.concatenate(documents), n_sentences))
    return output


def data_side(tokenized: list[Path], big: Path, repeat: int, vocab: Path, length: int, directory: Path) -> list[dict]:
    """Encode then pack every shard, print the fills; time encode and pack on the big shard; return the arrays."""
    settings = EncodeSettings(max_seq_length=length, max_predictions_per_seq=PREDICTIONS[length])
    encoded, lengths = [], []
    print(f"\nseq {length}: shard  instances  fill unpacked  fill packed (gapfill, per shard)")
    for index, path in enumerate(tokenized):
        output = directory / f"encoded_{length}_{index}.hdf5"
        encode_shard(path, vocab, output, settings, 12345, "training", index)
        stats = pack_shard(output, directory / f"packed_{length}_{index}.hdf5", SEQUENCES_PER_PACK)
        print(f"  {index:>12}  {stats['n_instances']:>9}  {stats['fill_unpacked']:>13.4f}  {stats['fill']:>11.4f}")
        arrays, _ = read_encoded(output)
        encoded.append(arrays)
        lengths.append(arrays["input_mask"].astype(bool).sum(axis=1))
    lengths = np.concatenate(lengths)
    print(f"  all shards' histogram ({len(lengths)} instances): "
          f"unpacked {lengths.sum() / (len(lengths) * length):.4f}, {fills(lengths, length)}")

    jobs = encode_jobs(big, vocab, settings, directory)
    output = directory / f"unpacked_{length}_big.hdf5"
    arrays, _ = read_encoded(output)
    packed, compute_cpu, _ = timed(pack_arrays, arrays, SEQUENCES_PER_PACK)
    writes = {side: timed(write_shard, directory / f"written_{side}.hdf5", {},
                          {name: (array.shape, array.dtype) for name, array in written.items()}, [written], "gzip")[1]
              for side, written in (("unpacked", arrays), ("packed", packed))}
    stats, stage_cpu, _ = timed(pack_shard, output, directory / f"packed_{length}_big.hdf5", SEQUENCES_PER_PACK)
    lengths = arrays["input_mask"].astype(bool).sum(axis=1)
    unpacked = jobs["unpacked"]
    print(f"  one shard of {len(lengths)} instances (the sample's shards {repeat} times over): "
          f"fill {stats['fill_unpacked']:.4f} -> {stats['fill']:.4f} ({fills(lengths, length)})")
    print(f"  encode job CPU s, fastest of 3: unpacked {unpacked:.3f}, packed {jobs['packed']:.3f} "
          f"({jobs['packed'] / unpacked - 1:+.1%}: holding the shard, packing, writing the packed format); packing "
          f"inside the packed job {jobs['packing']:.3f} = {jobs['packing'] / unpacked:.1%} of the unpacked job; "
          f"gzip write of the instances unpacked {writes['unpacked']:.3f}, packed {writes['packed']:.3f}")
    print(f"  as shares of the unpacked job: pack_arrays of the unpacked file's arrays (checks included) "
          f"{compute_cpu:.3f} = {compute_cpu / unpacked:.1%}, the pack stage as a separate job (HDF5 read, packing, "
          f"gzip write) {stage_cpu:.3f} = {stage_cpu / unpacked:.1%}")
    return encoded


def batches(arrays: dict, rows: int) -> list[dict]:
    """Model inputs and labels in batches of `rows` rows, as the trainer builds them."""
    n = len(arrays["input_ids"])
    return [make_batch(arrays, np.arange(start, min(start + rows, n))) for start in range(0, n, rows)]


def train_pass(model, data: list[dict], varlen: bool) -> float:
    """CPU seconds (one thread) of forward + loss + backward over all batches."""
    kit.VARLEN_DEVICE_TYPES = ("cpu",) if varlen else ()
    start = time.process_time()
    for batch in data:
        pretraining_forward(model, batch)["loss"].backward()  # the training task's own forward and loss
    return time.process_time() - start


def model_side(encoded: list[dict], length: int, vocab_size: int, n_instances: int, rows: int, passes: int) -> None:
    chosen = np.sort(np.random.default_rng(0).permutation(sum(len(a["input_ids"]) for a in encoded))[:n_instances])
    arrays = {name: np.concatenate([a[name] for a in encoded])[chosen] for name in encoded[0]}
    packed = pack_arrays(arrays, SEQUENCES_PER_PACK)
    real = int(arrays["input_mask"].astype(bool).sum())
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.preset("tiny", vocab_size=vocab_size)).train()
    padded_fill, packed_fill = real / arrays["input_ids"].size, real / packed["input_ids"].size
    sides = {"padded rows": (batches(arrays, rows), False, padded_fill),
             "packed rows, block-diagonal mask (CPU path)": (batches(packed, rows), False, packed_fill),
             "packed, unpadded varlen (CUDA path, CPU fallback)": (batches(packed, rows), True, packed_fill)}
    best = {name: float("inf") for name in sides}
    for _ in range(passes):
        for name, (data, varlen, _) in sides.items():
            best[name] = min(best[name], train_pass(model, data, varlen))
    kit.VARLEN_DEVICE_TYPES = ("cuda",)
    print(f"  model: tiny, fp32, forward+loss+backward, {len(arrays['input_ids'])} instances ({real} real tokens), "
          f"{rows} rows per batch, best of {passes} passes")
    for name, (data, _, fill) in sides.items():
        print(f"    {name:<52} {len(data):>3} batches  fill {fill:.4f}  {real / best[name]:>9,.0f} real tokens/CPU s"
              f"  ({best['padded rows'] / best[name]:.2f}x padded)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenized", default="data/tokenized/training", help="directory of tokenized shards (.npz)")
    parser.add_argument("--vocab", default="data/vocab.txt")
    parser.add_argument("--instances", type=int, default=128, help="instances trained on per side (model part)")
    parser.add_argument("--rows", type=int, default=16, help="rows per batch (model part)")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=40, help="the timed shard holds the sample this many times")
    args = parser.parse_args()
    tokenized = sorted(Path(args.tokenized).glob("*.npz"))
    if not tokenized:
        raise SystemExit(f"error: {args.tokenized}: no tokenized shards (run the demo's data stages first)")
    torch.set_num_threads(1)
    print(f"{len(tokenized)} tokenized shards from {args.tokenized}; at most {SEQUENCES_PER_PACK} sequences per row; "
          f"CPU figures on a shared machine are noisy")
    with tempfile.TemporaryDirectory() as directory:
        big = repeated_shard(tokenized, args.repeat, Path(directory) / f"repeated_{args.repeat}_times.npz")
        for length in (128, 512):
            encoded = data_side(tokenized, big, args.repeat, Path(args.vocab), length, Path(directory))
            model_side(encoded, length, len(read_vocab(args.vocab)), args.instances, args.rows, args.passes)


if __name__ == "__main__":
    main()
