"""Benchmark: the data half and the loader at 1,024 and 8,192 tokens a sequence, on real text, on CPU.

    python benchmarks/long_context.py [--mb 4] [--lengths 1024 8192] [--text python-docs|wikipedia|PATH]
                                      [--max-sequences-per-pack auto 16 3]   (each packing, side by side)

Text: --mb MB of real text (python3-doc's reST sources by default, or Wikipedia's vital articles' leads;
benchmarks/learning_parity.read_documents), one sentence a line (Punkt), a byte-level BPE of up to ModernBERT's 50,368
ids trained on it (workflow.data.vocab.train_bpe) and the text tokenized once (workflow.data.tokenize). Then, per
length, each in its own process (CPU from wait4, benchmarks/wikipedia_sample.run_stage; peak RSS from the process's
own VmHWM, since wait4's maxrss keeps the forking parent's):
  - encode: the encode stage's main (packed with --max-sequences-per-pack, gzip, dynamic masks, the recipe's
    objective and masking rule, documents and per_token, where the encoder has them, else full_sentences and google;
    masked_lm_prob 0.3, max_predictions_per_seq derived as the DAG derives it): HDF5 bytes per packed row of
    `length` slots and per real token, and real tokens per CPU second;
  - loader: the trainer's reader (workflow.train.pretraining_data.PretrainingSequences) over the whole file in
    steps of micro-batches of 65,536 token slots, each masked at load time and given the family's host indices
    (workflow.train.models.family: the unpadded tokens and cu_seqlens the varlen kernel reads): real tokens per second
    (wall and CPU) and its peak RSS.
The model's activation memory a token comes from benchmarks/modernbert_projection.activation_fit (bytes autograd
saves under bf16 autocast, ModernBERT-base, fitted at 64/128/256 tokens): what a GPU's flash kernel keeps a token,
the same at every length, and the dense CPU path's, which grows with the row; at 1,024 the dense path's bytes are
measured directly as a check of the fit (at 8,192 they would need ~40 GB).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MASKING = 0.3  # ModernBERT's masked_lm_prob
MICRO_BATCH_TOKENS = 65536  # token slots a micro-batch of the loader measurement (64 rows at 1,024, 8 at 8,192)
STEP_MICRO_BATCHES = 4


def recipe_masks() -> tuple[str, str]:
    """The recipe's (objective, masking rule), documents and per_token, where this checkout's encoder has them, else
    full_sentences and google."""
    from workflow.data import masking_rule

    return ("documents" if "documents" in masking_rule.OBJECTIVES else "full_sentences",
            "per_token" if "per_token" in getattr(masking_rule, "MASKING_RULES", ()) else "google")


def max_predictions(length: int, rule: str) -> int:
    """max_predictions_per_seq at `length`: the encoder's derived cap, else every prediction of a full sequence."""
    from workflow.data import masking_rule

    if hasattr(masking_rule, "derived_max_predictions"):
        return masking_rule.derived_max_predictions(length, rule, (MASKING,))
    return math.ceil(MASKING * length)


def write_text(text: str | None, megabytes: float, output: Path) -> Path:
    """About `megabytes` MB of `text`'s documents in shard format (one sentence a line, blank line between)."""
    from benchmarks.learning_parity import read_documents, shard_text

    documents, size = [], 0
    for document in read_documents(text):
        documents.append(document)
        size += len(document.encode("utf-8"))
        if size >= megabytes * 1e6:
            break
    output.write_text(shard_text(documents), encoding="utf-8")
    return output


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM: its own, unlike wait4's maxrss, which keeps the forking parent's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_encode(argv: list[str]) -> None:
    """The encode stage's own main (run in its own process), then its peak RSS on stdout."""
    from workflow.data.encode import main as encode_main

    encode_main(argv)
    print(json.dumps({"rss_mb": peak_rss_mb()}))


def read_file(directory: Path, length: int) -> dict:
    """The loader measurement (run in its own process): every sequence of `directory`/training read in steps of
    micro-batches, masked, with the family's host indices."""
    import numpy as np

    from workflow.train.models.family import family
    from workflow.train.pretraining_data import PretrainingSequences, list_shards

    shards = list_shards(directory, "training")
    sequences = PretrainingSequences(shards, seed=12345)
    rows = max(1, MICRO_BATCH_TOKENS // length)
    per_row = float(np.mean(shards[0].sequences_per_row)) if shards[0].packed else 1.0
    step = max(1, int(rows * STEP_MICRO_BATCHES * per_row))
    host_indices = family("modernbert").module.host_indices  # imported before the clock starts
    real, predicted, before = 0, 0, peak_rss_mb()
    wall, cpu = time.perf_counter(), time.process_time()
    for start in range(0, sequences.epoch_length, step):
        for batch in sequences.micro_batches(start, min(step, sequences.epoch_length - start), 0, 1, rows):
            batch = host_indices(batch)
            real += int((batch["attention_mask"] > 0).sum())
            predicted += int((batch["masked_lm_targets"] >= 0).sum())
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"sequences": sequences.epoch_length, "real_tokens": real, "predicted": predicted, "wall_s": wall,
            "cpu_s": cpu, "rss_mb": peak_rss_mb(), "rss_before_mb": before}


