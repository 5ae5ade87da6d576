"""Reading NVIDIA-schema pretraining HDF5 shards: validation, per-rank shard streams with prefetch, batches.

API:
    list_shards(directory, split) -> [ShardInfo]     every `directory/split/*.hdf5`, validated (datasets, shapes)
    read_shard(path) -> dict of numpy arrays
    make_batch(arrays, rows) -> dict of torch tensors: input_ids, token_type_ids, attention_mask,
        masked_lm_positions, masked_lm_labels ([B, P], -1 where no prediction), next_sentence_labels
    PretrainingStream(shards, micro_batch_size, seed, rank, world_size, consumed=0)
        endless iterator of micro-batches. Epoch e: shards shuffled with seed + e, rank r takes every world-th one;
        rows shuffled within a shard; the next shard is read by a background thread. `consumed` micro-batches are
        skipped without reading data, so resuming at a checkpoint's position is exact.
"""
from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import torch

from workflow.cli import UserError

log = logging.getLogger(__name__)

# dataset name -> number of dimensions; all share the first (instance) dimension.
SCHEMA = {
    "input_ids": 2,
    "input_mask": 2,
    "segment_ids": 2,
    "masked_lm_positions": 2,
    "masked_lm_ids": 2,
    "next_sentence_labels": 1,
}


@dataclass(frozen=True)
class ShardInfo:
    path: str
    n: int
    seq_length: int
    max_predictions: int


def _validate(path: Path) -> ShardInfo:
    try:
        handle = h5py.File(path, "r")
    except OSError as error:
        raise UserError(f"{path}: not a readable HDF5 file ({error})") from None
    with handle:
        shapes = {}
        for name, ndim in SCHEMA.items():
            if name not in handle:
                raise UserError(f"{path}: missing dataset {name!r} (expected {sorted(SCHEMA)})")
            shape = handle[name].shape
            if len(shape) != ndim:
                raise UserError(f"{path}: dataset {name!r} has shape {shape}, expected {ndim} dimensions")
            shapes[name] = shape
    n, seq_length = shapes["input_ids"]
    max_predictions = shapes["masked_lm_positions"][1]
    expected = {"input_mask": (n, seq_length), "segment_ids": (n, seq_length),
                "masked_lm_positions": (n, max_predictions), "masked_lm_ids": (n, max_predictions),
                "next_sentence_labels": (n,)}
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise UserError(f"{path}: dataset {name!r} has shape {shapes[name]}, expected {shape} "
                            f"(input_ids is {shapes['input_ids']})")
    return ShardInfo(str(path), n, seq_length, max_predictions)


def list_shards(directory: str | Path, split: str) -> list[ShardInfo]:
    """All shards of one split, sorted by name; every shard checked, all with one sequence length."""
    folder = Path(directory) / split
    paths = sorted(folder.glob("*.hdf5")) if folder.is_dir() else []
    if not paths:
        raise UserError(f"{folder}: no *.hdf5 shards (empty or missing data directory)")
    shards = [_validate(p) for p in paths]
    first = shards[0]
    for shard in shards[1:]:
        if (shard.seq_length, shard.max_predictions) != (first.seq_length, first.max_predictions):
            raise UserError(f"{shard.path}: sequence length/max predictions {shard.seq_length}/"
                            f"{shard.max_predictions} differ from {first.path}'s "
                            f"{first.seq_length}/{first.max_predictions}")
    return shards


def read_shard(path: str) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as handle:
        return {name: handle[name][()] for name in SCHEMA}


def make_batch(arrays: dict[str, np.ndarray], rows) -> dict[str, torch.Tensor]:
    def take(name):
        return torch.from_numpy(np.ascontiguousarray(arrays[name][rows]).astype(np.int64))

    positions = take("masked_lm_positions")
    # A zero position after the first entry ends the list of predictions (position 0 is [CLS], never masked).
    valid = torch.cumprod((positions != 0).long(), dim=1).bool()
    labels = torch.where(valid, take("masked_lm_ids"), torch.full_like(positions, -1))
    return {
        "input_ids": take("input_ids"),
        "token_type_ids": take("segment_ids"),
        "attention_mask": take("input_mask"),
        "masked_lm_positions": positions * valid,
        "masked_lm_labels": labels,
        "next_sentence_labels": take("next_sentence_labels"),
    }


