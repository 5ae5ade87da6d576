"""Benchmark: snakebert's BERT training step vs Hugging Face (sdpa), and packed vs padded rows, side by side.

    python benchmarks/train_step.py                 # CPU: the three comparisons below
    python benchmarks/train_step.py --step-only --seq 512 --predictions 80 --micro-batch 4   # CPU: 1. at seq 512
    python benchmarks/train_step.py --gpu --compile --float8 --find-max-micro-batch
                                                    # CUDA (an H100/H200): the GPU mode below, at config.yaml's
                                                    # micro-batches; without a CUDA device it prints
                                                    # "no CUDA device: GPU benchmark skipped" and exits 0
    python benchmarks/train_step.py --gpu --device cpu --preset tiny --vocab 1024 --steps 1 --warmup 0 \
        --gpu-micro-batch1 8 --gpu-micro-batch2 4 --compile --float8
                                                    # the GPU mode's code rehearsed on CPU (tests/test_benchmarks.py)

CPU, fp32, one small BERT, the same weights on every side; steps alternate between the sides so machine noise
hits them alike (medians printed):
1. Full training step, three sides, on one micro-batch of Wikipedia-like instances (padded rows, the short ones
   with empty prediction slots; the generator of 3.): forward, MLM + NSP loss, backward, LAMB
   (workflow.train.optim.lamb.Lamb, the same param groups).
   - snakebert: the pretraining task's forward (workflow.train.pretrain.forward) of a batch without host_indices:
     MLM head at the real prediction slots only ([M, H] -> [M, V]; M varies, a host sync on CUDA);
   - snakebert, every slot: the same model with the MLM head at all B x P slots, empty ones ignored by label -1
     (what training runs: host_indices' fixed shapes, for torch.compile);
   - huggingface BertForPreTraining (sdpa): MLM head at every position (its design), so the ratio to it includes
     that saving.
2. Encoder only at equal work: BertModel forward + backward (loss = sum of the sequence output) vs HF's sdpa
   BertModel, same full-length rows (no mask), no optimizer.
3. Packed vs padded: the same instances (real lengths drawn like encode's output on Wikipedia: fill ~0.86 at 128,
   ~0.55 at 512), packed as the pack stage packs them (PackSettings: gapfill, <= 3 per row) and as padded rows,
   forward + MLM/NSP loss + backward (MLM head at the real slots, as in training); real tokens per second of each,
   fill beside (expect the ratio ~ fill packed / fill padded).

GPU mode (--gpu): BERT-large (--preset) phase 1 and phase 2 as --configfile (config.yaml) configures them
(--phases): sequence length and predictions (encode.phaseN), rows per micro-batch (pretrain.phaseN.micro_batch_size:
64 and 16; or --gpu-micro-batch1/2), bf16 autocast, on the same --steps micro-batches' worth of Wikipedia-like
instances (the generator of 3.), each side timed over all its micro-batches after --warmup untimed steps, a step
being forward, loss and backward (no optimizer: timed apart, below). One Markdown table per phase
(benchmarks/gpu_measure.py):
   - HF BertForPreTraining: Hugging Face transformers, attn_implementation="sdpa", our initial weights, on the
     padded rows, its own MLM (every position) + NSP loss: the baseline, run by the benchmark itself;
   - ours eager, compiled (--compile, --compile-mode), compiled+float8 (--float8; skipped saying why where float8
     cannot run): our model on the same instances packed as the pack stage packs them (PackSettings), through the
     unpadded varlen attention path (forced on CPU by --device cpu), the loss as training computes it
     (PretrainingTask.loss, fused_loss: liger's kernel on CUDA where installed, else the reference; the header says
     which). Our batches carry the indices training's loader computes on the host (model.host_indices).
Per side: real tokens/s, MFU, peak memory and, with --find-max-micro-batch, the largest micro-batch that fits. Then
LAMB (ours: torch _foreach; the per-parameter loop of tests/test_lamb.py; apex FusedLAMB where present) timed as the
phase's accumulation amortises it: one step per global_batch_size / micro-batch micro-batches (world 1), its ms and
share of that global step. All device-specific calls sit in gpu_measure.Device (CUDA, or CPU stand-ins: no sync,
peak RSS, MFU "n/a").

GPU MFU = sequences/s x FLOPs per sequence / peak, peak = the card's datasheet dense bf16 peak (accelerator.peak_flops:
989.4 TFLOP/s on an H100 SXM or H200, 312 on an A100; "n/a" for a card not in its table).
FLOPs per sequence (workflow.train.models.bert.flops_per_sequence, matmuls only, training = 3 x forward):
    3 x [ n_layers x L x (2 (4h^2 + 2 h i) + 4 L h)  +  P (2 h^2 + 2 h V)  +  2 h^2 ]
with L the sequence length, h hidden, i intermediate, V vocab, P masked positions per sequence (the GPU mode
counts the real work, the same for every side: L the mean real length, P the mean number of real prediction slots)
(BERT-large, V 30528: 240.6 GFLOP per phase-1 sequence, 1020.5 GFLOP per phase-2 sequence; NVIDIA's published
580 seq/s on an A100 (312 TFLOP/s bf16) is 44.7% MFU by this formula, in line with the quoted ~43%).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from workflow.config import PHASES, load_config  # noqa: E402
from workflow.data.pack import PackSettings, pack_arrays  # noqa: E402
from workflow.train import accelerator  # noqa: E402
from workflow.train.optim.lamb import Lamb, param_groups  # noqa: E402
from workflow.train.pretraining_data import make_batch as data_batch, padded as padded_rows  # noqa: E402
from workflow.train.models.bert import BertConfig, BertForPreTraining, flops_per_sequence  # noqa: E402
from workflow.train.models.kit import host_indices, pretraining_loss  # noqa: E402
from workflow.train.pretrain import PretrainingTask, unwrapped  # noqa: E402
from workflow.train.pretrain import forward as pretraining_forward  # noqa: E402
from benchmarks.gpu_measure import (HF, Device, Work, exit_status, failed_row, micro_batch_ms,  # noqa: E402
                                    micro_batch_text, mlm_loss_path, optimizer_ms, optimizer_table, requested,
                                    searched, skipped_row, table, timed, variant_models)
from benchmarks.gpu_measure import measured as measure_side  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "config.yaml"


def configured_phases(path, micro_batch1: int | None = None, micro_batch2: int | None = None) -> list[tuple]:
    """(phase, sequence length, predictions per sequence, rows per micro-batch) of both phases as the config file
    sets them (encode.phaseN, pretrain.phaseN.micro_batch_size), a given micro-batch size overriding."""
    config = load_config(path)
    return [(phase, config["encode"][phase]["max_seq_length"], config["encode"][phase]["max_predictions_per_seq"],
             micro or config["pretrain"][phase]["micro_batch_size"])
            for phase, micro in zip(PHASES, (micro_batch1, micro_batch2))]


def make_batch(config: BertConfig, batch: int, seq: int, predictions: int, device, seed: int = 0) -> dict:
    """One micro-batch of `instances` (padded rows, empty prediction slots in the short ones), with HF's MLM
    labels as `full_labels`."""
    b = with_hf_labels(data_batch(instances(config, seq, predictions, batch, seed), np.arange(batch)))
    return {k: v.to(device) for k, v in b.items()}


def with_hf_labels(b: dict) -> dict:
    """Padded batch `b` plus HF's MLM labels [B, L] as `full_labels` (-100 where nothing is predicted)."""
    labels = b["masked_lm_labels"]
    full_labels = torch.full_like(b["input_ids"], -100)
    full_labels.scatter_(1, b["masked_lm_positions"], torch.where(labels >= 0, labels, -100))  # empty slots: 0 = [CLS]
    return {**b, "full_labels": full_labels}


