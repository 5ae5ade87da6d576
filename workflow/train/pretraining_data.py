"""Reading NVIDIA-schema pretraining HDF5 shards: validation, per-rank shard streams with prefetch, batches.

API:
    list_shards(directory, split) -> [ShardInfo]     every `directory/split/*.hdf5`, validated (datasets, shapes)
    read_shard(path) -> dict of numpy arrays
    make_batch(arrays, rows) -> dict of torch tensors: input_ids, token_type_ids, attention_mask,
        masked_lm_positions, masked_lm_labels ([B, P], -1 where no prediction), next_sentence_labels
    PretrainingSequences(shards, seed).read(start, count) -> batch
        sequences [start, start + count) of one endless global order (epochs of shuffled shards, rows shuffled
        within a shard) that does not depend on the number of ranks: resuming at a position is exact on any
        number of ranks.
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


class PretrainingSequences:
    """Every training sequence in one global order that does not depend on the number of ranks.

    Epoch e visits the shards in a permutation seeded by (seed, e), the rows of shard s in a permutation seeded by
    (seed, e, s); sequence i of the run is the (i mod N)-th of epoch i // N (N = all training sequences). `read`
    returns any range, so every rank reads its own part of a step and a resumed run (on any number of ranks)
    continues with exactly the next sequences. Shards are read whole, the next one by a background thread.
    """

    def __init__(self, shards: list[ShardInfo], seed: int, cached_shards: int = 3):
        self.shards = shards
        self.seed = seed
        self.epoch_length = sum(s.n for s in shards)
        if self.epoch_length == 0:
            raise UserError(f"{Path(shards[0].path).parent}: the training shards hold no sequences")
        self._cached = cached_shards
        self._arrays: dict[int, dict] = {}   # shard index -> arrays, oldest first
        self._pending: dict[int, object] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-prefetch")

    def plan(self, epoch: int) -> list[int]:
        """The shards (indices into `shards`) in the order epoch `epoch` visits them."""
        return [int(i) for i in np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))]

    def _rows(self, epoch: int, shard: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch, shard]).permutation(self.shards[shard].n)

    def _load(self, shard: int) -> dict:
        if shard not in self._arrays:
            future = self._pending.pop(shard, None)
            self._arrays[shard] = future.result() if future is not None else read_shard(self.shards[shard].path)
            while len(self._arrays) > self._cached:
                self._arrays.pop(next(iter(self._arrays)))
        return self._arrays[shard]

    def _prefetch(self, shard: int) -> None:
        if shard not in self._arrays and shard not in self._pending:
            self._pending[shard] = self._pool.submit(read_shard, self.shards[shard].path)

    def read(self, start: int, count: int) -> dict[str, torch.Tensor]:
        """Sequences [start, start + count) of the global order as one batch."""
        parts = []
        while count > 0:
            epoch, offset = divmod(start, self.epoch_length)
            plan = self.plan(epoch)
            for slot, shard in enumerate(plan):
                if offset < self.shards[shard].n:
                    break
                offset -= self.shards[shard].n
            take = min(count, self.shards[shard].n - offset)
            rows = self._rows(epoch, shard)[offset:offset + take]
            parts.append({name: values[rows] for name, values in self._load(shard).items()})
            following = plan[slot + 1] if slot + 1 < len(plan) else self.plan(epoch + 1)[0]
            self._prefetch(following)
            start, count = start + take, count - take
        arrays = {name: np.concatenate([p[name] for p in parts]) for name in SCHEMA}
        return make_batch(arrays, slice(None))

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