def dense_saved_bytes_per_token(length: int) -> float:
    """Bytes autograd saves a token on the dense CPU path, measured on one full row of `length` tokens minus the
    bf16 weight copy (the fit's constant is that copy: 2 bytes a parameter of every matrix)."""
    from benchmarks.modernbert_projection import base_model, saved_bytes

    model = base_model()
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    return (saved_bytes(model, 1, length) - 2 * matrices) / length


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=4.0, help="MB of real text")
    parser.add_argument("--text", default=None, help="python-docs (default), wikipedia, a directory or a file")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--vocab-size", type=int, default=50368, help="BPE ids (ModernBERT's)")
    parser.add_argument("--no-model", action="store_true", help="skip the activation-memory measurement")
    parser.add_argument("--max-sequences-per-pack", nargs="+", default=["3"],
                        help="encode.packing.max_sequences_per_pack: counts or auto (as many as fit), each measured")
    parser.add_argument("--read", type=Path, help=argparse.SUPPRESS)  # the loader's own process
    parser.add_argument("--encode", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # the encoder's own process
    args = parser.parse_args(argv)
    if args.read:
        print(json.dumps(read_file(args.read, args.lengths[0])))
        return
    if args.encode:
        run_encode(args.encode)
        return

    import h5py

    from benchmarks.wikipedia_sample import run_stage
    from workflow.data.tokenize import tokenize_shard
    from workflow.data.vocab import train_bpe

    python, (objective, rule) = sys.executable, recipe_masks()
    with tempfile.TemporaryDirectory() as temporary:
        work = Path(temporary)
        started = time.perf_counter()
        text = write_text(args.text, args.mb, work / "text.txt")
        vocab = work / "tokenizer.json"
        ids = train_bpe([text], vocab, args.vocab_size)
        counts = tokenize_shard(text, vocab, work / "tokenized.npz")
        print(f"text: {text.stat().st_size / 1e6:.1f} MB ({args.text or 'python-docs'}), {counts['documents']:,} "
              f"documents, {counts['tokens']:,} tokens ({counts['tokens'] / counts['documents']:,.0f} a document), "
              f"BPE of {ids:,} ids; prepared in {time.perf_counter() - started:.0f} s")
        print(f"encode: packed ({' / '.join(args.max_sequences_per_pack)} a row at most, gapfill), gzip, dynamic "
              f"masks, objective {objective}, masking rule {rule}, masked_lm_prob {MASKING}; loader: micro-batches of "
              f"{MICRO_BATCH_TOKENS:,} token slots, masked at load time, with ModernBERT's host indices")
        rows = []
        for per_row, length in itertools.product(args.max_sequences_per_pack, args.lengths):
            output = work / f"{per_row}_seq{length}" / "training" / "shard_0.hdf5"
            output.parent.mkdir(parents=True)
            encode = run_stage([python, Path(__file__).resolve(), "--encode", "--tokenized", work / "tokenized.npz",
                                "--vocab", vocab, "--output", output, "--max-seq-length", length,
                                "--max-predictions-per-seq", max_predictions(length, rule), "--masked-lm-prob", MASKING,
                                "--masking", "dynamic", "--objective", objective, "--dupe-factor", 1,
                                "--split", "training", "--shard-index", 0,
                                *(["--masking-rule", rule] if rule != "google" else []),
                                "--max-sequences-per-pack", per_row])
            with h5py.File(output, "r") as handle:
                attributes = dict(handle.attrs)
            size = output.stat().st_size
            loader = run_stage([python, Path(__file__).resolve(), "--read", output.parent.parent,
                                "--lengths", length])
            read = json.loads(loader.stdout)
            assert read["real_tokens"] == int(attributes["n_real_tokens"]), (read, attributes["n_real_tokens"])
            encoded = json.loads(encode.stdout.strip().splitlines()[-1])
            rows.append((per_row, length, attributes, size, encode, encoded, read))
        print("| a row at most | tokens a sequence | sequences | packed rows | fill | HDF5 bytes a row "
              "| HDF5 bytes a token | encode+pack tokens/s a core | encode peak RSS | loader tokens/s (a CPU s) "
              "| loader peak RSS (before reading) |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for per_row, length, attributes, size, encode, encoded, read in rows:
            tokens = int(attributes["n_real_tokens"])
            print(f"| {per_row} | {length:,} | {int(attributes['n_instances']):,} | {int(attributes['n_packs']):,} "
                  f"| {float(attributes['fill']):.3f} | {size / int(attributes['n_packs']):,.0f} "
                  f"| {size / tokens:.3f} | {tokens / encode.cpu:,.0f} | {encoded['rss_mb']:,.0f} MB "
                  f"| {tokens / read['wall_s']:,.0f} ({tokens / read['cpu_s']:,.0f}) "
                  f"| {read['rss_mb']:,.0f} MB ({read['rss_before_mb']:,.0f}) |")
    if args.no_model:
        return
    from benchmarks.modernbert_projection import activation_fit, base_model

    model = base_model()
    _, (constant, kept, quadratic) = activation_fit(model, (64, 128, 256))
    print(f"model (ModernBERT-base, bf16 autocast, fitted at 64/128/256 tokens): {constant / 2**20:.0f} MiB a forward "
          f"(the bf16 weights) + {kept / 1e3:.1f} KB a token kept with a flash kernel + {quadratic:.1f} B a token per "
          f"token of row on the dense CPU path")
    print("| tokens a sequence | activations a token, GPU (flash) | activations a token, dense CPU path (fit) "
          "| dense CPU path, measured |")
    print("|---:|---:|---:|---:|")
    for length in args.lengths:
        measured = f"{dense_saved_bytes_per_token(length) / 1e3:,.1f} KB" if length <= 1024 else "-"
        print(f"| {length:,} | {kept / 1e3:,.1f} KB | {(kept + quadratic * length) / 1e3:,.1f} KB | {measured} |")


if __name__ == "__main__":
    main()
