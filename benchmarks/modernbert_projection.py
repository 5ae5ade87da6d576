"""Projection: ModernBERT tokens/s and memory per GPU at 1,024 and 8,192 tokens on 8 H100s, from measured parts.

    python benchmarks/modernbert_projection.py            # modernbert-base; --preset modernbert-large

Measured here (CPU, the model's own code, bf16 autocast):
  - activation memory (benchmarks/activation_memory.py): the bytes one training forward keeps for its backward as
    a GPU trains it (rows laid end to end through flash_varlen's ops, which keep what the flash kernels keep; the
    MLM loss at 30% of the tokens through liger's fused linear cross-entropy, pretrain.fused_loss: no logits), on
    full rows at three lengths, fitted as c + a * N + b * N * L for N tokens in rows of L: c once per forward (the
    bf16 weight copy, the fused loss's decoder gradient), a per token, b ~0 on this path;
  - the parameter count of the preset.
Computed: training FLOPs per token (workflow.train.models.modernbert.flops_per_sequence: the GLU's three products, the
local layers' attention within the window, the head at the predicted tokens).
Assumed, and printed: the H100 SXM's datasheet bf16 dense peak (workflow.train.accelerator), a model FLOPs
utilisation (MFU; 40% by default, --mfu), AdamW with fp32 weights, gradients and two moments (16 bytes a
parameter, beside the measured c; DDP keeps a whole replica on each GPU), no activation checkpointing, and the
gradients' all-reduce at an NCCL bus bandwidth of --bus-gbps over NVLink, overlapped with nothing (an upper bound on
its cost). Eager: torch.compile keeps less (its partitioner recomputes casts and element-wise ops).
The ratio of our step time to Hugging Face's on the same batch is benchmarks/modernbert_step.py's.

At full size (corpus_table): recipes/modernbert-base.yaml on the English Wikipedia (17.9 GB of text) and on 100 GB
of text: tokens at --tokens-per-byte (full_dump_projection.py's enwiki ratio), --test-fraction held out; HDF5 bytes
of each phase's data (the whole corpus encoded once at its length, dynamic masks) at --hdf5-bytes-per-token
(benchmarks/long_context.py, measured at 1,024 and 8,192 on well-filled rows); hours and GPU-hours of each phase at
the tokens/s on --gpus above, for the published budget (1,719B then 300B tokens) and for one epoch in phase 1 with
phase 2 the recipe's share of it (300/1,719): GPU-hours scale with the epochs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.activation_memory import MEMORY_GB, activation_fit, most_rows  # noqa: E402
from workflow.train import accelerator  # noqa: E402
from workflow.train.models.modernbert import ModernBertConfig, ModernBertForMaskedLM, flops_per_sequence  # noqa: E402

MASKING = 0.3  # ModernBERT's masking rate
LENGTHS = (1024, 8192)
H100 = "NVIDIA H100 80GB HBM3"
RECIPE_TOKENS = {1024: 1_719e9, 8192: 300e9}  # recipes/modernbert-base.yaml: phase 1's and phase 2's token budgets
TOKENS_PER_BYTE = 3.5e9 / 17.9e9  # full_dump_projection.py: enwiki's 3.5 B tokens of 17.9 GB of text
HDF5_BYTES_PER_TOKEN = (1.49, 1.38)  # benchmarks/long_context.py at 1,024 and 8,192 (python docs, rows packed auto)
CORPORA = {"English Wikipedia (17.9 GB of text)": 17.9e9, "100 GB of text": 100e9}


def base_model(preset: str = "modernbert-base", vocab: int = 50368) -> ModernBertForMaskedLM:
    """The preset's masked-LM model with ModernBERT's vocab size, in training mode, seeded."""
    torch.manual_seed(0)
    config = ModernBertConfig.preset(preset, vocab_size=vocab, pad_token_id=0, cls_token_id=1, sep_token_id=2,
                                     bos_token_id=1, eos_token_id=2)
    return ModernBertForMaskedLM(config).train()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="modernbert-base")
    parser.add_argument("--vocab", type=int, default=50368, help="vocab_size (ModernBERT's)")
    parser.add_argument("--mfu", type=float, default=0.40, help="assumed model FLOPs utilisation")
    parser.add_argument("--bus-gbps", type=float, default=360.0, help="assumed NCCL all-reduce bus bandwidth (GB/s)")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--step-tokens", type=int, default=4_718_592,
                        help="tokens per optimizer step, all GPUs (ModernBERT's 4,608 x 1,024)")
    parser.add_argument("--measure", type=int, nargs=3, default=(80, 160, 320), help="the row lengths measured")
    parser.add_argument("--tokens-per-byte", type=float, default=TOKENS_PER_BYTE,
                        help="tokens a byte of text (full_dump_projection.py's enwiki: 3.5 B tokens of 17.9 GB)")
    parser.add_argument("--hdf5-bytes-per-token", type=float, nargs=2, default=HDF5_BYTES_PER_TOKEN,
                        help="HDF5 bytes a token at 1,024 and 8,192 (benchmarks/long_context.py)")
    parser.add_argument("--test-fraction", type=float, default=0.1, help="shard.test_fraction: held out, not trained")
    args = parser.parse_args(argv)
    model = base_model(args.preset, args.vocab)
    config = model.config
    parameters = sum(p.numel() for p in model.parameters())
    rows = 2
    measured, (constant, kept, quadratic) = activation_fit(model, args.measure, rows, MASKING, fused_loss=True,
                                                           varlen=True)
    peak = accelerator.peak_flops(H100, "bf16")
    static = 16 * parameters + constant
    print(f"{args.preset}: {parameters / 1e6:.1f} M parameters; window {config.local_attention}, a global layer "
          f"every {config.global_attn_every_n_layers}")
    print(f"measured: saved for backward {', '.join(f'{b / 2**20:.0f} MiB' for b in measured)} at "
          f"{rows} rows of {', '.join(map(str, args.measure))} tokens (varlen attention, fused loss) -> "
          f"{constant / 2**20:.0f} MiB a forward (the bf16 weights, the decoder's gradient), {kept / 1e3:.1f} KB a "
          f"token, {quadratic:.1f} B a token per token of row")
    print(f"assumed: {H100} bf16 peak {peak / 1e12:.1f} TFLOPS, MFU {args.mfu:.0%}, AdamW 16 B/parameter + a forward's "
          f"({static / 2**30:.1f} GiB), all-reduce bus {args.bus_gbps:.0f} GB/s, {args.step_tokens:,} tokens a step")
    print("| tokens a sequence | training GFLOP a token | tokens/s a GPU | tokens/s on 8 | all-reduce share "
          f"| activations GiB per 64k tokens | most sequences a micro-batch in "
          f"{' / '.join(f'{gb} GB' for gb in MEMORY_GB)} |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    on_gpus = {}
    for length in LENGTHS:
        flops = flops_per_sequence(config, length, MASKING * length) / length
        per_gpu = args.mfu * peak / flops
        step_s = args.step_tokens / (per_gpu * args.gpus)
        allreduce_s = 2 * (args.gpus - 1) / args.gpus * 2 * parameters / (args.bus_gbps * 1e9)  # bf16 gradients
        total = args.gpus * per_gpu * step_s / (step_s + allreduce_s)
        fits = " / ".join(map(str, most_rows(static, kept, length)))
        on_gpus[length] = total
        print(f"| {length:,} | {flops / 1e9:.2f} | {per_gpu:,.0f} | {total:,.0f} | {allreduce_s / step_s:.2%} "
              f"| {kept * 65536 / 2**30:.1f} | {fits} |")
    corpus_table(on_gpus, args)


def corpus_table(on_gpus: dict[int, float], args) -> None:
    """Tokens, HDF5 bytes and GPU-hours of each phase of recipes/modernbert-base.yaml on each of CORPORA, at the
    tokens/s on args.gpus GPUs above: the published budget, and one epoch in phase 1 with phase 2 the recipe's share
    of it."""
    print(f"\nrecipes/modernbert-base.yaml at full size: text at {args.tokens_per_byte:.3f} tokens a byte, "
          f"{args.test_fraction:.0%} held out; HDF5 at {args.hdf5_bytes_per_token[0]} and "
          f"{args.hdf5_bytes_per_token[1]} bytes a token (each phase's data is the whole corpus at its length, "
          f"written once: dynamic masks); hours at the tokens/s on {args.gpus} above")
    print(f"| corpus | tokens (trained) | phase | HDF5 on disk | budget | tokens trained | epochs | hours on "
          f"{args.gpus} H100s | GPU-hours |")
    print("|---|---:|---|---:|---|---:|---:|---:|---:|")
    share = RECIPE_TOKENS[LENGTHS[1]] / RECIPE_TOKENS[LENGTHS[0]]
    for name, text_bytes in CORPORA.items():
        tokens = text_bytes * args.tokens_per_byte
        trained = tokens * (1 - args.test_fraction)
        budgets = {"published": RECIPE_TOKENS, "one epoch, then the recipe's share": {
            LENGTHS[0]: trained, LENGTHS[1]: trained * share}}
        for budget, counts in budgets.items():
            for phase, (length, bytes_per_token) in enumerate(zip(LENGTHS, args.hdf5_bytes_per_token), 1):
                hours = counts[length] / on_gpus[length] / 3600
                print(f"| {name} | {tokens / 1e9:.1f} B ({trained / 1e9:.1f} B) | {phase} ({length:,}) "
                      f"| {tokens * bytes_per_token / 1e9:.1f} GB | {budget} | {counts[length] / 1e9:,.1f} B "
                      f"| {counts[length] / trained:,.2f} | {hours:,.1f} | {hours * args.gpus:,.0f} |")


if __name__ == "__main__":
    main()