def hf_twin(ours) -> torch.nn.Module:
    """Hugging Face BertForPreTraining (sdpa attention) holding `ours`' weights, in training mode."""
    from transformers import BertConfig as HFConfig
    from transformers import BertForPreTraining as HFBert

    hf = HFBert(HFConfig(**ours.config.to_dict(), attn_implementation="sdpa")).train()
    assert hf.config._attn_implementation == "sdpa"
    result = hf.load_state_dict(ours.state_dict(), strict=False)
    # Only HF's tied decoder aliases are absent from ours (they are the word embeddings and cls.predictions.bias).
    assert not result.unexpected_keys and set(result.missing_keys) <= {"cls.predictions.decoder.weight",
                                                                      "cls.predictions.decoder.bias"}, result
    return hf


def mlm_forward(model, b, real_slots: bool = True):
    """(mlm_logits, nsp_logits, mlm_labels): the pretraining task's forward (MLM head at the real prediction slots
    only), or with `real_slots` False the MLM head at every slot [B, P, V] (empty ones ignored by label -1)."""
    if real_slots:
        return pretraining_forward(model, b)
    mlm, nsp = model(b["input_ids"], b["token_type_ids"], b["attention_mask"], b["masked_lm_positions"],
                     b.get("position_ids"), b.get("cls_positions"))
    return mlm, nsp, b["masked_lm_labels"]


