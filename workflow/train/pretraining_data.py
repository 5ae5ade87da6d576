"""Reading pretraining HDF5 shards, NVIDIA's schema or packed (workflow.data.pack): validation, the global sequence
order, batches.

API:
    list_shards(directory, split) -> [ShardInfo]     every `directory/split/*.hdf5`, validated (datasets, shapes);
                                                     all of one format and one sequence length
    data_identity(directory, shards) -> dict         what identifies the training data (for a run's fingerprint)
    read_shard(shard) -> dict of numpy arrays
    make_batch(arrays, rows, live=None) -> dict of torch tensors: input_ids, token_type_ids, attention_mask,
        masked_lm_positions, masked_lm_labels ([B, P], -1 where no prediction), next_sentence_labels; packed rows
        add position_ids, cls_positions and instance_index, and their next_sentence_labels are [B, S] (-1 = no
        sequence) and attention_mask each token's sequence number (0 = padding), as BertForPreTraining expects.
    PretrainingSequences(shards, seed).read(start, count) -> batch
        sequences [start, start + count) of one endless global order (epochs of shuffled shards, rows shuffled
        within a shard, a packed row's sequences in slot order) that does not depend on the number of ranks:
        resuming at a position is exact on any number of ranks.

Packed rows and batch boundaries: the data position counts sequences, never rows. A read of sequences [a, b)
carries every row holding one of them; a row whose sequences straddle a or b (a step's or a micro-batch's edge) is
carried by both reads, each with only its own sequences live (the others' tokens turned into padding, their
labels -1), so every sequence is trained on exactly once and a step's loss is that of the same sequences unpacked.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import torch

from workflow.cli import UserError
from workflow.train.checkpoint import file_sha256

log = logging.getLogger(__name__)

# dataset name -> number of dimensions; all share the first (row) dimension.
SCHEMA = {
    "input_ids": 2,
    "input_mask": 2,
    "segment_ids": 2,
    "masked_lm_positions": 2,
    "masked_lm_ids": 2,
    "next_sentence_labels": 1,
}
# Packed rows (workflow.data.pack): S sequence slots per row.
PACKED_SCHEMA = {**SCHEMA, "next_sentence_labels": 2, "position_ids": 2, "cls_positions": 2, "sequence_lengths": 2,
                 "instance_index": 2}


@dataclass(frozen=True)
class ShardInfo:
    path: str
    n: int                 # sequences
    seq_length: int
    max_predictions: int
    packed: bool = False
    sequences_per_row: tuple = ()  # packed: each row's number of sequences (they fill its leading slots)

    @property
    def rows(self) -> int:
        return len(self.sequences_per_row) if self.packed else self.n


def _validate(path: Path) -> ShardInfo:
    try:
        handle = h5py.File(path, "r")
    except OSError as error:
        raise UserError(f"{path}: not a readable HDF5 file ({error})") from None
    with handle:
        packed = "cls_positions" in handle
        schema = PACKED_SCHEMA if packed else SCHEMA
        shapes = {}
        for name, ndim in schema.items():
            if name not in handle:
                raise UserError(f"{path}: missing dataset {name!r} (expected {sorted(schema)})")
            shape = handle[name].shape
            if len(shape) != ndim:
                raise UserError(f"{path}: dataset {name!r} has shape {shape}, expected {ndim} dimensions")
            shapes[name] = shape
        sequences_per_row = (handle["sequence_lengths"][()] > 0).sum(axis=1) if packed else None
    n, seq_length = shapes["input_ids"]
    max_predictions = shapes["masked_lm_positions"][1]
    expected = {"input_mask": (n, seq_length), "segment_ids": (n, seq_length),
                "masked_lm_positions": (n, max_predictions), "masked_lm_ids": (n, max_predictions),
                "next_sentence_labels": (n,)}
    if packed:
        slots = shapes["cls_positions"][1]
        expected.update({name: (n, slots) for name in ("next_sentence_labels", "sequence_lengths", "instance_index")},
                        position_ids=(n, seq_length))
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise UserError(f"{path}: dataset {name!r} has shape {shapes[name]}, expected {shape} "
                            f"(input_ids is {shapes['input_ids']})")
    if packed:
        return ShardInfo(str(path), int(sequences_per_row.sum()), seq_length, max_predictions, True,
                         tuple(int(c) for c in sequences_per_row))
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
        if shard.packed != first.packed:
            raise UserError(f"{shard.path}: {'packed' if shard.packed else 'unpacked'}, but {first.path} is "
                            f"{'packed' if first.packed else 'unpacked'}; one data directory holds one format")
        if (shard.seq_length, shard.max_predictions) != (first.seq_length, first.max_predictions):
            raise UserError(f"{shard.path}: sequence length/max predictions {shard.seq_length}/"
                            f"{shard.max_predictions} differ from {first.path}'s "
                            f"{first.seq_length}/{first.max_predictions}")
    return shards


def data_identity(directory: str | Path, shards: list[ShardInfo]) -> dict:
    """What identifies the training data: a digest of their content (from manifest.json's sha256 of each shard,
    checked against the shards found, or, without a manifest, of the files themselves) and the encode settings the
    manifest records, so that data regenerated with other settings but the same counts is told apart."""
    manifest_path = Path(directory) / "manifest.json"
    names = [f"training/{Path(shard.path).name}" for shard in shards]
    if manifest_path.is_file():
        try:
            manifest = json.loads(manifest_path.read_text())
            listed = {entry["path"]: entry for entry in manifest["shards"] if entry["path"].startswith("training/")}
            settings = manifest.get("settings", {})
        except (ValueError, KeyError, TypeError) as error:
            raise UserError(f"{manifest_path}: not a data manifest ({error})") from None
        found = {name: shard.n for name, shard in zip(names, shards)}
        if {name: entry["n_instances"] for name, entry in listed.items()} != found:
            raise UserError(f"{manifest_path}: lists other training shards or counts than {Path(directory) / 'training'}"
                            f" holds ({len(listed)} listed, {len(found)} found); rebuild the directory")
        checksums = [listed[name]["sha256"] for name in names]
    else:
        settings = None
        log.info("%s: no manifest.json; the training data's digest is computed from the shards themselves", directory)
        checksums = [file_sha256(Path(shard.path)) for shard in shards]
    digest = hashlib.sha256(json.dumps([names, [s.n for s in shards], checksums]).encode()).hexdigest()[:16]
    return {"training data": f"{len(shards)} {'packed ' if shards[0].packed else ''}shards, "
                             f"{sum(s.n for s in shards)} sequences, sha256 {digest}",
            "training data settings": settings}


def read_shard(shard: ShardInfo) -> dict[str, np.ndarray]:
    names = [name for name in (PACKED_SCHEMA if shard.packed else SCHEMA) if name != "sequence_lengths"]
    with h5py.File(shard.path, "r") as handle:
        return {name: handle[name][()] for name in names}


def make_batch(arrays: dict[str, np.ndarray], rows, live: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    """The batch of `rows`; for packed rows, `live` [B, S] (default: all) says which of their sequences it trains
    on: the others become padding."""
    def take(name):
        return torch.from_numpy(np.ascontiguousarray(arrays[name][rows]).astype(np.int64))

    positions = take("masked_lm_positions")
    if "cls_positions" not in arrays:
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
    sequence = take("input_mask")  # each token's sequence number, 1..S (0 = padding)
    nsp = take("next_sentence_labels")
    instance = take("instance_index")
    valid = positions > 0  # a packed row's first token is a [CLS]: never masked
    if live is not None:
        live = torch.from_numpy(np.asarray(live, dtype=bool))
        sequence = torch.where(torch.gather(torch.cat([live.new_zeros(len(live), 1), live], 1), 1, sequence),
                               sequence, 0)
        nsp, instance = nsp.masked_fill(~live, -1), instance.masked_fill(~live, -1)
        valid &= torch.gather(sequence, 1, positions) > 0
    return {
        "input_ids": take("input_ids") * (sequence > 0),
        "token_type_ids": take("segment_ids") * (sequence > 0),
        "attention_mask": sequence,
        "position_ids": take("position_ids") * (sequence > 0),
        "cls_positions": take("cls_positions"),
        "masked_lm_positions": positions * valid,
        "masked_lm_labels": torch.where(valid, take("masked_lm_ids"), torch.full_like(positions, -1)),
        "next_sentence_labels": nsp,
        "instance_index": instance,
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
        self._orders: dict[tuple[int, int], tuple] = {}  # (epoch, shard) -> its row order, oldest first
        self._pending: dict[int, object] = {}
        self._pool, self._pool_pid = None, None

    @property
    def pool(self) -> ThreadPoolExecutor:
        """The shard prefetch thread of this process (a forked loader worker starts its own)."""
        if self._pool_pid != os.getpid():
            self._pool, self._pool_pid, self._pending = ThreadPoolExecutor(1, "shard-prefetch"), os.getpid(), {}
        return self._pool

    def plan(self, epoch: int) -> list[int]:
        """The shards (indices into `shards`) in the order epoch `epoch` visits them."""
        return [int(i) for i in np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))]

    def _order(self, epoch: int, shard: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """(rows in the order epoch `epoch` visits them, their sequence counts, the running total of those; None
        unpacked), computed once per shard and epoch: a read of a few sequences must not cost O(rows)."""
        key = (epoch, shard)
        if key not in self._orders:
            info = self.shards[shard]
            rows = np.random.default_rng([self.seed, epoch, shard]).permutation(info.rows)
            per_row = np.asarray(info.sequences_per_row)[rows] if info.packed else None
            self._orders[key] = rows, per_row, None if per_row is None else np.cumsum(per_row)
            while len(self._orders) > self._cached:
                self._orders.pop(next(iter(self._orders)))
        return self._orders[key]

    def _load(self, shard: int) -> dict:
        if shard not in self._arrays:
            future = self._pending.pop(shard, None)
            self._arrays[shard] = future.result() if future is not None else read_shard(self.shards[shard])
            while len(self._arrays) > self._cached:
                self._arrays.pop(next(iter(self._arrays)))
        return self._arrays[shard]

    def _prefetch(self, shard: int) -> None:
        if shard not in self._arrays and shard not in self._pending:
            self._pending[shard] = self.pool.submit(read_shard, self.shards[shard])

    def _take(self, epoch: int, shard: int, offset: int, count: int) -> dict:
        """Sequences [offset, offset + count) of one shard's order in `epoch`, as arrays (+ "live" when packed)."""
        arrays, (order, per_row, ends) = self._load(shard), self._order(epoch, shard)
        if per_row is None:
            rows = order[offset:offset + count]
            return {name: values[rows] for name, values in arrays.items()}
        first, last = np.searchsorted(ends, [offset, offset + count - 1], side="right")
        rows = order[first:last + 1]
        # Global index (within the shard's order) of each slot's sequence; live if it falls in the range.
        slot = np.arange(arrays["cls_positions"].shape[1])
        index = (ends[first:last + 1] - per_row[first:last + 1])[:, None] + slot
        live = (index >= offset) & (index < offset + count) & (slot < per_row[first:last + 1, None])
        return {**{name: values[rows] for name, values in arrays.items()}, "live": live}

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
            parts.append(self._take(epoch, shard, offset, take))
            following = plan[slot + 1] if slot + 1 < len(plan) else self.plan(epoch + 1)[0]
            self._prefetch(following)
            start, count = start + take, count - take
        arrays = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
        live = arrays.pop("live", None)
        return make_batch(arrays, slice(None), live)

    def close(self) -> None:
        if self._pool is not None and self._pool_pid == os.getpid():
            self._pool.shutdown(wait=False, cancel_futures=True)


def iterate_in_order(shards: list[ShardInfo], batch_size: int, limit: int | None = None):
    """Every row of `shards` once, in file order, in batches of `batch_size` rows (held-out evaluation), until the
    rows hold `limit` sequences (packed rows are taken whole: up to S - 1 more)."""
    remaining = math.inf if limit is None else limit
    for shard in shards:
        if remaining <= 0:
            return
        arrays = read_shard(shard)
        per_row = np.asarray(shard.sequences_per_row) if shard.packed else np.ones(shard.rows, np.int64)
        n = int(np.searchsorted(np.cumsum(per_row), remaining) + 1) if remaining < shard.n else shard.rows
        for start in range(0, n, batch_size):
            yield make_batch(arrays, np.arange(start, min(start + batch_size, n)))
        remaining -= int(per_row[:n].sum())
