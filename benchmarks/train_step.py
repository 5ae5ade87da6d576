"""Benchmark: snakebert's BERT training step vs Hugging Face (sdpa), and packed vs padded rows, side by side.

    python benchmarks/train_step.py                 # CPU: the three comparisons below
    python benchmarks/train_step.py --step-only --seq 512 --predictions 80 --micro-batch 4   # CPU: 1. at seq 512
    python benchmarks/train_step.py --gpu           # CUDA: BERT-large phase 1 and 2, bf16, packed and padded:
                                                    # seq/s, real tokens/s, MFU (written for an H100/H200; not
                                                    # run on the development machine, which has no GPU)

CPU, fp32, one small BERT, the same weights on every side; steps alternate between the sides so machine noise
hits them alike (medians printed):
1. Full training step, three sides, on one micro-batch of Wikipedia-like instances (padded rows, the short ones
   with empty prediction slots; the generator of 3.): forward, MLM + NSP loss, backward, LAMB
   (workflow.train.lamb.Lamb, the same param groups).
   - snakebert: the pretraining task's forward (workflow.train.pretrain.forward): MLM head at the real prediction
     slots only ([M, H] -> [M, V]);
   - snakebert, every slot: the same model with the MLM head at all B x P slots, empty ones ignored by label -1
     (the path before the slot selection);
   - huggingface BertForPreTraining (sdpa): MLM head at every position (its design), so the ratio to it includes
     that saving.
2. Encoder only at equal work: BertModel forward + backward (loss = sum of the sequence output) vs HF's sdpa
   BertModel, same full-length rows (no mask), no optimizer.
3. Packed vs padded: the same instances (real lengths drawn like encode's output on Wikipedia: fill ~0.86 at 128,
   ~0.55 at 512), packed by workflow.data.pack (LPFHP, <= 3 per row) and as padded rows, forward + MLM/NSP loss
   + backward (MLM head at the real slots, as in training); real tokens per second of each, fill beside (expect
   the ratio ~ fill packed / fill padded).

GPU MFU = seq/s x FLOPs per sequence / peak, peak = 790 TFLOP/s (measured dense bf16 matmul on an H200).
FLOPs per sequence (workflow.train.model.flops_per_sequence, matmuls only, training = 3 x forward):
    3 x [ n_layers x L x (2 (4h^2 + 2 h i) + 4 L h)  +  P (2 h^2 + 2 h V)  +  2 h^2 ]
with L the sequence length, h hidden, i intermediate, V vocab, P masked positions per sequence (the GPU benchmark
counts the real work: L the mean real length, P the mean number of real prediction slots)
(BERT-large, V 30528: 240.6 GFLOP per phase-1 sequence, 1020.5 GFLOP per phase-2 sequence; NVIDIA's published
580 seq/s on an A100 (312 TFLOP/s bf16) is 44.7% MFU by this formula, in line with the quoted ~43%).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from workflow.data.pack import pack_arrays  # noqa: E402
from workflow.train.lamb import Lamb, param_groups  # noqa: E402
from workflow.train.pretraining_data import make_batch as data_batch  # noqa: E402
from workflow.train.model import BertConfig, BertForPreTraining, flops_per_sequence, pretraining_loss  # noqa: E402
from workflow.train.pretrain import forward as pretraining_forward  # noqa: E402

PEAK_BF16_FLOPS = 790e12


def make_batch(config: BertConfig, batch: int, seq: int, predictions: int, device, seed: int = 0) -> dict:
    """One micro-batch of `instances` (padded rows, empty prediction slots in the short ones), with HF's MLM
    labels [B, L] (-100 where nothing is predicted) as `full_labels`."""
    b = data_batch(instances(config, seq, predictions, batch, seed), np.arange(batch))
    labels = b["masked_lm_labels"]
    full_labels = torch.full_like(b["input_ids"], -100)
    full_labels.scatter_(1, b["masked_lm_positions"], torch.where(labels >= 0, labels, -100))  # empty slots: 0 = [CLS]
    return {k: v.to(device) for k, v in {**b, "full_labels": full_labels}.items()}


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


def timed(fn, sync) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def cpu_comparison(args) -> None:
    from transformers import BertConfig as HFConfig
    from transformers import BertForPreTraining as HFBert

    torch.set_num_threads(args.threads)
    config = BertConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=args.heads, intermediate_size=4 * args.hidden)
    torch.manual_seed(0)
    ours = BertForPreTraining(config).train()
    every_slot = copy.deepcopy(ours)
    hf = HFBert(HFConfig(**config.to_dict(), attn_implementation="sdpa")).train()
    assert hf.config._attn_implementation == "sdpa"
    hf.load_state_dict(ours.state_dict(), strict=False)
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
    n = len(arrays["input_ids"])
    return [{k: v.to(device) for k, v in data_batch(arrays, np.arange(start, min(start + rows_per_batch, n))).items()}
            for start in range(0, n, rows_per_batch)]


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
    """(padded batches, packed batches, real tokens, fill padded, fill packed) of the same `n` instances."""
    arrays = instances(config, seq, predictions, n)
    packed = pack_arrays(arrays, 3, masked_lm_prob=0.15)
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
          f"{rates['packed']:,.0f} (fill {fill_packed:.3f}, {len(packed)} batches): {rates['packed'] / rates['padded']:.2f}x "
          f"(fill ratio {fill_packed / fill_padded:.2f})")


def gpu_benchmark(args) -> None:
    """BERT-large phase 1 (128) and 2 (512), bf16: full training steps on padded and on packed rows of the same
    instances; seq/s, real tokens/s and MFU (FLOPs of the real tokens: flops_per_sequence at the mean real length
    and the mean number of real prediction slots, where the MLM head runs)."""
    if not torch.cuda.is_available():
        print("no CUDA device: GPU benchmark skipped")
        return
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    for phase, seq, predictions, micro in (("phase1", 128, 20, args.gpu_micro_batch1),
                                           ("phase2", 512, 80, args.gpu_micro_batch2)):
        config = BertConfig.preset("bert-large", vocab_size=30528)
        torch.manual_seed(0)
        model = BertForPreTraining(config).to(device).train()
        step_model = torch.compile(model) if args.compile else model
        optimizer = Lamb(param_groups(model), lr=1e-3)
        n = micro * args.steps
        padded, packed, real, fill_padded, fill_packed = padded_and_packed(config, seq, predictions, n, micro, device)

        def bf16():
            return torch.autocast("cuda", dtype=torch.bfloat16)

        mean_length = real / n
        mean_predictions = sum(int((b["masked_lm_labels"] >= 0).sum()) for b in padded) / n
        flops = flops_per_sequence(config, round(mean_length), mean_predictions)
        for name, batches, fill in (("padded", padded, fill_padded), ("packed", packed, fill_packed)):
            for b in batches[:args.warmup]:
                train_pass(step_model, [b], bf16, torch.cuda.synchronize)
            duration = train_pass(step_model, batches, bf16, torch.cuda.synchronize) + sum(
                timed(optimizer.step, torch.cuda.synchronize) for _ in batches)
            seq_per_s = n / duration
            print(f"GPU {torch.cuda.get_device_name()}: BERT-large {phase} bf16 seq {seq}, {name} rows (fill "
                  f"{fill:.3f}), {len(batches)} micro-batches of {micro} rows{', compiled' if args.compile else ''}: "
                  f"{seq_per_s:.1f} seq/s, {real / duration:,.0f} real tokens/s, MFU "
                  f"{seq_per_s * flops / PEAK_BF16_FLOPS:.1%} of 790 TFLOP/s (FLOPs of the real tokens and slots), peak memory "
                  f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
        del model, step_model, optimizer, padded, packed
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpu", action="store_true", help="run the CUDA benchmark instead of the CPU comparison")
    p.add_argument("--packing-only", action="store_true", help="CPU: only comparison 3 (packed vs padded)")
    p.add_argument("--step-only", action="store_true", help="CPU: only comparison 1 (full training step)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--predictions", type=int, default=20)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--instances", type=int, default=64, help="instances of the packed vs padded comparison")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gpu-micro-batch1", type=int, default=256)
    p.add_argument("--gpu-micro-batch2", type=int, default=32)
    p.add_argument("--compile", action="store_true", help="torch.compile our model (GPU)")
    args = p.parse_args(argv)
    if args.gpu:
        gpu_benchmark(args)
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
