"""Benchmark: training steps/s of snakebert's BERT vs Hugging Face BertForPreTraining (sdpa), side by side.

    python benchmarks/train_step.py                 # CPU: both models, same config/batch/seq/optimizer; the ratio
    python benchmarks/train_step.py --gpu           # CUDA: BERT-large phase 1 (and 2) bf16 seq/s and MFU

Both sides run the same step: forward, MLM + NSP loss, backward, LAMB (workflow.train.lamb.Lamb, the same param
groups), fp32 on CPU. Ours computes the MLM head at the masked positions only; HF computes it at every position
(its design). Steps alternate between the two models so machine noise hits both alike.

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

from workflow.train.lamb import Lamb, param_groups  # noqa: E402
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


def gpu_benchmark(args) -> None:
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
        try:
            from apex.optimizers import FusedLAMB  # type: ignore

            optimizer = FusedLAMB(param_groups(model), lr=1e-3)
        except ImportError:
            pass
        batch = make_batch(config, micro, seq, predictions, device)

        def bf16():
            return torch.autocast("cuda", dtype=torch.bfloat16)

        for _ in range(args.warmup):
            ours_step(step_model, optimizer, batch, bf16)
        durations = [timed(lambda: ours_step(step_model, optimizer, batch, bf16), torch.cuda.synchronize)
                     for _ in range(args.steps)]
        seq_per_s = micro / statistics.median(durations)
        flops = flops_per_sequence(config, seq, predictions)
        print(f"GPU {torch.cuda.get_device_name()}: BERT-large {phase} bf16 seq {seq} micro-batch {micro} "
              f"({type(optimizer).__name__}{', compiled' if args.compile else ''}): {seq_per_s:.1f} seq/s, "
              f"{flops / 1e9:.1f} GFLOP/seq, MFU {seq_per_s * flops / PEAK_BF16_FLOPS:.1%} of 790 TFLOP/s, "
              f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
        del model, step_model, optimizer, batch
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpu", action="store_true", help="run the CUDA benchmark instead of the CPU comparison")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--predictions", type=int, default=20)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gpu-micro-batch1", type=int, default=256)
    p.add_argument("--gpu-micro-batch2", type=int, default=32)
    p.add_argument("--compile", action="store_true", help="torch.compile our model (GPU)")
    args = p.parse_args(argv)
    if args.gpu:
        gpu_benchmark(args)
    else:
        cpu_comparison(args)


if __name__ == "__main__":
    main()
