"""Benchmark: what ONE loader process costs and delivers at full-size shards, today's loader beside the one before.

    python benchmarks/input_pipeline.py [--instances 600000 --instances-512 200000] [--real-text MB] [--dynamic]
    python benchmarks/input_pipeline.py --descriptors

Data, packed as the DAG packs it (PackSettings: gapfill, <= 3 per row, gzip, encode's HDF5 layout): by default one
generated shard per sequence length of full size (Wikipedia-like lengths and predictions, benchmarks/train_step.py's
generator, random token ids), linked twice into the training directory so that the loader crosses shards as it does
among 256 (two shards of identical content); with --real-text, two shards encoded from that much real Wikipedia
text (the real extract, format, vocab, tokenize and encode stages; far below full size).

Each side runs in its own process with one torch thread and reads one epoch of the training order as its trainer's
DataLoader worker does (HDF5 read + gzip decompression, row selection, straddling rows trimmed, int64 tensors;
pinned-memory copies, CUDA only, excluded):
  - ours: workflow.train.pretraining_data.PretrainingSequences (chunks of 256 rows in a global shuffle, read as
    contiguous slices, 4 decoded chunks cached), `micro_batches`: one rank's share of a step (4,096 sequences, as
    at 16 ranks) in micro-batches of --micro-batch rows (the last filled up with empty rows);
  - before: the same module at BASELINE (read from git), as issue 18 found it: whole shards read (`read_shard`) and
    cached (3), the next one read ahead by a thread, rows shuffled within a shard; `read` of --micro-batch sequences.
  - dynamic (--dynamic): ours on the same rows unmasked (encode.masking: dynamic), masked by the loader as it reads
    (workflow.train.masking), beside ours on the static file.
With --descriptors instead: what crosses from the trainer's DataLoader workers (engine.step_batches, 2 workers, 2
steps ahead) at BERT-large phase 1's size (global batch 65,536, micro-batches of 64 rows, rank 0 of 8, a generated
packed shard at 128): a step's micro-batches as they were passed (a list of dicts: each tensor its own shared-memory
file descriptor) beside today's (one stacked tensor per field); per layout the tensors per item, the peak of open
descriptors in the trainer and in each worker (/proc/<pid>/fd, polled every 2 ms) and each worker's peak RSS.

Printed per side: peak RSS of the process (python + torch + h5py imports included; the imports alone beside),
sequences and real tokens per CPU second (all the process's threads, prefetch thread included; CPU time, since the
machine is shared) and wall seconds; then the mixing of a phase-1 step at full size (256 shards of 850k sequences,
2.5 per row, global batch 65,536; every document's 5 maskings at random rows of its shard): the share of the step's
sequences from its most common shard, the shards it draws from, and pairs of copies of one document, for today's
order, the order before and a uniform shuffle.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.wikipedia_sample import run_stage  # noqa: E402

BASELINE = "0b9fa38"  # main before issue 18: whole-shard reads
PREDICTIONS = {128: 20, 512: 80}
TARGETS = {128: 100_000, 512: 40_000}  # issue 18: sequences per CPU second of one loader
RSS_TARGET_MB = 1024
RANK_SHARE = 4096  # sequences of a phase-1 step (65,536) one rank of 16 trains on


def loader_module(side: str):
    """workflow.train.pretraining_data as it is (ours) or at BASELINE (before)."""
    if side == "ours":
        from workflow.train import pretraining_data

        return pretraining_data
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{BASELINE}:workflow/train/pretraining_data.py"],
                            capture_output=True, text=True, check=True).stdout
    module = types.ModuleType("pretraining_data_before")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{BASELINE}:pretraining_data.py", "exec"), module.__dict__)
    return module


def peak_rss_mb() -> float:
    """This process's peak resident set since its exec (VmHWM; ru_maxrss would include its parent's before exec)."""
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) / 1024


def read_epoch(side: str, directory: str, micro_batch: int) -> None:
    """The child process: one epoch in micro-batches; prints its figures as JSON."""
    import torch

    torch.set_num_threads(1)
    module = loader_module(side)
    imports_mb = peak_rss_mb()
    cpu, wall = time.process_time(), time.perf_counter()
    sequences = module.PretrainingSequences(module.list_shards(directory, "training"), seed=1)
    if side == "ours":  # as the trainer reads: a rank's share of each step, in micro-batches of micro_batch rows
        total, real = sequences.epoch_length // RANK_SHARE * RANK_SHARE, 0
        for start in range(0, total, RANK_SHARE):
            real += sum(int((b["attention_mask"] > 0).sum()) for b in
                        sequences.micro_batches(start, RANK_SHARE, 0, 1, micro_batch))
    else:  # as its trainer read: micro-batches of micro_batch sequences
        total, real = sequences.epoch_length // micro_batch * micro_batch, 0
        for start in range(0, total, micro_batch):
            real += int((sequences.read(start, micro_batch)["attention_mask"] > 0).sum())
    sequences.close()
    print(json.dumps({"sequences": total, "real_tokens": real, "cpu_s": time.process_time() - cpu,
                      "wall_s": time.perf_counter() - wall, "imports_mb": imports_mb, "peak_mb": peak_rss_mb()}))


def generated_shard(path: Path, seq: int, n: int) -> None:
    """A packed shard of `n` Wikipedia-like instances (a block of distinct ones, repeated), encode's HDF5 layout."""
    from benchmarks.train_step import instances
    from workflow.data.hdf5 import write_shard
    from workflow.data.pack import PackSettings, pack_arrays
    from workflow.train.models.bert import BertConfig

    block = instances(BertConfig(vocab_size=30522), seq, PREDICTIONS[seq], min(n, 50_000))
    arrays = {name: np.resize(values, (n, *values.shape[1:])) for name, values in block.items()}
    settings = PackSettings()
    packed = pack_arrays(arrays, settings.max_sequences_per_pack, algorithm=settings.algorithm)
    write_shard(path, {}, {name: (values.shape, values.dtype) for name, values in packed.items()}, [packed], "gzip")