class PretrainingStream:
    def __init__(self, shards: list[ShardInfo], micro_batch_size: int, seed: int, rank: int = 0,
                 world_size: int = 1, consumed: int = 0):
        self.shards = shards
        self.micro = micro_batch_size
        self.seed = seed
        self.rank = rank
        self.world = world_size
        self.consumed = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-prefetch")
        self._pending: dict[int, object] = {}
        # Position: epoch, slot in this rank's shard plan, batch offset within that shard.
        self.epoch, self.slot, self.offset = 0, 0, 0
        self._arrays = None
        self._order = None
        if not any(self._batches(s) for s in range(len(self.shards))):
            raise UserError(f"every training shard holds fewer than micro_batch_size={micro_batch_size} sequences")
        self._skip(consumed)

    def _batches(self, shard_index: int) -> int:
        return self.shards[shard_index].n // self.micro

    def plan(self, epoch: int) -> list[int]:
        """This rank's shards (indices into `shards`) for one epoch."""
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))
        count = math.ceil(len(order) / self.world)
        return [int(order[(i * self.world + self.rank) % len(order)]) for i in range(count)]

    def _skip(self, consumed: int) -> None:
        remaining = consumed
        while True:
            plan = self.plan(self.epoch)
            per_epoch = sum(self._batches(s) for s in plan)
            if remaining >= per_epoch and per_epoch > 0:
                remaining -= per_epoch
                self.epoch += 1
                continue
            if per_epoch == 0:  # this rank's shards are all too small this epoch
                self.epoch += 1
                continue
            break
        for self.slot, shard in enumerate(plan):
            if remaining < self._batches(shard):
                break
            remaining -= self._batches(shard)
        self.offset = remaining
        self.consumed = consumed

    def position(self) -> dict:
        return {"epoch": self.epoch, "shard_order": self.plan(self.epoch), "slot": self.slot,
                "offset": self.offset, "consumed": self.consumed}

    def _load(self, shard: int):
        future = self._pending.pop(shard, None)
        arrays = future.result() if future is not None else read_shard(self.shards[shard].path)
        return arrays

    def _prefetch(self, shard: int) -> None:
        if shard not in self._pending:
            self._pending[shard] = self._pool.submit(read_shard, self.shards[shard].path)

    def _next_location(self, epoch: int, slot: int) -> tuple[int, int]:
        plan = self.plan(epoch)
        return (epoch, slot + 1) if slot + 1 < len(plan) else (epoch + 1, 0)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        while True:
            plan = self.plan(self.epoch)
            shard = plan[self.slot]
            if self.offset < self._batches(shard):
                break
            self.epoch, self.slot = self._next_location(self.epoch, self.slot)
            self.offset, self._arrays = 0, None
        if self._arrays is None:
            self._arrays = self._load(shard)
            rng = np.random.default_rng([self.seed, self.epoch, self.slot, self.rank])
            self._order = rng.permutation(self.shards[shard].n)
            next_epoch, next_slot = self._next_location(self.epoch, self.slot)
            self._prefetch(self.plan(next_epoch)[next_slot])
        rows = np.sort(self._order[self.offset * self.micro:(self.offset + 1) * self.micro])
        batch = make_batch(self._arrays, rows)
        self.offset += 1
        self.consumed += 1
        return batch

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def iterate_in_order(shards: list[ShardInfo], batch_size: int, limit: int | None = None):
    """Every row of `shards` once, in file order, in batches (for held-out evaluation)."""
    remaining = math.inf if limit is None else limit
    for shard in shards:
        if remaining <= 0:
            return
        arrays = read_shard(shard.path)
        n = int(min(shard.n, remaining))
        for start in range(0, n, batch_size):
            yield make_batch(arrays, np.arange(start, min(start + batch_size, n)))
        remaining -= n


SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def write_synthetic_shards(directory: str | Path, vocab_size: int = 64, seq_length: int = 32,
                           max_predictions: int = 5, n_training_shards: int = 2, n_test_shards: int = 1,
                           sequences_per_shard: int = 64, seed: int = 0, step: int = 0) -> Path:
    """A learnable toy corpus in the NVIDIA schema (tests and benchmarks): `directory/{training,test}/*.hdf5`
    and `directory/vocab.txt`. Each segment counts upwards (token i+1 follows token i), so masked tokens are
    predictable from their neighbours; segment B continues A (label 0) or starts anywhere (label 1).
    `step` is the increment between neighbouring tokens (0: each segment repeats one token, the easiest)."""
    directory = Path(directory)
    rng = np.random.default_rng(seed)
    first = len(SPECIAL_TOKENS)
    span = vocab_size - first
    cls_id, sep_id, mask_id = 2, 3, 4
    (directory / "vocab.txt").parent.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.txt").write_text("\n".join(SPECIAL_TOKENS + [f"w{i}" for i in range(span)]) + "\n")

    def instance():
        budget = seq_length - 3
        len_a = int(rng.integers(budget // 4, budget // 2 + 1))
        len_b = int(rng.integers(budget // 4, budget - len_a + 1))
        start = int(rng.integers(span))
        label = int(rng.integers(2))
        start_b = start + max(step * len_a, 1) if label == 0 else int(rng.integers(span))
        a = [first + (start + step * i) % span for i in range(len_a)]
        b = [first + (start_b + step * i) % span for i in range(len_b)]
        tokens = [cls_id, *a, sep_id, *b, sep_id]
        segments = [0] * (len_a + 2) + [1] * (len_b + 1)
        candidates = [i for i, t in enumerate(tokens) if t >= first]
        count = min(max_predictions, max(1, round(0.15 * len(candidates))))
        positions = np.sort(rng.choice(candidates, size=count, replace=False))
        ids = [tokens[p] for p in positions]
        for p in positions:
            tokens[p] = mask_id
        row = np.zeros(seq_length, np.int32)
        row[:len(tokens)] = tokens
        seg = np.zeros(seq_length, np.int8)
        seg[:len(segments)] = segments
        mask = np.zeros(seq_length, np.int8)
        mask[:len(tokens)] = 1
        pos = np.zeros(max_predictions, np.int32)
        pos[:count] = positions
        lm_ids = np.zeros(max_predictions, np.int32)
        lm_ids[:count] = ids
        return row, mask, seg, pos, lm_ids, label

    for split, count in (("training", n_training_shards), ("test", n_test_shards)):
        (directory / split).mkdir(parents=True, exist_ok=True)
        for index in range(count):
            rows = [instance() for _ in range(sequences_per_shard)]
            with h5py.File(directory / split / f"{split}_{index:03d}.hdf5", "w") as handle:
                for column, (name, dtype) in enumerate([("input_ids", "i4"), ("input_mask", "i1"),
                                                        ("segment_ids", "i1"), ("masked_lm_positions", "i4"),
                                                        ("masked_lm_ids", "i4"), ("next_sentence_labels", "i1")]):
                    handle.create_dataset(name, data=np.asarray([r[column] for r in rows], dtype=dtype))
    return directory
