"""A few-minute check of a new cluster with the phase-1 job's own layout and code: `snakemake --profile slurm
cluster_check`, so that the first multi-day job is not the first run of the real code path there.

Every rank reports its host, device (CUDA_VISIBLE_DEVICES, the GPU it trains on and its name) and the cores it may
run on; one NCCL (gloo on CPU) all-reduce of `--allreduce-mb` MB is timed (bus bandwidth, as nccl-tests reports
it: 2(n-1)/n x size / time). Then the real phase-1 trainer (workflow/train/pretrain.py: the configured data and
model, PretrainingTask, LAMB, DDP, its reads, a checkpoint, the evaluation and export) runs `--steps` steps in a
scratch run directory (`--run-dir`, emptied before and after; never a phase's); one checkpoint write of its
model and LAMB state is timed on that filesystem; and the loss of packed rows is compared with the loss of the same
sequences read unpacked (one per row), which must agree: the packed attention path on this device. Rank 0 prints
the table to stderr (the rule's log) and writes it as JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import torch

from workflow.atomic import write_text
from workflow.cli import UserError, config_sections
from workflow.train import checkpoint as ckpt
from workflow.train import distributed
from workflow.train.pretrain import PretrainingTask, TrainSettings, build_model, read_vocab_size, train_phase
from workflow.train.pretraining_data import PretrainingSequences, list_shards

AGREEMENT = 1e-4  # relative difference of the packed and unpacked losses in fp32 (summation order only)


def placement(env: distributed.DistEnv) -> dict:
    gpu = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else None
    return {"rank": env.rank, "local_rank": env.local_rank, "host": socket.gethostname(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "slurm_step_gpus": os.environ.get("SLURM_STEP_GPUS"), "device": str(env.device),
            "trains_on_gpu": env.local_rank if os.environ.get("CUDA_VISIBLE_DEVICES") else None, "gpu": gpu,
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


def unpacked(batch: dict) -> dict:
    """The live sequences of a batch of packed rows, one per row, as a batch of NVIDIA-schema rows would hold them."""
    rows, slots = (batch["next_sentence_labels"] >= 0).nonzero(as_tuple=True)
    length = batch["input_ids"].shape[1]
    member = batch["attention_mask"][rows] == (slots + 1)[:, None]   # [N, L]: the tokens of each sequence
    order = torch.argsort((~member).long(), dim=1, stable=True)    # its tokens first, in order
    present = torch.arange(length)[None, :] < member.sum(1, keepdim=True)
    positions, labels = batch["masked_lm_positions"][rows], batch["masked_lm_labels"][rows]
    mine = (labels >= 0) & torch.gather(member, 1, positions)
    slot_order = torch.argsort((~mine).long(), dim=1, stable=True)
    mine = torch.gather(mine, 1, slot_order)
    start = batch["cls_positions"][rows, slots][:, None]
    return {
        "input_ids": torch.gather(batch["input_ids"][rows], 1, order) * present,
        "token_type_ids": torch.gather(batch["token_type_ids"][rows], 1, order) * present,
        "attention_mask": present.long(),
        "masked_lm_positions": torch.where(mine, torch.gather(positions, 1, slot_order) - start, 0),
        "masked_lm_labels": torch.where(mine, torch.gather(labels, 1, slot_order), -1),
        "next_sentence_labels": batch["next_sentence_labels"][rows, slots],
    }


def packed_unpacked_losses(s: TrainSettings, model_dir: Path, env, sequences: int) -> dict:
    """This rank's share of the first `sequences` x world sequences, their loss read packed and unpacked (fp32, no
    dropout), with the trained weights."""
    shards = list_shards(s.data_dir, "training")
    if not shards[0].packed:
        return {"packed": False}
    _, model = build_model(s.preset, s.bert_config, str(model_dir), read_vocab_size(s.vocab), shards[0].seq_length)
    model.to(env.device).eval()
    reader = PretrainingSequences(shards, s.seed)
    try:
        packed = reader.read(env.rank * sequences, sequences)
    finally:
        reader.close()
    task = PretrainingTask(None, shards[0].seq_length)  # its loss and counts; the batches are read above
    losses = {}
    with torch.no_grad():
        for name, batch in (("packed", packed), ("unpacked", unpacked(packed))):
            batch = {k: v.to(env.device) for k, v in batch.items()}
            losses[name] = task.loss(model, batch, task.count(batch))["loss"].item()
    return {"packed": True, "sequences": sequences, **{f"{name}_loss": value for name, value in losses.items()},
            "relative_difference": abs(losses["packed"] - losses["unpacked"]) / abs(losses["unpacked"])}


def checkpoint_write(run_dir: Path, scratch: Path) -> dict:
    """Seconds to write (and fsync, checksum) the newest checkpoint's model and LAMB state once more, on the run
    directory's filesystem: what every checkpoint of the phase costs, and what the time-limit margin must cover."""
    state, _ = ckpt.load_latest_checkpoint(run_dir / "checkpoints")
    start = time.perf_counter()
    path = ckpt.save_checkpoint(scratch, 0, state, keep=1)
    seconds = time.perf_counter() - start
    return {"checkpoint_bytes": path.stat().st_size, "checkpoint_write_s": seconds}


