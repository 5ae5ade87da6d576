"""Projection: BERT-large pretraining as config.yaml sets it (NVIDIA's recipe, both phases) on --nodes x
--gpus-per-node GPUs: memory per GPU, tokens, hours and GPU-hours, from measured parts.

    python benchmarks/bert_projection.py      # 2 nodes x 8 H200s; --gpu "NVIDIA H100 80GB HBM3" --nodes 4 ...

Measured here (CPU, the model's own code):
  - activation memory (benchmarks/activation_memory.py): the bytes one bf16-autocast training forward keeps for
    its backward as a GPU trains it: rows laid end to end through flash_varlen (what the flash kernels keep), CUDA's
    bool dropout masks, and the loss through liger's fused linear cross-entropy (pretrain.fused_loss: no logits);
    at three row lengths, fitted as c + a * N (+ b * N * L, ~0 on this path) for N token slots. Packed rows keep a
    row's padding as a sequence of its own, so a micro-batch of R rows of L keeps a * R * L. Also the same with the
    loss through logits, for the shape of `train_step.py --gpu`'s eager step, to hold beside its measured peak;
  - the mean real tokens and predictions of a sequence at each phase's length: train_step.py's Wikipedia-like
    instances (real lengths as encode writes Wikipedia);
  - the parameter count.
Computed: training FLOPs of a sequence at those means (bert.flops_per_sequence: the MFU of train_step.py --gpu).
Read: config.yaml's phases (total_steps, global_batch_size in sequences, micro_batch_size in rows,
encode.phaseN's length and predictions).
Assumed, and printed: the GPU's datasheet bf16 peak (accelerator.peak_flops); model FLOPs utilisations (--mfu;
the defaults: 0.17, the H200's eager step as last measured (docs/benchmarks.md: 15.5% and 17.1%); 0.44, issue 43's
phase-1 goal (NVIDIA DLE's A100 rate); 0.50, MLPerf's H200 rate); LAMB's fp32 weights, gradients and two moments
(16 bytes a parameter; DDP keeps a whole replica on each GPU) beside the measured c; 90% of the GPU's memory
usable; no activation checkpointing; the gradients' fp32 all-reduce once per optimizer step at an NCCL bus
bandwidth of --bus-gbps (inter-node bound), overlapped with nothing: an upper bound on its cost.
Eager: torch.compile keeps less (its partitioner recomputes casts and element-wise ops), so memory is an upper bound.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.activation_memory import MEMORY_GB, activation_fit, most_rows  # noqa: E402
from benchmarks.train_step import CONFIG, instances  # noqa: E402
from workflow.config import PHASES, load_config  # noqa: E402
from workflow.train import accelerator  # noqa: E402
from workflow.train.models.bert import BertConfig, BertForPreTraining, flops_per_sequence  # noqa: E402

H200 = "NVIDIA H200"
MFU = (0.17, 0.44, 0.50)  # the H200's eager step as last measured; issue 43's phase-1 goal; MLPerf's H200
MASKING = 0.15  # encode.masked_lm_prob
FP32 = 4
LAMB_BYTES = 16  # a parameter's fp32 weight, gradient and two moments


def phases(config_path) -> list[dict]:
    """Each phase as config.yaml sets it, with its sequences' mean real tokens and predictions."""
    config = load_config(config_path)
    out = []
    for phase in PHASES:
        length = config["encode"][phase]["max_seq_length"]
        predictions = config["encode"][phase]["max_predictions_per_seq"] or round(MASKING * length)
        sample = instances(BertConfig(), length, predictions, 65536)
        out.append({"phase": phase, "length": length, "rows": config["pretrain"][phase]["micro_batch_size"],
                    "steps": config["pretrain"][phase]["total_steps"],
                    "batch": config["pretrain"][phase]["global_batch_size"],
                    "real": float(sample["input_mask"].sum(1).mean()),
                    "predictions": float((sample["masked_lm_positions"] > 0).sum(1).mean())})
    return out


def memory_table(phase_list, parameters: int, fused: tuple, logits: tuple) -> None:
    """Per phase: the projected peak of a micro-batch of the configured rows, and the most rows that fit."""
    constant, per_slot = fused[0], fused[1]
    static = LAMB_BYTES * parameters + constant
    print(f"\nmemory per GPU (eager, bf16): LAMB {LAMB_BYTES} B/parameter + {constant / 2**30:.2f} GiB a forward = "
          f"{static / 2**30:.2f} GiB, and {per_slot / 1e3:.1f} KB a token slot")
    print(f"| phase | rows x length (config) | activations | projected peak | most rows in "
          f"{' / '.join(f'{gb} GB' for gb in MEMORY_GB)} |")
    print("|---|---|---:|---:|---:|")
    for p in phase_list:
        slots = p["rows"] * p["length"]
        most = most_rows(static, per_slot, p["length"])
        print(f"| {p['phase']} | {p['rows']} x {p['length']} | {per_slot * slots / 2**30:.1f} GiB "
              f"| {(static + per_slot * slots) / 2**30:.1f} GiB | {' / '.join(map(str, most))} |")
    benchmark_static = (LAMB_BYTES - FP32) * parameters + logits[0]  # its steps clear the gradients (set_to_none)
    shapes = ", ".join(f"{(benchmark_static + logits[1] * p['rows'] * p['length']) / 2**30:.1f} GiB at {p['rows']} x "
                       f"{p['length']}" for p in phase_list)
    print(f"train_step.py --gpu's eager step (loss through logits, {logits[1] / 1e3:.1f} KB a slot; LAMB's weights "
          f"and moments, gradients cleared before each forward): {shapes} projected")


