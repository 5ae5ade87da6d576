"""Benchmark: text -> pretraining HDF5 per core, ours (tokenize + encode) vs the pure-Python route, same text.

    python benchmarks/encode_throughput.py [--mb 3] [--novel 0.07] [--vocab vocab.txt] [--seq 128 512] [--layouts]

Text: Wikipedia articles of sample/ through the real extract and format stages, repeated to --mb MB (shard
format), with --novel of its words made new (letters shuffled, benchmarks/wikipedia_sample.py with_novel_words):
the repeated sample holds only a few thousand distinct words, which flatters the tokenize stage's word cache, while
a real shard keeps meeting new words (some 5-10% of its whitespace chunks are first seen; 0.07 by default). Vocab: --vocab (e.g. Google's uncased), else a 30,522-token one trained on that text. Both sides run in
this benchmark, on that text file, each step in its own process (so each side's peak RSS is its own; CPU seconds
and peak RSS come from wait4):
  ours:     `python -m workflow.data.tokenize` (one thread) once, then `python -m workflow.data.encode` per length,
            as the DAG does (both phases share one tokenization);
  baseline: benchmarks/google_reference.py per length: Google's FullTokenizer in Python (transformers'
            BertTokenizerLegacy) + Google's create_pretraining_data.py instance by instance + NVIDIA's HDF5 writer,
            i.e. what NVIDIA's create_pretraining_data.py does (it tokenizes again for each length).
Target: ours >= 10x the baseline's instances per CPU second, tokenization included.
"""
import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from wikipedia_sample import real_text, run_stage, with_novel_words  # noqa: E402

PYTHON = sys.executable
PREDICTIONS = {128: 20, 512: 80}
TARGET = 10.0
ONE_THREAD = {"RAYON_NUM_THREADS": "1"}


def instances_in(path: Path) -> int:
    with h5py.File(path, "r") as handle:
        return int(handle["input_ids"].shape[0])


def ours(text: Path, vocab: Path, work: Path, lengths, whole_word_masking: bool) -> dict:
    """Our stages, one process each: tokenize once, encode per length."""
    tokenized = work / "shard_0.npz"
    result = {"tokenize": run_stage([PYTHON, "-m", "workflow.data.tokenize", "--text", text, "--vocab", vocab,
                                     "--output", tokenized, "--threads", 1], env=ONE_THREAD)}
    for length in lengths:
        output = work / f"ours_seq{length}.hdf5"
        command = [PYTHON, "-m", "workflow.data.encode", "--tokenized", tokenized, "--vocab", vocab, "--output", output,
                   "--max-seq-length", length, "--max-predictions-per-seq", PREDICTIONS[length], "--split", "training",
                   "--shard-index", 0]
        command += ["--whole-word-masking"] if whole_word_masking else []
        result[length] = run_stage(command, env=ONE_THREAD)
        result[f"instances{length}"] = instances_in(output)
        result[f"bytes{length}"] = output.stat().st_size
    with np.load(tokenized) as data:
        result["tokens"] = int(len(data["ids"]))
    # A process's cost before any work (interpreter, imports): fixed per job, negligible at a real shard's size.
    result["startup"] = {step: run_stage([PYTHON, "-c", f"import workflow.data.{step}"]).cpu
                         for step in ("tokenize", "encode")}
    return result


def net(mine: dict, step) -> float:
    """CPU seconds of our `step` (tokenize or a length) without its process startup."""
    measured = mine[step].cpu
    return max(measured - mine["startup"]["tokenize" if step == "tokenize" else "encode"], 0.1 * measured)


def baseline(text: Path, vocab: Path, work: Path, lengths, whole_word_masking: bool) -> dict:
    """The pure-Python route, one process per length (each tokenizes the text itself, as NVIDIA's script does)."""
    result = {}
    for length in lengths:
        output = work / f"baseline_seq{length}.hdf5"
        command = [PYTHON, str(ROOT / "benchmarks" / "google_reference.py"), "--text", text, "--vocab", vocab,
                   "--output", output, "--max-seq-length", length, "--max-predictions-per-seq", PREDICTIONS[length]]
        command += ["--whole-word-masking"] if whole_word_masking else []
        result[length] = run_stage(command, env=ONE_THREAD)
        result[f"phases{length}"] = json.loads(result[length].stdout)["seconds"]
        result[f"instances{length}"] = instances_in(output)
    return result


def profile_ours(text: Path, vocab: Path, work: Path, length: int) -> None:
    """Where our time goes: cProfile of tokenize + encode in this process, top functions by own time."""
    from workflow.data.encode import EncodeSettings, encode_shard
    from workflow.data.tokenize import tokenize_shard

    os.environ.update(ONE_THREAD)
    profile = cProfile.Profile()
    profile.enable()
    tokenize_shard(text, vocab, work / "profile.npz")
    encode_shard(work / "profile.npz", vocab, work / "profile.hdf5",
                 EncodeSettings(max_seq_length=length, max_predictions_per_seq=PREDICTIONS[length]), 12345, "training", 0)
    profile.disable()
    print(f"\nprofile of ours at seq {length} (tokenize + encode in one process), top 12 by own time:")
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(12)


LAYOUTS = {
    "NVIDIA: gzip-4, h5py auto chunks": lambda shape: {"compression": "gzip"},
    "ours: gzip-1+shuffle, 64-row chunks": lambda shape: {"compression": "gzip", "compression_opts": 1, "shuffle": True,
                                                          "chunks": (64,) + shape[1:] if len(shape) > 1 else (min(16384, shape[0]),)},
    "uncompressed, contiguous": lambda shape: {},
    "lzf, 64-row chunks (bytes vary run to run)": lambda shape: {"compression": "lzf",
                                                                  "chunks": (64,) + shape[1:] if len(shape) > 1 else (min(16384, shape[0]),)},
}


