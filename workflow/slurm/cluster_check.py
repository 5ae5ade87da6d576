"""A few-minute check of a new cluster with the phase-1 job's own layout: `snakemake --profile slurm cluster_check`.

Every rank reports its host, GPU (CUDA_VISIBLE_DEVICES and name) and the cores it may run on; then one NCCL (gloo
on CPU) all-reduce of `--allreduce-mb` MB is timed (bus bandwidth, as nccl-tests reports it: 2(n-1)/n x size /
time), then `--steps` fixed training steps of the configured model on random phase-1 shaped batches (seq/s,
all ranks). Rank 0 prints the table to stderr (the rule's log) and writes it as JSON: world size, per-rank placement, bandwidth, seq/s.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch

from workflow.atomic import write_text
from workflow.train import distributed
from workflow.train.model import BertConfig, BertForPreTraining, pretraining_loss
from workflow.train.precision import autocast, resolve_precision


def placement(env: distributed.DistEnv) -> dict:
    gpu = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else None
    return {"rank": env.rank, "local_rank": env.local_rank, "host": socket.gethostname(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "device": str(env.device), "gpu": gpu,
            "cores": sorted(os.sched_getaffinity(0))}


def synchronize(env: distributed.DistEnv) -> None:
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)


def allreduce_bus_gbps(env: distributed.DistEnv, megabytes: int, repeats: int = 5) -> float | None:
    if not env.distributed:
        return None
    tensor = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=env.device)
    distributed.all_reduce_(tensor)  # warm-up: the first call sets up the communicators
    synchronize(env)
    start = time.perf_counter()
    for _ in range(repeats):
        distributed.all_reduce_(tensor)
    synchronize(env)
    seconds = (time.perf_counter() - start) / repeats
    n = env.world_size
    return 2 * (n - 1) / n * tensor.numel() * 4 / seconds / 1e9


def sequences_per_second(env: distributed.DistEnv, config: BertConfig, steps: int, micro_batch: int,
                         seq_length: int, max_predictions: int, precision: str) -> float:
    torch.manual_seed(env.rank)
    model = BertForPreTraining(config).to(env.device)
    if env.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    shape = (micro_batch, seq_length)
    batch = {"input_ids": torch.randint(0, config.vocab_size, shape, device=env.device),
             "token_type_ids": torch.zeros(shape, dtype=torch.long, device=env.device),
             "attention_mask": torch.ones(shape, dtype=torch.long, device=env.device),
             "masked_lm_positions": torch.randint(0, seq_length, (micro_batch, max_predictions), device=env.device)}
    labels = torch.randint(0, config.vocab_size, (micro_batch, max_predictions), device=env.device)
    nsp = torch.randint(0, 2, (micro_batch,), device=env.device)
    for step in range(steps + 1):  # step 0 is warm-up, not timed
        if step == 1:
            synchronize(env)
            start = time.perf_counter()
        with autocast(env.device, precision):
            mlm_logits, nsp_logits = model(**batch)
            loss = pretraining_loss(mlm_logits.float(), nsp_logits.float(), labels, nsp)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    synchronize(env)
    return steps * micro_batch * env.world_size / (time.perf_counter() - start)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--preset", default="bert-large")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--max-predictions", type=int, default=20)
    parser.add_argument("--allreduce-mb", type=int, default=256)
    parser.add_argument("--precision", default="auto")
    args = parser.parse_args(argv)
    env = distributed.setup()
    try:
        ranks = [placement(env)]
        if env.distributed:
            ranks = [None] * env.world_size
            torch.distributed.all_gather_object(ranks, placement(env))
        bandwidth = allreduce_bus_gbps(env, args.allreduce_mb)
        precision = resolve_precision(args.precision, env.device, "cluster_check --precision")
        throughput = sequences_per_second(env, BertConfig.preset(args.preset), args.steps, args.micro_batch_size,
                                          args.seq_length, args.max_predictions, precision)
        if env.is_main:
            for r in ranks:
                print(f"rank {r['rank']:>3} on {r['host']}: GPU {r['gpu'] or '-'} (CUDA_VISIBLE_DEVICES="
                      f"{r['cuda_visible_devices']}, {r['device']}), cores {r['cores']}", file=sys.stderr, flush=True)
            print(f"world size {env.world_size}; all-reduce {args.allreduce_mb} MB: "
                  f"{bandwidth if bandwidth is None else round(bandwidth, 2)} GB/s bus bandwidth; {args.preset} "
                  f"seq {args.seq_length} {precision}: {throughput:.1f} seq/s", file=sys.stderr, flush=True)
            result = {"world_size": env.world_size, "ranks": ranks, "allreduce_mb": args.allreduce_mb,
                      "allreduce_bus_gbps": bandwidth, "preset": args.preset, "precision": precision,
                      "seq_length": args.seq_length, "sequences_per_second": throughput}
            write_text(args.output, json.dumps(result, indent=1) + "\n")
    finally:
        distributed.cleanup()


if __name__ == "__main__":
    from workflow.cli import run

    run(main)
