"""Benchmark: snakebert's ModernBERT training step (forward + backward) vs Hugging Face's ModernBertForMaskedLM, on
the same batch and the same weights, steps alternating between the sides.

    python benchmarks/modernbert_step.py                    # CPU, fp32: the tiny preset and a base-shaped small model
    python benchmarks/modernbert_step.py --repeats 3 --seq 128 --micro-batch 4   # a short CPU run
    python benchmarks/modernbert_step.py --gpu              # CUDA, bf16 autocast, base-shaped models at --gpu-seq;
                                                            # without a CUDA device it says so and exits 0
    python benchmarks/modernbert_step.py --gpu --compile [--compile-mode max-autotune-no-cudagraphs]
                                                            # also ours under torch.compile, on the same batch

Models (workflow.train.models.modernbert presets, --vocab tokens): `tiny` (modernbert-tiny: 4 layers x 128) and `base-small`
(modernbert-base's widths, 768 hidden, 12 heads, 1,152 intermediate, window 128, with --base-layers layers: a global
layer and local ones). `--gpu` runs modernbert-base whole (22 layers) instead.
Batch: --micro-batch rows of --seq tokens, real lengths drawn between half and all of a row (the rest padding), 30%
of the real tokens predicted (ModernBERT's masking rate). Sides, each a forward, the MLM cross-entropy and a backward
(gradients zeroed after; no optimizer step):
   - ours: ModernBertForMaskedLM as training calls it (modernbert.host_indices: the head at the predicted tokens only;
     on CUDA the real tokens through torch's varlen flash attention with the local window, on CPU rows with masks);
   - hf: transformers' ModernBertForMaskedLM (attn_implementation sdpa), labels -100 elsewhere: the head at every
     position (its default);
   - hf sparse: the same with sparse_prediction (the head at the labelled tokens only, as ModernBERT's recipe trains);
   - ours compiled (--compile): ours under torch.compile(mode=--compile-mode, dynamic=False), as pretrain.compile
     runs it (compiled before the timed rounds).
Each repeat runs every side once, the order rotating, after --warmup untimed rounds; medians printed, with each
side's time relative to hf: wall time, and the process's CPU time (summed over its threads: what other processes
on a shared machine disturb least; on CUDA it is the host's share only). GPU: also peak memory and MFU (FLOPs: modernbert.flops_per_sequence at the mean real
length, counting the GLU and the window; peak: the card's datasheet bf16 figure).
"""
from __future__ import annotations

import argparse
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workflow.train import accelerator  # noqa: E402
from workflow.train.models.kit import unpadded_of  # noqa: E402
from workflow.train.models.modernbert import (ModernBertConfig, ModernBertForMaskedLM, flops_per_sequence,  # noqa: E402
                                       host_indices)
from workflow.train.precision import autocast  # noqa: E402

MASKING = 0.3  # ModernBERT's masking rate


def configs(args) -> dict[str, ModernBertConfig]:
    special = dict(vocab_size=args.vocab, pad_token_id=0, bos_token_id=1, cls_token_id=1, eos_token_id=2,
                   sep_token_id=2)
    if args.gpu:
        return {"modernbert-base": ModernBertConfig.preset("modernbert-base", **special)}
    return {"tiny": ModernBertConfig.preset("modernbert-tiny", **special),
            f"base-small ({args.base_layers} layers)": ModernBertConfig.preset(
                "modernbert-base", num_hidden_layers=args.base_layers, **special)}