def time_table(phase_list, config: BertConfig, parameters: int, args) -> None:
    """Per phase and MFU: real tokens/s a GPU, hours on the GPUs and GPU-hours of the recipe."""
    gpus = args.nodes * args.gpus_per_node
    peak = accelerator.peak_flops(args.gpu, "bf16")
    allreduce_s = 2 * (gpus - 1) / gpus * FP32 * parameters / (args.bus_gbps * 1e9)
    print(f"\ntime on {args.nodes} x {args.gpus_per_node} {args.gpu} (bf16 peak {peak / 1e12:.1f} TFLOPS), "
          f"all-reduce {allreduce_s:.3f} s a step at {args.bus_gbps:.0f} GB/s")
    print("| phase | steps x sequences | real tokens a sequence | real tokens | GFLOP a real token | MFU "
          "| real tokens/s a GPU | hours | GPU-hours |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    totals = {mfu: 0.0 for mfu in args.mfu}
    for p in phase_list:
        sequences = p["steps"] * p["batch"]
        flops = flops_per_sequence(config, p["real"], p["predictions"])
        for mfu in args.mfu:
            compute_s = sequences * flops / (gpus * mfu * peak)
            hours = (compute_s + p["steps"] * allreduce_s) / 3600
            totals[mfu] += hours
            print(f"| {p['phase']} | {p['steps']:,} x {p['batch']:,} | {p['real']:.1f} | "
                  f"{sequences * p['real'] / 1e9:.1f} B | {flops / p['real'] / 1e9:.2f} | {mfu:.0%} "
                  f"| {mfu * peak * p['real'] / flops:,.0f} | {hours:,.2f} | {hours * gpus:,.0f} |")
    for mfu, hours in totals.items():
        print(f"both phases at {mfu:.0%} MFU: {hours:.1f} hours, {hours * gpus:,.0f} GPU-hours")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configfile", default=str(CONFIG))
    parser.add_argument("--preset", default="bert-large")
    parser.add_argument("--vocab", type=int, default=30528, help="vocab_size (NVIDIA's, a multiple of 8)")
    parser.add_argument("--gpu", default=H200, help="the GPU's NVML name, for its bf16 peak (accelerator.py)")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--mfu", type=float, nargs="+", default=MFU, help="model FLOPs utilisations assumed")
    parser.add_argument("--bus-gbps", type=float, default=40.0,
                        help="assumed NCCL all-reduce bus bandwidth across nodes (GB/s; one 400 Gb/s NIC a GPU)")
    parser.add_argument("--measure", type=int, nargs=3, default=(80, 160, 320), help="the row lengths measured")
    args = parser.parse_args(argv)
    if accelerator.peak_flops(args.gpu, "bf16") is None:
        parser.error(f"--gpu {args.gpu!r}: no bf16 datasheet peak (workflow/train/accelerator.py)")
    torch.manual_seed(0)
    config = BertConfig.preset(args.preset, vocab_size=args.vocab)
    model = BertForPreTraining(config).train()
    parameters = sum(p.numel() for p in model.parameters())
    measured, fused = activation_fit(model, args.measure, 2, MASKING, fused_loss=True, varlen=True)
    _, logits = activation_fit(model, args.measure, 2, MASKING, fused_loss=False, varlen=True)
    phase_list = phases(args.configfile)
    print(f"{args.preset}: {parameters / 1e6:.1f} M parameters, vocab {args.vocab:,}")
    print(f"measured: saved for backward {', '.join(f'{b / 2**20:.0f} MiB' for b in measured)} at 2 rows of "
          f"{', '.join(map(str, args.measure))} tokens (varlen attention, fused loss) -> {fused[0] / 2**20:.0f} MiB a "
          f"forward, {fused[1] / 1e3:.1f} KB a token slot, {fused[2]:.1f} B a slot per slot of row; real tokens a "
          f"sequence " + ", ".join(f"{p['real']:.1f} of {p['length']} ({p['predictions']:.1f} predicted)"
                                   for p in phase_list))
    memory_table(phase_list, parameters, fused, logits)
    time_table(phase_list, config, parameters, args)


if __name__ == "__main__":
    main()
