"""Benchmark: snakebert's BERT training step vs Hugging Face (sdpa), and packed vs padded rows, side by side.

    python benchmarks/train_step.py                 # CPU: the three comparisons below
    python benchmarks/train_step.py --gpu           # CUDA: BERT-large phase 1 and 2, bf16, packed and padded:
                                                    # seq/s, real tokens/s, MFU (written for an H100/H200; not
                                                    # run on the development machine, which has no GPU)

CPU, fp32, one small BERT, the same weights on every side; steps alternate between the sides so machine noise
hits them alike (medians printed):
1. Full training step vs HF BertForPreTraining: forward, MLM + NSP loss, backward, LAMB
   (workflow.train.lamb.Lamb, the same param groups). Ours computes the MLM head at the masked positions only; HF
   computes it at every position (its design), so this includes that saving.
2. Encoder only at equal work: BertModel forward + backward (loss = sum of the sequence output) vs HF's sdpa
   BertModel, same full rows (no padding, no mask), no optimizer.
3. Packed vs padded: the same instances (real lengths drawn like encode's output on Wikipedia: fill ~0.86 at 128,
   ~0.55 at 512), packed by workflow.data.pack (LPFHP, <= 3 per row) and as padded rows, forward + MLM/NSP loss
   + backward; real tokens per second of each, fill beside (expect the ratio ~ fill packed / fill padded).

GPU MFU = seq/s x FLOPs per sequence / peak, peak = 790 TFLOP/s (measured dense bf16 matmul on an H200).
FLOPs per sequence (workflow.train.model.flops_per_sequence, matmuls only, training = 3 x forward):
    3 x [ n_layers x L x (2 (4h^2 + 2 h i) + 4 L h)  +  P (2 h^2 + 2 h V)  +  2 h^2 ]
with L the sequence length, h hidden, i intermediate, V vocab, P masked positions per sequence
(BERT-large, V 30528: 240.6 GFLOP per phase-1 sequence, 1020.5 GFLOP per phase-2 sequence; NVIDIA's published
580 seq/s on an A100 (312 TFLOP/s bf16) is 44.7% MFU by this formula, in line with the quoted ~43%).
"""
from __future__ import annotations

import argparse
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

PEAK_BF16_FLOPS = 790e12


def make_batch(config: BertConfig, batch: int, seq: int, predictions: int, device, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, config.vocab_size, (batch, seq), generator=g)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    token_type_ids = torch.zeros(batch, seq, dtype=torch.long)
    token_type_ids[:, seq // 2:] = 1
    positions = torch.stack([torch.randperm(seq - 2, generator=g)[:predictions] + 1 for _ in range(batch)])
    positions, _ = positions.sort(dim=1)
    labels = torch.randint(5, config.vocab_size, (batch, predictions), generator=g)
    full_labels = torch.full((batch, seq), -100, dtype=torch.long)
    full_labels.scatter_(1, positions, labels)
    out = dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
               masked_lm_positions=positions, masked_lm_labels=labels, full_labels=full_labels,
               next_sentence_labels=torch.randint(0, 2, (batch,), generator=g))
    return {k: v.to(device) for k, v in out.items()}


def ours_step(model, optimizer, b, autocast):
    with autocast():
        mlm, nsp = model(b["input_ids"], b["token_type_ids"], b["attention_mask"], b["masked_lm_positions"])
        loss = pretraining_loss(mlm, nsp, b["masked_lm_labels"], b["next_sentence_labels"])["loss"]
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
    hf = HFBert(HFConfig(**config.to_dict(), attn_implementation="sdpa")).train()
    assert hf.config._attn_implementation == "sdpa"
    hf.load_state_dict(ours.state_dict(), strict=False)
    ours_opt = Lamb(param_groups(ours), lr=1e-3)
    hf_opt = Lamb(param_groups(hf), lr=1e-3)
    batch = make_batch(config, args.micro_batch, args.seq, args.predictions, "cpu")
    no_autocast = torch.autocast("cpu", enabled=False)

    def noop():
        return None

    times = {"snakebert": [], "huggingface": []}
    for step in range(args.warmup + args.steps):
        t_ours = timed(lambda: ours_step(ours, ours_opt, batch, lambda: no_autocast), noop)
        t_hf = timed(lambda: hf_step(hf, hf_opt, batch, lambda: no_autocast), noop)
        if step >= args.warmup:
            times["snakebert"].append(t_ours)
            times["huggingface"].append(t_hf)
    print(f"CPU, {args.threads} threads, fp32, LAMB: hidden {args.hidden}, layers {args.layers}, heads {args.heads}, "
          f"vocab {args.vocab}, seq {args.seq}, micro-batch {args.micro_batch}, {args.predictions} masked positions")
    rates = {}
    for name, values in times.items():
        median = statistics.median(values)
        rates[name] = 1 / median
        print(f"  {name:12s} {rates[name]:7.3f} steps/s  ({args.micro_batch * rates[name]:7.1f} seq/s, "
              f"median of {len(values)} steps)")
    print(f"  ratio snakebert / huggingface: {rates['snakebert'] / rates['huggingface']:.2f}x (target >= 1.3x)")

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
                mlm, nsp = model(b["input_ids"], b["token_type_ids"], b["attention_mask"], b["masked_lm_positions"],
                                 b.get("position_ids"), b.get("cls_positions"))
                loss = pretraining_loss(mlm, nsp, b["masked_lm_labels"], b["next_sentence_labels"])["loss"]
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
    instances; seq/s, real tokens/s and MFU (FLOPs of the real tokens: flops_per_sequence at the mean real length)."""
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
        flops = flops_per_sequence(config, round(mean_length), predictions)
        for name, batches, fill in (("padded", padded, fill_padded), ("packed", packed, fill_packed)):
            for b in batches[:args.warmup]:
                train_pass(step_model, [b], bf16, torch.cuda.synchronize)
            duration = train_pass(step_model, batches, bf16, torch.cuda.synchronize) + sum(
                timed(optimizer.step, torch.cuda.synchronize) for _ in batches)
            seq_per_s = n / duration
            print(f"GPU {torch.cuda.get_device_name()}: BERT-large {phase} bf16 seq {seq}, {name} rows (fill "
                  f"{fill:.3f}), {len(batches)} micro-batches of {micro} rows{', compiled' if args.compile else ''}: "
                  f"{seq_per_s:.1f} seq/s, {real / duration:,.0f} real tokens/s, MFU "
                  f"{seq_per_s * flops / PEAK_BF16_FLOPS:.1%} of 790 TFLOP/s (real-token FLOPs), peak memory "
                  f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
        del model, step_model, optimizer, padded, packed
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpu", action="store_true", help="run the CUDA benchmark instead of the CPU comparison")
    p.add_argument("--packing-only", action="store_true", help="CPU: only comparison 3 (packed vs padded)")
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