def ours_step(model, optimizer, b, autocast, real_slots: bool = True):
    with autocast():
        mlm, nsp, labels = mlm_forward(model, b, real_slots)
        loss = pretraining_loss(mlm, nsp, labels, b["next_sentence_labels"])["loss"]
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def hf_step(model, optimizer, b, autocast):
    with autocast():
        out = model(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"], attention_mask=b["attention_mask"],
                    labels=b["full_labels"], next_sentence_label=b["next_sentence_labels"])
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def cpu_comparison(args) -> None:
    torch.set_num_threads(args.threads)
    config = BertConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=args.heads, intermediate_size=4 * args.hidden)
    torch.manual_seed(0)
    ours = BertForPreTraining(config).train()
    every_slot = copy.deepcopy(ours)
    hf = hf_twin(ours)
    ours_opt, every_slot_opt, hf_opt = (Lamb(param_groups(model), lr=1e-3) for model in (ours, every_slot, hf))
    batch = make_batch(config, args.micro_batch, args.seq, args.predictions, "cpu")
    no_autocast = torch.autocast("cpu", enabled=False)

    def noop():
        return None

    sides = {"snakebert": lambda: ours_step(ours, ours_opt, batch, lambda: no_autocast),
             "snakebert, every slot": lambda: ours_step(every_slot, every_slot_opt, batch, lambda: no_autocast,
                                                         real_slots=False),
             "huggingface": lambda: hf_step(hf, hf_opt, batch, lambda: no_autocast)}
    times = {name: [] for name in sides}
    for step in range(args.warmup + args.steps):
        for name, side in sides.items():
            duration = timed(side, noop)
            if step >= args.warmup:
                times[name].append(duration)
    slots = batch["masked_lm_labels"].numel()
    real = int((batch["masked_lm_labels"] >= 0).sum())
    print(f"CPU, {args.threads} threads, fp32, LAMB: hidden {args.hidden}, layers {args.layers}, heads {args.heads}, "
          f"vocab {args.vocab}, seq {args.seq}, micro-batch {args.micro_batch}, {args.predictions} prediction slots "
          f"per row: {real} of {slots} real ({1 - real / slots:.1%} empty), "
          f"fill {batch['attention_mask'].float().mean():.3f}")
    work = {"snakebert": f"MLM head at the {real} real slots", "snakebert, every slot": f"at all {slots} slots",
            "huggingface": f"at all {batch['input_ids'].numel()} positions"}
    rates = {}
    for name, values in times.items():
        median = statistics.median(values)
        rates[name] = 1 / median
        print(f"  {name:22s} {rates[name]:7.3f} steps/s  ({args.micro_batch * rates[name]:7.1f} seq/s, "
              f"{median * 1e3:7.1f} ms/step, median of {len(values)} steps; {work[name]})")
    print(f"  ratio real slots / every slot: {rates['snakebert'] / rates['snakebert, every slot']:.3f}x; "
          f"snakebert / huggingface: {rates['snakebert'] / rates['huggingface']:.2f}x (target >= 1.3x)")
    if args.step_only:
        return

    # 2. Encoder forward + backward at equal work.
    ours_encoder, hf_encoder = ours.bert, hf.bert
    times = {"snakebert": [], "huggingface": []}

    def encoder_step(model, **inputs):
        model(**inputs)[0].sum().backward()
        model.zero_grad(set_to_none=True)

    for step in range(args.warmup + args.steps):
        t_ours = timed(lambda: encoder_step(ours_encoder, input_ids=batch["input_ids"],
                                            token_type_ids=batch["token_type_ids"]), noop)
        t_hf = timed(lambda: encoder_step(hf_encoder, input_ids=batch["input_ids"],
                                          token_type_ids=batch["token_type_ids"]), noop)
        if step >= args.warmup:
            times["snakebert"].append(t_ours)
            times["huggingface"].append(t_hf)
    ours_rate, hf_rate = (1 / statistics.median(times[k]) for k in ("snakebert", "huggingface"))
    print(f"  encoder forward + backward only (BertModel, same rows, no mask): snakebert {ours_rate:.3f} vs "
          f"huggingface sdpa {hf_rate:.3f} steps/s: {ours_rate / hf_rate:.2f}x (must be >= 1.0x)")

    # 3. Packed vs padded rows, same model and instances.
    for seq, predictions in ((128, 20), (512, 80)):
        packed_vs_padded(ours, seq, predictions, args)


