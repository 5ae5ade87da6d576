"""Benchmark: snakebert's ModernBERT training step (forward + backward) vs Hugging Face's ModernBertForMaskedLM, on
the same batch and the same weights, steps alternating between the sides.

    python benchmarks/modernbert_step.py                    # CPU, fp32: the tiny preset and a base-shaped small model
    python benchmarks/modernbert_step.py --repeats 3 --seq 128 --micro-batch 4   # a short CPU run
    python benchmarks/modernbert_step.py --gpu --compile --float8 --find-max-micro-batch --gpu-seq 8192 \
        --micro-batch 8 --vocab 50368                       # CUDA, bf16: the GPU mode below; without a CUDA device
                                                            # it says so and exits 0
    python benchmarks/modernbert_step.py --gpu --device cpu --preset modernbert-tiny --gpu-seq 128 --micro-batch 2 \
        --compile --float8 --steps 1 --warmup 0             # the GPU mode's code rehearsed on CPU

CPU comparison (no --gpu), fp32. Models (workflow.train.models.modernbert presets, --vocab tokens): `tiny`
(modernbert-tiny: 4 layers x 128) and `base-small` (modernbert-base's widths, 768 hidden, 12 heads, 1,152
intermediate, window 128, with --base-layers layers: a global layer and local ones).
Batch: --micro-batch rows of --seq tokens, real lengths drawn between half and all of a row (the rest padding), 30%
of the real tokens predicted (ModernBERT's masking rate). Sides, each a forward, the MLM cross-entropy and a backward
(gradients zeroed after; no optimizer step):
   - ours: ModernBertForMaskedLM as training calls it (modernbert.host_indices: the head at the predicted tokens only;
     on CPU rows with masks);
   - hf: transformers' ModernBertForMaskedLM (attn_implementation sdpa), labels -100 elsewhere: the head at every
     position (its default);
   - hf sparse: the same with sparse_prediction (the head at the labelled tokens only, as ModernBERT's recipe trains);
   - ours compiled (--compile): ours under engine.compiled (torch.compile, mode=--compile-mode), as pretrain.compile
     runs it (compiled before the timed rounds).
Each repeat runs every side once, the order rotating, after --warmup untimed rounds; medians printed, with each
side's time relative to hf: wall time, and the process's CPU time (summed over its threads: what other processes
on a shared machine disturb least).

GPU mode (--gpu): --preset (modernbert-base) at --gpu-seq tokens, --micro-batch rows, bf16, --steps micro-batches
like the above, each side timed over them after --warmup, forward + loss + backward (no optimizer: timed apart).
One Markdown table (benchmarks/gpu_measure.py): HF's ModernBertForMaskedLM (head at every token; with
sparse_prediction) and ours eager, compiled (--compile), compiled+float8 (--float8; skipped saying why where it
cannot run), our loss as training computes it (summed_mlm_loss, fused=True: liger's kernel on CUDA where installed,
else the reference; the header says which); real tokens/s, MFU (modernbert.flops_per_sequence at the mean real
length and predictions, counting the GLU and the window), peak memory, the largest micro-batch that fits
(--find-max-micro-batch). Then the recipe's StableAdamW (recipes/modernbert-base.yaml; fused and for-loop) per
global batch: global_batch_tokens / (micro-batch x length) micro-batches, world 1.
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
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workflow.train import accelerator, engine  # noqa: E402
from workflow.train.models.kit import unpadded_of  # noqa: E402
from workflow.train.models.modernbert import (ModernBertConfig, ModernBertForMaskedLM, flops_per_sequence,  # noqa: E402
                                       host_indices)
from workflow.train.precision import autocast  # noqa: E402
from workflow.cli import UserError  # noqa: E402
from workflow.config import PHASES  # noqa: E402
from workflow.train.models.fused_loss import summed_mlm_loss  # noqa: E402
from workflow.train.optim.optimizers import make_stable_adamw  # noqa: E402
from workflow.train.pretrain import unwrapped  # noqa: E402
from benchmarks.gpu_measure import (HF, Device, Work, exit_status, failed_row, micro_batch_ms,  # noqa: E402
                                    micro_batch_text, mlm_loss_path, optimizer_ms, optimizer_table, requested,
                                    searched, skipped_row, table, variant_models)
from benchmarks.gpu_measure import measured as measure_side  # noqa: E402

MASKING = 0.3  # ModernBERT's masking rate


def configs(args) -> dict[str, ModernBertConfig]:
    special = dict(vocab_size=args.vocab, pad_token_id=0, bos_token_id=1, cls_token_id=1, eos_token_id=2,
                   sep_token_id=2)
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
    seq = args.seq
    batch = to(host_indices(make_batch(args.micro_batch, seq, config.vocab_size)), device)
    sides = {"ours": (ours, lambda: ours_step(ours, batch)), "hf": (hf, lambda: hf_step(hf, batch, False)),
             "hf sparse": (hf, lambda: hf_step(hf, batch, True))}
    if args.compile:
        compiled = engine.compiled(ours, args.compile_mode, device)
        sides["ours compiled"] = (ours, lambda: ours_step(compiled, batch))
    precision = "fp32"
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


RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "modernbert-base.yaml"


def recipe_accumulation(seq: int, micro_batch: int) -> tuple[str, int]:
    """(phase, micro-batches per optimizer step) of recipes/modernbert-base.yaml's phase at `seq` tokens (phase1
    otherwise): its global_batch_tokens / (micro_batch x seq), world 1."""
    recipe = yaml.safe_load(RECIPE.read_text())
    phase = next((name for name, phase in recipe["encode"].items()
                  if isinstance(phase, dict) and phase.get("max_seq_length") == seq), PHASES[0])
    return phase, max(1, recipe["pretrain"][phase]["global_batch_tokens"] // (micro_batch * seq))


def training_loss_step(model, batch: dict, autocast) -> None:
    """Forward to the head's hidden states, the MLM loss as training computes it (summed_mlm_loss, fused=True: liger's
    kernel where it runs), backward; gradients dropped after (the optimizer is timed apart)."""
    with autocast():
        hidden, _ = model(batch["input_ids"], None, batch["attention_mask"], batch["masked_lm_positions"],
                          masked_lm_index=batch["masked_lm_index"], unpadded=unpadded_of(batch),
                          mask_needed=batch["mask_needed"], return_hidden=True)
        targets = batch["masked_lm_targets"]
        summed, _ = summed_mlm_loss(hidden, *unwrapped(model).mlm_decoder(), targets, fused=True)
        loss = summed / (targets >= 0).sum().clamp(min=1)
    loss.backward()
    unwrapped(model).zero_grad(set_to_none=True)


def hf_loss_step(model, batch: dict, sparse: bool, autocast) -> None:
    with autocast():
        loss = hf_step(model, batch, sparse)
    loss.backward()
    model.zero_grad(set_to_none=True)


def stable_adamw_steps(model) -> dict:
    """{name: optimizer step, or why it cannot run}: the recipe's StableAdamW, its fused path (Triton on CUDA, else
    foreach) and the for-loop."""
    recipe = yaml.safe_load(RECIPE.read_text())["pretrain"]["stable_adamw"]
    steps = {}
    for fused in (True, False):
        try:
            optimizer, name = make_stable_adamw(model, 1e-4, recipe["weight_decay"], (recipe["beta1"], recipe["beta2"]),
                                                recipe["eps"], fused, recipe["decouple_lr"])
            steps[name] = optimizer.step
        except UserError as error:
            steps[f"StableAdamW ({'fused' if fused else 'for-loop'})"] = str(error)
    return steps


def gpu_benchmark(args) -> int:
    """ModernBERT (--preset) at --gpu-seq tokens, bf16, forward + loss + backward on the same --steps micro-batches:
    HF's ModernBertForMaskedLM (head at every token, and at the labelled ones) and ours in each variant
    (gpu_measure.VARIANTS); real tokens/s, MFU, peak memory, the largest micro-batch that fits
    (--find-max-micro-batch); then the recipe's optimizer as its accumulation amortises it. Returns the exit status:
    1 where a side failed (gpu_measure.side_guard)."""
    import transformers

    device = Device(args.device)
    if not device.available():
        print("no CUDA device: GPU benchmark skipped")
        return 0
    device.prepare(args.threads)

    bf16 = device.bf16
    variants, search = requested(args)
    seq, micro = args.gpu_seq, args.micro_batch
    config = ModernBertConfig.preset(args.preset, vocab_size=args.vocab, pad_token_id=0, bos_token_id=1,
                                     cls_token_id=1, eos_token_id=2, sep_token_id=2)

    def batch_of(rows: int, seed: int = 0) -> dict:
        return to(host_indices(make_batch(rows, seq, config.vocab_size, seed)), device.torch)

    batches = [batch_of(micro, seed) for seed in range(args.steps)]
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    n = micro * args.steps
    predictions = sum(int((b["masked_lm_targets"] >= 0).sum()) for b in batches) / n
    flops = flops_per_sequence(config, round(real / n), predictions)
    print(f"\n### {args.preset}: {micro} rows x {seq} tokens, vocab {config.vocab_size}, {args.steps} micro-batches "
          f"({real / n:.0f} real tokens, {predictions:.1f} predictions a row), bf16 autocast, {device.name()}")
    print(f"HF: transformers ModernBertForMaskedLM, sdpa attention on padded rows with dense masks, its MLM loss (head "
          f"at every token, or with sparse_prediction at the labelled ones); ours: the real tokens unpadded through "
          f"varlen attention with the local window (flash on CUDA), the head at the predicted tokens, MLM loss as "
          f"training computes it (summed_mlm_loss: {mlm_loss_path(device)}). Both: forward + loss + backward, no "
          f"optimizer (below), {args.warmup} warm-up steps (compiled variants: at least 1); MFU of "
          f"{device.peak_line()} at {flops / 1e9:.1f} GFLOP per row (real tokens and predictions)")
    rows = []

    work = Work(real, n, flops, micro, args.max_micro_batch_cap)

    def measured(side, step, warmup, search_name) -> float | None:
        return measure_side(rows, side, step, batches, warmup, device, work,
                            (lambda r: step(batch_of(r))) if searched(search_name, search) else None)

    torch.manual_seed(0)
    ours = ModernBertForMaskedLM(config).train()
    hf = transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(**config.to_dict(),
                                                                          attn_implementation="sdpa"))
    state = ours.state_dict()
    hf.load_state_dict({**state, "decoder.weight": state["model.embeddings.tok_embeddings.weight"]}, strict=True)
    hf.to(device.torch).train()
    for sparse in (False, True):  # the baseline alone on the device, then freed: each side's peak is its own
        measured(f"HF ModernBertForMaskedLM{' (sparse_prediction)' if sparse else ''}",
                 lambda b, sparse=sparse: hf_loss_step(hf, b, sparse, bf16), args.warmup, HF)
    del hf
    device.reset_peak_memory()

    ours = ours.to(device.torch)
    micro_batch_seconds = None
    for variant, model in variant_models(ours, device, args.compile_mode, variants):
        if isinstance(model, (str, Exception)):
            rows.append(skipped_row(f"ours {variant}", model) if isinstance(model, str) else
                        failed_row(f"ours {variant}", model))
            continue
        seconds = measured(f"ours {variant}", lambda b, model=model: training_loss_step(model, b, bf16),
                           args.warmup if variant == "eager" else max(args.warmup, 1), variant)
        if variant == "eager" and seconds is not None:
            micro_batch_seconds = seconds / len(batches)
        del model
    print(table(rows))

    phase, accumulation = recipe_accumulation(seq, micro)
    timings = {name: step if isinstance(step, str) else optimizer_ms(step, list(ours.parameters()),
                                                                      args.optimizer_repeats, device)
               for name, step in stable_adamw_steps(ours).items()}
    print(f"\nStableAdamW, one step per global batch (recipes/modernbert-base.yaml {phase}: global_batch_tokens = "
          f"{accumulation} micro-batches of {micro} x {seq}, world 1), against ours eager's "
          f"{micro_batch_text(micro_batch_seconds)}, median of {args.optimizer_repeats} steps:")
    print(optimizer_table(micro_batch_ms(micro_batch_seconds), accumulation, timings))
    return exit_status(rows)


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
    p.add_argument("--float8", action="store_true", help="--gpu: also time ours float8-converted, then compiled "
                   "(skipped, saying why, where float8 cannot run)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="--gpu: where it runs; cpu rehearses the GPU mode's code (with --preset modernbert-tiny)")
    p.add_argument("--preset", default="modernbert-base", help="--gpu: the model (modernbert.py's presets)")
    p.add_argument("--steps", type=int, default=10, help="--gpu: micro-batches timed a side")
    p.add_argument("--find-max-micro-batch", nargs="?", const="all", default=None, metavar="SIDES",
                   help="--gpu: double each side's micro-batch until out of memory; SIDES: all (no value) or a "
                   "comma list of hf, eager, compiled, compiled+float8")
    p.add_argument("--max-micro-batch-cap", type=int, default=4096, help="--find-max-micro-batch: stop there")
    p.add_argument("--optimizer-repeats", type=int, default=5, help="--gpu: optimizer steps timed (median)")
    args = p.parse_args(argv)
    if args.gpu:
        if gpu_benchmark(args):
            sys.exit(1)  # a side failed: the table says which
        return
    device = torch.device("cpu")
    torch.set_num_threads(args.threads)
    for name, config in configs(args).items():
        compare(name, config, args, device)


if __name__ == "__main__":
    main()
