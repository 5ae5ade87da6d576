"""Benchmark: the HDF5 bytes and the encode time of the default recipe (NVIDIA's: static masks, dupe_factor 5,
next-sentence pairs) against dynamic masking with full sentences (encode.masking: dynamic, encode.objective:
full_sentences: the corpus written once, unmasked), on the same text, both in one run.

    python benchmarks/encode_recipes.py [--mb 3] [--seq 128 512] [--vocab vocab.txt]

Text: --mb MB of real Wikipedia text (benchmarks/wikipedia_sample.real_text: the bundled sample through the real
extract and format stages), tokenized once with a 30,522-token WordPiece vocab trained on it (or --vocab). Each
recipe then runs the encode stage (packed, gzip: the DAG's defaults) per sequence length in its own process;
printed: HDF5 bytes, instances (sequences), CPU seconds of the encode process, and the ratios.
"""
import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import h5py  # noqa: E402

from benchmarks.wikipedia_sample import real_text, run_stage  # noqa: E402
from workflow.data.tokenize import tokenize_shard  # noqa: E402
from workflow.data.vocab import train_vocab  # noqa: E402

PREDICTIONS = {128: 20, 512: 80}
RECIPES = {"default (static, nsp, dupe_factor 5)": [],
           "dynamic + full_sentences": ["--masking", "dynamic", "--objective", "full_sentences"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=3.0, help="MB of real Wikipedia text")
    parser.add_argument("--seq", type=int, nargs="+", default=[128, 512], choices=sorted(PREDICTIONS))
    parser.add_argument("--vocab", help="vocab.txt (default: train a 30,522-token one on the text)")
    args = parser.parse_args(argv)
    python = sys.executable
    with tempfile.TemporaryDirectory() as temporary:
        work = Path(temporary)
        text = real_text(args.mb, work / "text.txt")
        vocab = Path(args.vocab) if args.vocab else work / "vocab.txt"
        if not args.vocab:
            train_vocab([text], vocab, size=30522, lowercase=True)
        tokenize_shard(text, vocab, work / "tokenized.npz")
        print(f"text: {args.mb} MB of Wikipedia text ({text.stat().st_size / 1e6:.1f} MB), tokenized once")
        for seq in args.seq:
            print(f"seq {seq} (packed, gzip):")
            results = {}
            for name, options in RECIPES.items():
                output = work / f"seq{seq}_{len(results)}.hdf5"
                measured = run_stage([python, "-m", "workflow.data.encode", "--tokenized", str(work / "tokenized.npz"),
                                      "--vocab", str(vocab), "--output", str(output), "--max-seq-length", str(seq),
                                      "--max-predictions-per-seq", str(PREDICTIONS[seq]), "--split", "training",
                                      "--shard-index", "0", *options])
                with h5py.File(output, "r") as handle:
                    instances = int(handle.attrs["n_instances"])
                results[name] = (output.stat().st_size, measured.cpu)
                print(f"  {name:<38} {output.stat().st_size / 1e6:8.2f} MB  {instances:9,} sequences  "
                      f"{measured.cpu:6.2f} CPU s")
            (default_bytes, default_cpu), (bytes_, cpu) = results.values()
            print(f"  dynamic + full_sentences / default: {bytes_ / default_bytes:.3f} of the bytes "
                  f"({default_bytes / bytes_:.1f}x fewer), {cpu / default_cpu:.3f} of the encode CPU time")


if __name__ == "__main__":
    main()