def make_batch(rows: int, length: int, vocab: int, seed: int = 0) -> dict:
    """Padded rows (real lengths in [length/2, length]) and MLM targets at 30% of the real tokens."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=generator)
    real = torch.arange(length)[None, :] < lengths[:, None]
    input_ids = torch.randint(3, vocab, (rows, length), generator=generator).masked_fill(~real, 0)
    chosen = real & (torch.rand(rows, length, generator=generator) < MASKING)
    width = int(chosen.sum(1).max())
    positions = torch.zeros(rows, width, dtype=torch.long)
    labels = torch.full((rows, width), -1)
    for row in range(rows):
        slots = chosen[row].nonzero().squeeze(1)
        positions[row, :len(slots)], labels[row, :len(slots)] = slots, input_ids[row, slots]
    hf_labels = torch.full_like(input_ids, -100).masked_scatter(chosen, input_ids[chosen])
    return {"input_ids": input_ids, "attention_mask": real.long(), "masked_lm_positions": positions,
            "masked_lm_labels": labels, "hf_labels": hf_labels}


def to(batch: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def ours_step(model, batch):
    logits, _ = model(batch["input_ids"], None, batch["attention_mask"], batch["masked_lm_positions"],
                      masked_lm_index=batch["masked_lm_index"], unpadded=unpadded_of(batch),
                      mask_needed=batch["mask_needed"])
    return F.cross_entropy(logits.float(), batch["masked_lm_targets"], ignore_index=-1)  # -1: empty slots


def hf_step(model, batch, sparse: bool):
    model.sparse_prediction = sparse
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["hf_labels"]).loss


def peak_memory(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{accelerator.peak_memory_bytes(device) / 2**30:.1f} GiB peak allocated"
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB process peak RSS"


def mfu(device: torch.device, flops_per_second: float) -> str:
    peak = accelerator.peak_flops(accelerator.device_name(device), "bf16") if device.type == "cuda" else None
    return f"{flops_per_second / peak:.1%}" if peak else "n/a"


def compare(name: str, config: ModernBertConfig, args, device: torch.device) -> None:
    import transformers

    torch.manual_seed(0)
    ours = ModernBertForMaskedLM(config).to(device).train()
    hf = transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(**config.to_dict(),
                                                                          attn_implementation="sdpa"))
    state = ours.state_dict()
    hf.load_state_dict({**state, "decoder.weight": state["model.embeddings.tok_embeddings.weight"]}, strict=True)
    hf.to(device).train()
    seq = args.gpu_seq if args.gpu else args.seq
    batch = to(host_indices(make_batch(args.micro_batch, seq, config.vocab_size)), device)
    sides = {"ours": (ours, lambda: ours_step(ours, batch)), "hf": (hf, lambda: hf_step(hf, batch, False)),
             "hf sparse": (hf, lambda: hf_step(hf, batch, True))}
    if args.compile:
        compiled = torch.compile(ours, mode=args.compile_mode, dynamic=False)
        sides["ours compiled"] = (ours, lambda: ours_step(compiled, batch))
    precision = "bf16" if args.gpu else "fp32"
    times = {side: [] for side in sides}
    cpu_times = {side: [] for side in sides}  # CPU seconds of the process: less hit by other processes than wall time
    losses = {}
    peaks = {}
    for round_ in range(max(args.warmup, 1 if args.compile else 0) + args.repeats):
        order = list(sides)[round_ % len(sides):] + list(sides)[:round_ % len(sides)]
        for side in order:
            model, step = sides[side]
            accelerator.reset_peak_memory(device)
            accelerator.synchronize(device)
            start, cpu_start = time.perf_counter(), time.process_time()
            with autocast(device, precision):
                loss = step()
            loss.backward()
            accelerator.synchronize(device)
            elapsed, cpu_elapsed = time.perf_counter() - start, time.process_time() - cpu_start
            model.zero_grad(set_to_none=True)
            if round_ >= max(args.warmup, 1 if args.compile else 0):
                times[side].append(elapsed)
                cpu_times[side].append(cpu_elapsed)
                losses[side], peaks[side] = float(loss.detach()), peak_memory(device)
    mean_length = float(batch["attention_mask"].float().sum(1).mean())
    predictions = int((batch["masked_lm_targets"] >= 0).sum()) / args.micro_batch
    flops = flops_per_sequence(config, round(mean_length), predictions)
    baseline = statistics.median(times["hf"])
    where = (f"GPU {accelerator.device_name(device)}" if device.type == "cuda" else
             f"CPU {platform.machine()}, {torch.get_num_threads()} threads")
    print(f"\n{name}: {config.num_hidden_layers} layers x {config.hidden_size}, vocab {config.vocab_size}, "
          f"{args.micro_batch} rows x {seq} tokens (mean real {mean_length:.0f}), {precision}, "
          f"{args.repeats} repeats, {where}")
    cpu_baseline = statistics.median(cpu_times["hf"])
    print(f"{'side':<10} {'median ms':>10} {'min ms':>8} {'vs hf':>6} {'cpu ms':>8} {'vs hf':>6} {'loss':>8}  "
          f"{'MFU':>6}  memory")
    for side, samples in times.items():
        median, cpu = statistics.median(samples), statistics.median(cpu_times[side])
        utilisation = mfu(device, args.micro_batch * flops / median)
        print(f"{side:<10} {median * 1e3:>10.1f} {min(samples) * 1e3:>8.1f} {median / baseline:>6.2f} "
              f"{cpu * 1e3:>8.1f} {cpu / cpu_baseline:>6.2f} {losses[side]:>8.4f}  {utilisation:>6}  {peaks[side]}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpu", action="store_true", help="CUDA, bf16, modernbert-base whole")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256, help="CPU row length (the window is 64 for tiny, 128 for base)")
    p.add_argument("--gpu-seq", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--base-layers", type=int, default=3)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--compile", action="store_true", help="also time ours under torch.compile")
    p.add_argument("--compile-mode", default="default", help="torch.compile's mode (pretrain.compile_mode's values)")
    args = p.parse_args(argv)
    if args.gpu and not accelerator.available():
        print("no CUDA device: GPU benchmark skipped")
        return
    device = torch.device("cuda" if args.gpu else "cpu")
    if not args.gpu:
        torch.set_num_threads(args.threads)
    for name, config in configs(args).items():
        compare(name, config, args, device)


if __name__ == "__main__":
    main()