def dynamic_shard(static: Path, dynamic: Path, seq: int) -> None:
    """The generated shard as encode.masking: dynamic writes it: no predictions in the file, the masker's
    attributes and vocab table (BERT's uncased vocab has 5,828 "##" pieces of 30,522; random ids stand for them)."""
    import h5py

    from workflow.data.vocab import SPECIAL_TOKENS

    with h5py.File(static, "r") as source, h5py.File(dynamic, "w", libver="earliest") as target:
        for name in source:
            source.copy(name, target)
        for name in ("masked_lm_positions", "masked_lm_ids"):
            target[name][...] = 0
        ids = {token: SPECIAL_TOKENS.index(token) for token in ("[CLS]", "[SEP]", "[MASK]")}
        target.attrs.update(masking="dynamic", max_seq_length=seq, max_predictions_per_seq=PREDICTIONS[seq],
                            masked_lm_prob=0.15, whole_word_masking=False, seed=12345, cls_id=ids["[CLS]"],
                            sep_id=ids["[SEP]"], mask_id=ids["[MASK]"])
        target["continues_word"] = (np.random.default_rng(0).random(30522) < 5828 / 30522).astype(np.uint8)


def real_text_shards(directory: Path, seq: int, work: Path, megabytes: float, masking: str = "static") -> None:
    from benchmarks.wikipedia_sample import real_text
    from workflow.data.encode import EncodeSettings, encode_shard
    from workflow.data.pack import PackSettings
    from workflow.data.tokenize import tokenize_shard
    from workflow.data.vocab import train_vocab

    if not (work / "tokenized.npz").exists():
        text = real_text(megabytes, work / "text.txt")
        train_vocab([text], work / "vocab.txt", size=30522, lowercase=True)
        tokenize_shard(text, work / "vocab.txt", work / "tokenized.npz")
    settings = EncodeSettings(max_seq_length=seq, max_predictions_per_seq=PREDICTIONS[seq], masking=masking)
    for index in range(2):  # other shard seeds: other instances of the same text
        encode_shard(work / "tokenized.npz", work / "vocab.txt", directory / "training" / f"shard_{index}.hdf5",
                     settings, seed=12345, split="training", shard_index=index, packing=PackSettings())