def instances(config: BertConfig, seq: int, predictions: int, n: int, seed: int = 0) -> dict:
    """NVIDIA-schema arrays of `n` instances with Wikipedia-like real lengths: a share of them short (encode's
    short_seq_prob and document ends), the rest near full (at 512, more documents end before the row is full)."""
    rng = np.random.default_rng(seed)
    short_share = 0.2 if seq == 128 else 0.85
    lengths = np.where(rng.random(n) < short_share, rng.integers(8, seq + 1, n), rng.integers(int(seq * 0.9), seq + 1,
                                                                                               n))
    cells = np.arange(seq)[None, :] < lengths[:, None]
    ids = np.where(cells, rng.integers(5, config.vocab_size, (n, seq)), 0).astype(np.int32)
    ids[:, 0] = 2
    count = np.minimum(predictions, np.maximum(1, np.rint(0.15 * lengths))).astype(int)
    positions = np.zeros((n, predictions), np.int32)
    for row, (length, k) in enumerate(zip(lengths, count)):
        positions[row, :k] = np.sort(rng.choice(np.arange(1, length), k, replace=False))
    return {"input_ids": ids, "input_mask": cells.astype(np.int8),
            "segment_ids": (cells & (np.arange(seq)[None, :] >= lengths[:, None] // 2)).astype(np.int8),
            "masked_lm_positions": positions,
            "masked_lm_ids": np.where(positions > 0, rng.integers(5, config.vocab_size, positions.shape), 0).astype(
                np.int32),
            "next_sentence_labels": rng.integers(0, 2, n).astype(np.int8)}


def row_batches(arrays: dict, rows_per_batch: int, device) -> list[dict]:
    """Micro-batches of exactly `rows_per_batch` rows, the last filled up with empty rows, as pretraining reads them."""
    n = len(arrays["input_ids"])
    def batch(start):
        rows = {name: values[start:start + rows_per_batch] for name, values in arrays.items()}
        b = host_indices(data_batch(*padded_rows(rows, rows_per_batch)))
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()}

    return [batch(start) for start in range(0, n, rows_per_batch)]


def train_pass(model, batches: list[dict], autocast, sync) -> float:
    """Seconds of forward + MLM/NSP loss + backward over every batch."""
    def run():
        for b in batches:
            with autocast():
                mlm, nsp, labels = mlm_forward(model, b)
                loss = pretraining_loss(mlm, nsp, labels, b["next_sentence_labels"])["loss"]
            loss.backward()
        model.zero_grad(set_to_none=True)
    return timed(run, sync)


def padded_and_packed(config, seq, predictions, n, rows_per_batch, device):
    """(padded batches, packed batches, real tokens, fill padded, fill packed) of the same `n` instances, packed as
    the pack stage does by default (PackSettings)."""
    arrays = instances(config, seq, predictions, n)
    settings = PackSettings()
    packed = pack_arrays(arrays, settings.max_sequences_per_pack, masked_lm_prob=0.15, algorithm=settings.algorithm)
    real = int(arrays["input_mask"].sum())
    return (row_batches(arrays, rows_per_batch, device), row_batches(packed, rows_per_batch, device), real,
            real / arrays["input_mask"].size, real / packed["input_mask"].size)


def packed_vs_padded(model, seq, predictions, args) -> None:
    padded, packed, real, fill_padded, fill_packed = padded_and_packed(
        model.config, seq, predictions, args.instances, args.micro_batch, "cpu")
    times = {"padded": [], "packed": []}
    no_autocast = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
    for step in range(1 + max(1, args.steps // 4)):
        for name, batches in (("padded", padded), ("packed", packed)):
            duration = train_pass(model, batches, no_autocast, lambda: None)
            if step:
                times[name].append(duration)
    rates = {name: real / statistics.median(values) for name, values in times.items()}
    print(f"  seq {seq}, {args.instances} instances, forward + loss + backward: padded {rates['padded']:,.0f} real "
          f"tokens/s (fill {fill_padded:.3f}, {len(padded)} batches of {args.micro_batch} rows), packed "
          f"{rates['packed']:,.0f} (fill {fill_packed:.3f}, {len(packed)} batches): "
          f"{rates['packed'] / rates['padded']:.2f}x (fill ratio {fill_packed / fill_padded:.2f})")


def loss_step(model, task: PretrainingTask, b: dict, autocast) -> None:
    """Forward, the MLM + NSP loss as training computes it (PretrainingTask.loss: the fused loss where it runs),
    backward; gradients dropped after (the optimizer is timed apart, amortised)."""
    with autocast():
        loss = task.loss(model, b, task.count(b))["loss"]
    loss.backward()
    unwrapped(model).zero_grad(set_to_none=True)


def hf_loss_step(model, b: dict, autocast) -> None:
    """HF's forward with its own MLM (every position) + NSP loss, backward; gradients dropped after."""
    with autocast():
        out = model(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"], attention_mask=b["attention_mask"],
                    labels=b["full_labels"], next_sentence_label=b["next_sentence_labels"])
    out.loss.backward()
    model.zero_grad(set_to_none=True)


def lamb_steps(model, device: Device) -> dict:
    """{name: a zero-argument optimizer step, or why it cannot run} for the LAMBs on `model`'s parameters: ours
    (torch _foreach), the per-parameter loop it is tested equal to (tests/test_lamb.py), apex FusedLAMB."""
    groups = param_groups(model)
    steps = {"Lamb (torch _foreach, ours)": Lamb(param_groups(model), lr=1e-3).step}
    try:
        from tests.test_lamb import reference_lamb
    except ImportError as error:
        steps["LAMB per-parameter loop (tests/test_lamb.py)"] = f"not importable ({error})"
    else:
        params = [p for group in groups for p in group["params"]]
        decays = [group["weight_decay"] for group in groups for _ in group["params"]]
        # fp32 on the device; it allocates its moments each call and reads norms back per parameter (host syncs)
        steps["LAMB per-parameter loop (tests/test_lamb.py)"] = lambda: reference_lamb(
            [p.detach() for p in params], [[p.grad for p in params]], 1e-3, decays, dtype=torch.float32)
    fused_lamb, reason = accelerator.fused_lamb(device.torch)
    steps["apex FusedLAMB"] = fused_lamb(param_groups(model), lr=1e-3).step if fused_lamb else reason
    return steps


def gpu_benchmark(args) -> int:
    """Phase 1 (128) and 2 (512), bf16, forward + loss + backward on the same instances: HF's BertForPreTraining on
    padded rows, ours packed in each variant (gpu_measure.VARIANTS); per side real tokens/s, MFU (FLOPs of the real
    tokens), peak memory and, with --find-max-micro-batch, the largest micro-batch that fits; then LAMB's step as
    the phase's accumulation amortises it. Returns the exit status: 1 where a side failed (gpu_measure.side_guard)."""
    device = Device(args.device)
    if not device.available():
        print("no CUDA device: GPU benchmark skipped")
        return 0
    device.prepare(args.threads)
    failures = 0

    bf16 = device.bf16
    variants, search = requested(args)
    pretrain_config = load_config(args.configfile)["pretrain"]
    for phase, seq, predictions, micro in configured_phases(args.configfile, args.gpu_micro_batch1,
                                                            args.gpu_micro_batch2):
        if phase not in args.phases.split(","):
            continue
        config = BertConfig.preset(args.preset, vocab_size=(args.vocab + 7) // 8 * 8)  # padded to 8, as pretrain does
        n = micro * args.steps
        padded, packed, real, fill_padded, fill_packed = padded_and_packed(config, seq, predictions, n, micro,
                                                                           device.torch)
        mean_predictions = sum(int((b["masked_lm_labels"] >= 0).sum()) for b in padded) / n
        flops = flops_per_sequence(config, round(real / n), mean_predictions)
        task = PretrainingTask(None, seq, fused_loss=True)

        def rows_of(rows: int) -> tuple[dict, dict]:
            """(padded, packed) micro-batches of `rows` rows, for the largest micro-batch search."""
            padded_batches, packed_batches, *_ = padded_and_packed(config, seq, predictions, 2 * rows, rows,
                                                                   device.torch)
            return with_hf_labels(padded_batches[0]), packed_batches[0]

        print(f"\n### {args.preset} {phase}: {seq} tokens, {n} instances ({real / n:.1f} real tokens, "
              f"{mean_predictions:.1f} predictions each), micro-batches of {micro} rows, bf16 autocast, "
              f"{device.name()}")
        print(f"HF: transformers BertForPreTraining, sdpa attention, padded rows, its MLM head at every position + "
              f"cross-entropy, NSP; ours: packed rows (fill {fill_packed:.3f} vs padded {fill_padded:.3f}), "
              f"varlen attention (flash_varlen on CUDA), MLM loss as training computes it (PretrainingTask.loss, "
              f"fused_loss: {mlm_loss_path(device)}), NSP. Both: forward + loss + backward, no optimizer (below), "
              f"{args.warmup} warm-up steps (compiled variants: at least 1, where they compile); MFU of "
              f"{device.peak_line()} at {flops / 1e9:.1f} GFLOP per sequence (real tokens and predictions)")
        rows = []

        work = Work(real, n, flops, micro, args.max_micro_batch_cap)

        def measured(side, step, batches, warmup, search_name, one_step) -> float | None:
            return measure_side(rows, side, step, batches, warmup, device, work,
                                one_step if searched(search_name, search) else None)

        torch.manual_seed(0)
        ours = BertForPreTraining(config).train()
        # The baseline first, alone on the device, then freed: each side's peak memory is its own.
        hf = hf_twin(ours).to(device.torch)
        measured("HF BertForPreTraining", lambda b: hf_loss_step(hf, b, bf16), [with_hf_labels(b) for b in padded],
                 args.warmup, HF, lambda r: hf_loss_step(hf, rows_of(r)[0], bf16))
        del hf
        device.reset_peak_memory()

        ours = ours.to(device.torch)
        micro_batch_seconds = None
        with device.packed_path():
            for variant, model in variant_models(ours, device, args.compile_mode, variants):
                if isinstance(model, (str, Exception)):
                    rows.append(skipped_row(f"ours {variant}", model) if isinstance(model, str) else
                                failed_row(f"ours {variant}", model))
                    continue
                step = lambda b, model=model: loss_step(model, task, b, bf16)  # noqa: E731
                seconds = measured(f"ours {variant}", step, packed,
                                   args.warmup if variant == "eager" else max(args.warmup, 1), variant,
                                   lambda r, step=step: step(rows_of(r)[1]))
                if variant == "eager" and seconds is not None:
                    micro_batch_seconds = seconds / len(packed)
                del model, step
        print(table(rows))
        failures += exit_status(rows)

        accumulation = max(1, pretrain_config[phase]["global_batch_size"] // micro)  # world 1
        timings = {name: step if isinstance(step, str) else optimizer_ms(step, list(ours.parameters()),
                                                                          args.optimizer_repeats, device)
                   for name, step in lamb_steps(ours, device).items()}
        print(f"\nLAMB, one step per global batch ({pretrain_config[phase]['global_batch_size']} sequences = "
              f"{accumulation} micro-batches of {micro}, world 1), against ours eager's "
              f"{micro_batch_text(micro_batch_seconds)}, median of {args.optimizer_repeats} steps:")
        print(optimizer_table(micro_batch_ms(micro_batch_seconds), accumulation, timings))
        del ours, padded, packed
        device.reset_peak_memory()
    return int(failures > 0)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpu", action="store_true", help="run the CUDA benchmark instead of the CPU comparison")
    p.add_argument("--packing-only", action="store_true", help="CPU: only comparison 3 (packed vs padded)")
    p.add_argument("--step-only", action="store_true", help="CPU: only comparison 1 (full training step)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=30522, help="vocabulary size (BERT's uncased vocab by default)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--predictions", type=int, default=20)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--instances", type=int, default=64, help="instances of the packed vs padded comparison")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gpu-micro-batch1", type=int, default=None,
                   help="--gpu: rows per micro-batch, phase 1 (default: --configfile's pretrain.phase1)")
    p.add_argument("--gpu-micro-batch2", type=int, default=None,
                   help="--gpu: rows per micro-batch, phase 2 (default: --configfile's pretrain.phase2)")
    p.add_argument("--configfile", default=str(CONFIG), help="--gpu: the workflow config whose phases are timed")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="--gpu: where it runs; cpu rehearses the GPU run's code (packed rows on the varlen path)")
    p.add_argument("--preset", choices=("bert-large", "bert-base", "tiny"), default="bert-large",
                   help="--gpu: model size (vocab: --vocab padded to a multiple of 8, 30528 by default)")
    p.add_argument("--compile", action="store_true", help="--gpu: also time our model under torch.compile")
    p.add_argument("--float8", action="store_true", help="--gpu: also time it float8-converted, then compiled "
                   "(skipped, saying why, where float8 cannot run)")
    p.add_argument("--find-max-micro-batch", nargs="?", const="all", default=None, metavar="SIDES",
                   help="--gpu: double each side's micro-batch until out of memory; SIDES: all (no value) or a "
                   "comma list of hf, eager, compiled, compiled+float8")
    p.add_argument("--max-micro-batch-cap", type=int, default=8192, help="--find-max-micro-batch: stop there")
    p.add_argument("--optimizer-repeats", type=int, default=5, help="--gpu: optimizer steps timed (median)")
    p.add_argument("--phases", default="phase1,phase2", help="--gpu: the phases timed, a comma list")
    p.add_argument("--compile-mode", default="default", help="--gpu --compile: torch.compile's mode "
                   "(pretrain.compile_mode's values)")
    args = p.parse_args(argv)
    if args.gpu:
        if gpu_benchmark(args):
            sys.exit(1)  # a side failed: the table says which
    elif args.packing_only:
        torch.set_num_threads(args.threads)
        config = BertConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                            num_attention_heads=args.heads, intermediate_size=4 * args.hidden)
        torch.manual_seed(0)
        model = BertForPreTraining(config).train()
        for seq, predictions in ((128, 20), (512, 80)):
            packed_vs_padded(model, seq, predictions, args)
    else:
        cpu_comparison(args)


if __name__ == "__main__":
    main()