def check(config: dict, data_dir: str, vocab: str, scratch: Path, steps: int, allreduce_mb: int,
          threads: int | None) -> dict | None:
    env = distributed.setup()
    try:
        if env.is_main:
            shutil.rmtree(scratch, ignore_errors=True)
        distributed.barrier()
        ranks = [placement(env)]
        if env.distributed:
            ranks = [None] * env.world_size
            torch.distributed.all_gather_object(ranks, placement(env))
        bandwidth = allreduce_bus_gbps(env, allreduce_mb)
        s = TrainSettings.from_config(
            config, "phase1", data_dir=data_dir, vocab=vocab, run_dir=str(scratch / "run"),
            out_model=str(scratch / "model"), out_metrics=str(scratch / "metrics.jsonl"),
            out_summary=str(scratch / "summary.json"), out_telemetry=None, out_optimizer=None,
            init_from=(config.get("model") or {}).get("init_from"), threads=threads)
        # steps of about one micro-batch (micro_batch_size rows) per rank: the phase's shapes, not its accumulation
        shards = list_shards(data_dir, "training")
        per_row = sum(shard.n for shard in shards) / sum(shard.rows for shard in shards)
        s = dataclasses.replace(s, global_batch_size=max(1, int(s.micro_batch_size * per_row)) * env.world_size,
                                max_steps=min(steps, s.total_steps), checkpoint_every=steps, log_every=max(1, steps // 4))
        summary = train_phase(s, env)
        distributed.barrier()  # rank 0 has exported the model the comparison loads
        losses = packed_unpacked_losses(s, scratch / "model", env, sequences=16)
        gathered = [losses]
        if env.distributed:
            gathered = [None] * env.world_size
            torch.distributed.all_gather_object(gathered, losses)
        result = None
        if env.is_main:
            result = {"world_size": env.world_size, "ranks": ranks, "allreduce_mb": allreduce_mb,
                      "allreduce_bus_gbps": bandwidth, "preset": s.preset, "precision": summary["precision"],
                      "optimizer": summary["optimizer"], "seq_length": summary["seq_length"], "steps": summary["steps"],
                      "sequences_per_second": summary["seq_per_s"], "real_tokens_per_s": summary["real_tokens_per_s"],
                      "test_mlm_accuracy": summary.get("test_mlm_accuracy"),
                      **checkpoint_write(scratch / "run", scratch / "write"), "packed_vs_unpacked": gathered}
            shutil.rmtree(scratch, ignore_errors=True)
        distributed.barrier()
        return result
    finally:
        distributed.cleanup()


def report(result: dict) -> None:
    for r in result["ranks"]:
        print(f"rank {r['rank']:>3} on {r['host']}: GPU {r['gpu'] or '-'} (CUDA_VISIBLE_DEVICES="
              f"{r['cuda_visible_devices']}, trains on {r['device']}), cores {r['cores']}", file=sys.stderr)
    bandwidth = result["allreduce_bus_gbps"]
    print(f"world size {result['world_size']}; all-reduce {result['allreduce_mb']} MB: "
          f"{bandwidth if bandwidth is None else round(bandwidth, 2)} GB/s bus bandwidth; {result['preset']} "
          f"phase 1 (seq {result['seq_length']}, {result['precision']}, {result['optimizer']}): "
          f"{result['sequences_per_second']:.1f} seq/s over {result['steps']} steps; checkpoint "
          f"{result['checkpoint_bytes'] / 1e9:.2f} GB written in {result['checkpoint_write_s']:.1f} s", file=sys.stderr)
    agreement = result["packed_vs_unpacked"]
    if agreement[0]["packed"]:
        worst = max(a["relative_difference"] for a in agreement)
        print(f"packed vs unpacked loss of the same sequences: relative difference up to {worst:.2e} "
              f"(must be <= {AGREEMENT:g})", file=sys.stderr, flush=True)
        if worst > AGREEMENT:
            raise UserError(f"packed and unpacked losses of the same sequences differ by {worst:.2e} (relative) on "
                            f"this cluster: the packed attention path is wrong here; train with "
                            f"encode.packing.enabled: false until it is fixed")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, type=config_sections,
                        help="JSON of the config sections seed, model and pretrain")
    parser.add_argument("--data-dir", required=True, help="phase 1's data: data/hdf5_seq128")
    parser.add_argument("--vocab", required=True)
    parser.add_argument("--run-dir", required=True, type=Path, help="a scratch directory (emptied before and after)")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--allreduce-mb", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads of the job (shared by its local ranks)")
    args = parser.parse_args(argv)
    result = check(args.config, args.data_dir, args.vocab, args.run_dir, args.steps, args.allreduce_mb, args.threads)
    if result is not None:
        write_text(args.output, json.dumps(result, indent=1) + "\n")
        report(result)


if __name__ == "__main__":
    from workflow.cli import run

    run(main)