def step_mixing(shard_of: np.ndarray, document_of: np.ndarray, step: int) -> tuple[float, int, float]:
    """Means over the steps: (share of the most common shard, shards drawn from, pairs of copies of a document)."""
    share, shards, pairs = [], [], []
    for k in range(len(shard_of) // step):
        counts = np.bincount(shard_of[k * step:(k + 1) * step])
        share.append(counts.max() / step)
        shards.append(np.count_nonzero(counts))
        copies = np.unique(document_of[k * step:(k + 1) * step], return_counts=True)[1]
        pairs.append((copies * (copies - 1) // 2).sum())
    return float(np.mean(share)), float(np.mean(shards)), float(np.mean(pairs))


def full_size_mixing(steps: int = 20, n_shards: int = 256, per_shard: int = 850_000, per_row: float = 2.5,
                     step: int = 65_536, dupe_factor: int = 5) -> None:
    """Mixing of `steps` phase-1 steps, as unpacked rows of chunk_rows x per_row sequences (same chunk sequences)."""
    from workflow.train.pretraining_data import ORDER_CHUNK_ROWS, PretrainingSequences, ShardInfo

    rng = np.random.default_rng(0)
    shards = [ShardInfo(f"shard_{i}", per_shard, 128, 20) for i in range(n_shards)]
    sources = PretrainingSequences(shards, seed=1, chunk_rows=int(ORDER_CHUNK_ROWS * per_row)).sources(0, steps * step)
    placement = rng.permutation(per_shard)  # a document's copies lie at random rows of its shard (encode shuffles)

    def documents(shard, row):
        return shard * per_shard + placement[row] // dupe_factor

    uniform = rng.integers(0, n_shards * per_shard, steps * step)  # (with replacement: 1.3 M of 218 M)
    # Before: a step is a slice of one shard's shuffled rows.
    before_shard = np.repeat(rng.integers(0, n_shards, steps), step)
    before_row = np.concatenate([rng.permutation(per_shard)[:step] for _ in range(steps)])
    print(f"mixing of a phase-1 step at full size ({n_shards} shards of {per_shard:,} sequences, {per_row} per row, "
          f"step {step:,}, dupe_factor {dupe_factor}), mean over {steps} steps: top shard's share | shards | pairs "
          f"of copies of one document")
    for name, (shard, row) in (("ours (chunks of %d rows)" % ORDER_CHUNK_ROWS, (sources[:, 0], sources[:, 1])),
                               ("before (shard by shard)", (before_shard, before_row)),
                               ("uniform shuffle", (uniform // per_shard, uniform % per_shard))):
        share, drawn, pairs = step_mixing(shard, documents(shard, row), step)
        print(f"  {name:<26} {share:7.2%} | {drawn:5.1f} | {pairs:8.1f}")


DESCRIPTOR_STEPS = 6
PHASE1 = {"global_batch_size": 65_536, "micro_batch_size": 64, "world": 8}  # config.yaml's phase 1 on 8 ranks


def _open_descriptors(pid) -> int:
    try:
        return len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except OSError:
        return 0


def _rss_mb(pid) -> float:
    try:
        return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) / 1024
    except (OSError, IndexError):
        return 0.0


def read_steps_through_loader(layout: str, directory: str) -> None:
    """The child process: DESCRIPTOR_STEPS steps of rank 0 through engine.step_batches in `layout` ("stacked", or
    "list": each micro-batch's tensors passed on their own, as before); prints its figures as JSON."""
    import threading
    import types as namespace

    import torch

    from workflow.train import engine
    from workflow.train.pretraining_data import PretrainingSequences, list_shards

    torch.set_num_threads(1)
    if layout == "list":
        engine._Steps.__getitem__ = engine._Steps.micro_batches
        engine.unstack_micro_batches = lambda step: step
    settings = engine.LoopSettings("pretrain.phase1", "unused", DESCRIPTOR_STEPS, PHASE1["global_batch_size"],
                                   PHASE1["micro_batch_size"], loader_workers=2, prefetch_steps=2)
    env = namespace.SimpleNamespace(rank=0, world_size=PHASE1["world"], device=torch.device("cpu"))
    sequences = PretrainingSequences(list_shards(directory, "training"), seed=1)
    peaks = {"trainer": 0, "workers": {}}
    done = threading.Event()

    def poll():
        me = os.getpid()
        while not done.is_set():
            peaks["trainer"] = max(peaks["trainer"], _open_descriptors(me))
            for pid in Path(f"/proc/{me}/task/{me}/children").read_text().split():  # the workers
                fds, rss = peaks["workers"].get(pid, (0, 0.0))
                peaks["workers"][pid] = (max(fds, _open_descriptors(pid)), max(rss, _rss_mb(pid)))
            time.sleep(0.002)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    started = time.perf_counter()
    starts = [k * PHASE1["global_batch_size"] for k in range(DESCRIPTOR_STEPS)]
    shapes = [(len(step), len(step[0])) for step in engine.step_batches(sequences, starts, settings, env)]
    elapsed = time.perf_counter() - started
    done.set()
    poller.join()
    workers = sorted(peaks["workers"].values(), reverse=True)[:settings.loader_workers]
    micro_batches, fields = shapes[0]
    print(json.dumps({"micro_batches": micro_batches, "tensors": micro_batches * fields if layout == "list" else fields,
                      "trainer_fds": peaks["trainer"], "worker_fds": [w[0] for w in workers],
                      "worker_rss_mb": [round(w[1]) for w in workers], "s_per_step": elapsed / DESCRIPTOR_STEPS}))


def descriptors(instances: int) -> None:
    """--descriptors: the file descriptors and RSS of the loader at phase 1's size, the old layout beside today's."""
    import resource

    with tempfile.TemporaryDirectory() as temporary:
        directory = Path(temporary) / "hdf5_seq128"
        (directory / "training").mkdir(parents=True)
        generated_shard(directory / "training" / "shard_0.hdf5", 128, instances)
        print(f"rank 0 of {PHASE1['world']}, global batch {PHASE1['global_batch_size']:,}, micro-batches of "
              f"{PHASE1['micro_batch_size']} rows, 2 workers 2 steps ahead, {DESCRIPTOR_STEPS} steps; a generated "
              f"packed shard of {instances:,} instances at 128 (ulimit -n here: "
              f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]})")
        for layout, name in (("list", "before: a list of micro-batches"), ("stacked", "today: one tensor per field")):
            figures = json.loads(run_stage([sys.executable, Path(__file__), "--child-descriptors", layout,
                                            directory]).stdout)
            print(f"  {name:<34}: {figures['micro_batches']} micro-batches, {figures['tensors']:5,} tensors per item | "
                  f"peak open descriptors: trainer {figures['trainer_fds']:5,}, workers "
                  f"{', '.join(f'{n:,}' for n in figures['worker_fds'])} | worker RSS "
                  f"{', '.join(f'{n:,}' for n in figures['worker_rss_mb'])} MB | {figures['s_per_step']:.2f} s/step")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=600_000, help="instances of the generated shard at 128")
    parser.add_argument("--instances-512", type=int, default=200_000, help="instances of the generated shard at 512")
    parser.add_argument("--real-text", type=float, default=None, help="MB of real text instead of generated shards")
    parser.add_argument("--micro-batch", type=int, default=64, help="rows (ours) or sequences (before) per read, 128")
    parser.add_argument("--micro-batch-512", type=int, default=16, help="the same at 512")
    parser.add_argument("--dynamic", action="store_true", help="also ours on dynamic-masking files (side 'dynamic')")
    parser.add_argument("--descriptors", action="store_true", help="only the loader's descriptors and RSS per worker")
    parser.add_argument("--child", nargs=3, metavar=("SIDE", "DIR", "MICRO"), help=argparse.SUPPRESS)
    parser.add_argument("--child-descriptors", nargs=2, metavar=("LAYOUT", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return read_epoch(args.child[0], args.child[1], int(args.child[2]))
    if args.child_descriptors:
        return read_steps_through_loader(*args.child_descriptors)
    if args.descriptors:
        return descriptors(min(args.instances, 100_000))
    with tempfile.TemporaryDirectory() as temporary:
        work = Path(temporary)
        for seq, n, micro in ((128, args.instances, args.micro_batch), (512, args.instances_512, args.micro_batch_512)):
            directory = work / f"hdf5_seq{seq}"
            (directory / "training").mkdir(parents=True)
            started = time.process_time()
            dynamic = work / f"hdf5_seq{seq}_dynamic"
            (dynamic / "training").mkdir(parents=True)
            if args.real_text:
                real_text_shards(directory, seq, work, args.real_text)
                if args.dynamic:
                    real_text_shards(dynamic, seq, work, args.real_text, "dynamic")
                source = f"{args.real_text} MB of real text, 2 shards"
            else:
                generated_shard(work / f"seq{seq}.hdf5", seq, n)
                if args.dynamic:
                    dynamic_shard(work / f"seq{seq}.hdf5", work / f"seq{seq}_dynamic.hdf5", seq)
                for index in range(2):
                    (directory / "training" / f"shard_{index}.hdf5").hardlink_to(work / f"seq{seq}.hdf5")
                    if args.dynamic:
                        (dynamic / "training" / f"shard_{index}.hdf5").hardlink_to(work / f"seq{seq}_dynamic.hdf5")
                source = f"a generated shard of {n:,} instances, linked twice"
            files = sorted((directory / "training").iterdir())
            size = sum(f.stat().st_size for f in files) / 2**20
            print(f"seq {seq}: {source} ({size:,.0f} MB on disk, made in {time.process_time() - started:.0f} CPU s), "
                  f"micro-batches of {micro} rows (ours) / sequences (before):")
            sides = {"before": directory, "ours": directory, **({"dynamic": dynamic} if args.dynamic else {})}
            for side, data in sides.items():
                measured = run_stage([sys.executable, Path(__file__), "--child", "ours" if side == "dynamic" else side,
                                      data, micro])
                figures = json.loads(measured.stdout)
                rate = figures["sequences"] / figures["cpu_s"]
                print(f"  {side:<7}: peak RSS {figures['peak_mb']:6,.0f} MB "
                      f"(imports alone {figures['imports_mb']:,.0f}) | "
                      f"{rate:9,.0f} seq per CPU s | {figures['real_tokens'] / figures['cpu_s']:12,.0f} real tokens "
                      f"per CPU s | {figures['sequences']:,} sequences, {figures['cpu_s']:.1f} CPU s, "
                      f"{figures['wall_s']:.1f} s wall")
            print(f"  targets: <= {RSS_TARGET_MB:,} MB per loader, >= {TARGETS[seq]:,} seq per CPU s")
    full_size_mixing()


if __name__ == "__main__":
    main()