def compare_layouts(source: Path, directory: Path, rows: int = 50_000, reads: int = 2000) -> None:
    with h5py.File(source, "r") as handle:
        arrays = {name: handle[name][:rows] for name in handle}
    rows = len(arrays["input_ids"])  # the file may hold fewer
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


def report(text_mb: float, novel: float, mine: dict, theirs: dict, lengths) -> None:
    tokenize_cpu = net(mine, "tokenize")
    print(f"text: {text_mb:.1f} MB of Wikipedia text with {novel:.0%} of its words made new (--novel), "
          f"{mine['tokens']:,} tokens; one core each side, CPU seconds "
          f"(wait4) less process startup; the machine may be shared, both sides ran in this one run")
    print("  ours:     tokenize stage once (HF tokenizers' Rust WordPiece, 1 thread) + encode stage per length (numpy),"
          f" startup {mine['startup']['tokenize']:.2f} + {mine['startup']['encode']:.2f} s subtracted")
    print("  baseline: per length, Python FullTokenizer + Google's instance creation per instance + NVIDIA's HDF5 "
          "writer, timed inside its process (imports excluded)")
    for length in lengths:
        encode_cpu, reference, phases = net(mine, length), theirs[length], theirs[f"phases{length}"]
        ours_cpu, base_cpu = tokenize_cpu + encode_cpu, sum(phases.values())
        ours_rate = mine[f"instances{length}"] / ours_cpu
        base_rate = theirs[f"instances{length}"] / base_cpu
        ratio = ours_rate / base_rate
        ours_rss = max(mine["tokenize"].rss_mb, mine[length].rss_mb)
        print(f"\nseq {length}, tokenization included on both sides:")
        print(f"  ours:     {mine[f'instances{length}']:9,} instances, {ours_cpu:7.2f} s CPU (tokenize {tokenize_cpu:.2f} + "
              f"encode {encode_cpu:.2f}) = {ours_rate:9,.0f} instances/s/core, peak RSS {ours_rss:.0f} MB")
        print(f"  baseline: {theirs[f'instances{length}']:9,} instances, {base_cpu:7.2f} s CPU (tokenize "
              f"{phases['tokenize']:.2f} + create {phases['create']:.2f} + write {phases['write']:.2f}) = "
              f"{base_rate:9,.0f} instances/s/core, peak RSS {reference.rss_mb:.0f} MB")
        print(f"  ours / baseline: {ratio:.1f}x per core (target >= {TARGET:.0f}x: "
              f"{'MET' if ratio >= TARGET else f'MISSED by {TARGET / ratio:.2f}x'}); peak RSS "
              f"{ours_rss / reference.rss_mb:.2f}x")
        encode_ratio = (mine[f"instances{length}"] / encode_cpu) / (theirs[f"instances{length}"] / (phases["create"] + phases["write"]))
        print(f"  by step: tokenize {phases['tokenize'] / tokenize_cpu:.1f}x the Python tokenizer "
              f"({mine['tokens'] / tokenize_cpu / 1e6:.2f} vs {mine['tokens'] / phases['tokenize'] / 1e6:.2f} M tokens/s), "
              f"encode {encode_ratio:.1f}x create + write; tokenize is {tokenize_cpu / ours_cpu:.0%} of ours")
    if len(lengths) > 1:
        ours_cpu = tokenize_cpu + sum(net(mine, length) for length in lengths)
        base_cpu = sum(sum(theirs[f"phases{length}"].values()) for length in lengths)
        ours_n = sum(mine[f"instances{length}"] for length in lengths)
        base_n = sum(theirs[f"instances{length}"] for length in lengths)
        print(f"\nboth lengths from the text (ours tokenizes once, the baseline once per length, as NVIDIA's script): "
              f"ours {ours_cpu:.2f} s, baseline {base_cpu:.2f} s CPU: {ours_n / ours_cpu / (base_n / base_cpu):.1f}x per core")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=3.0, help="MB of text (the baseline runs ~1 min per 3 MB)")
    parser.add_argument("--novel", type=float, default=0.07,
                        help="fraction of the text's words made new, as in a real shard (0: the repeated sample as is)")
    parser.add_argument("--vocab", help="vocab.txt (default: train a 30,522-token one on the text)")
    parser.add_argument("--seq", type=int, nargs="+", default=[128, 512], choices=[128, 512])
    parser.add_argument("--whole-word-masking", action="store_true", help="both sides mask whole words")
    parser.add_argument("--profile", action="store_true", help="also cProfile ours at the first --seq")
    parser.add_argument("--layouts", action="store_true", help="also compare HDF5 layouts for a training loader")
    args = parser.parse_args()

    from workflow.data.vocab import train_vocab

    with tempfile.TemporaryDirectory() as name:
        work = Path(name)
        text = real_text(args.mb, work / "shard_0.txt")
        if args.novel:
            text.write_text(with_novel_words(text.read_text(encoding="utf-8"), args.novel), encoding="utf-8")
        vocab = Path(args.vocab) if args.vocab else work / "vocab.txt"
        if not args.vocab:
            train_vocab([text], vocab, size=30522, lowercase=True)
        mine = ours(text, vocab, work, args.seq, args.whole_word_masking)
        theirs = baseline(text, vocab, work, args.seq, args.whole_word_masking)
        report(text.stat().st_size / 1e6, args.novel, mine, theirs, args.seq)
        if args.profile:
            profile_ours(text, vocab, work, args.seq[0])
        if args.layouts:
            compare_layouts(work / f"ours_seq{args.seq[0]}.hdf5", work)


if __name__ == "__main__":
    main()
