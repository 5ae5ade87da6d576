"""The fixed held-out evaluation set: the same sequences of the test shards for every run on the same data.

API:
    EvaluationSet(shards, size, seed)   `size` sequences (all when None or more) of the test shards, chosen by `seed`
                                        among their sequences numbered in file order (shard by shard, a packed row's
                                        sequences in slot order); .sequences the chosen numbers (sorted),
                                        .identity what it is (count, seed, a digest of the choice), .batches(rank,
                                        world, rows) this rank's share in batches of `rows` rows

The choice depends on the test shards' names and sizes and the seed only: not on the world size, the training
seed or anything else of the run, so accuracies on it compare across runs (MLPerf's 10,000-sequence set is the
model). A rank scores the contiguous slice rank/world of the chosen sequences; the counts summed over ranks are
the whole set's. Its share is read once (a few chunks per sequence) and kept in memory for later evaluations.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import h5py
import numpy as np

from workflow.train.masking import LoadTimeMasker
from workflow.train.pretraining_data import ShardInfo, datasets, make_batch


class EvaluationSet:
    def __init__(self, shards: list[ShardInfo], size: int | None, seed: int):
        self.shards = shards
        total = sum(shard.n for shard in shards)
        if size is None or size >= total:
            self.sequences = np.arange(total, dtype=np.int64)
        else:
            self.sequences = np.sort(np.random.default_rng(seed).choice(total, size, replace=False)).astype(np.int64)
        listing = json.dumps([[Path(shard.path).name, shard.n] for shard in shards]).encode()
        digest = hashlib.sha256(listing + self.sequences.tobytes()).hexdigest()[:16]
        self.identity = (f"{len(self.sequences)} of {total} sequences of {len(shards)} test shards, seed {seed}, "
                         f"sha256 {digest}")
        self._share: tuple | None = None   # ((rank, world), arrays with "live") once read

    def locate(self, sequences: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """(shard index, its rows holding `sequences` (sorted, unique), live) per shard: live [rows] (unpacked) or
        [rows, slots] (packed) marks the chosen sequences of each row."""
        found, offset = [], 0
        for index, shard in enumerate(self.shards):
            local = sequences[(sequences >= offset) & (sequences < offset + shard.n)] - offset
            offset += shard.n
            if not len(local):
                continue
            if not shard.packed:
                found.append((index, local, np.ones(len(local), bool)))
                continue
            per_row = shard.sequences_per_row.astype(np.int64)
            ends = np.cumsum(per_row)
            row = np.searchsorted(ends, local, side="right")
            rows, inverse = np.unique(row, return_inverse=True)
            live = np.zeros((len(rows), shard.slots), bool)
            live[inverse, local - (ends[row] - per_row[row])] = True
            found.append((index, rows, live))
        return found

    def _arrays(self, rank: int, world: int) -> dict[str, np.ndarray]:
        if self._share is None or self._share[0] != (rank, world):
            n = len(self.sequences)
            mine = self.sequences[n * rank // world:n * (rank + 1) // world]
            parts = []
            for index, rows, live in self.locate(mine):
                with h5py.File(self.shards[index].path, "r") as handle:
                    part = {name: dataset[rows] for name, dataset in datasets(handle, self.shards[index]).items()}
                masker = LoadTimeMasker.of_shard(self.shards[index].path) if self.shards[index].dynamic else None
                # Dynamic masking: fixed masks (epoch 0, the encode seed), the same for every run on the data.
                parts.append({**(masker(part, 0, index, rows) if masker else part), "live": live})
            arrays = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]} if parts else {}
            self._share = (rank, world), arrays
        return self._share[1]

    def batches(self, rank: int, world: int, rows: int):
        """This rank's share of the set (the chosen sequences n*rank//world .. n*(rank+1)//world - 1) in batches of
        `rows` rows, only the chosen sequences of each row live."""
        arrays = dict(self._arrays(rank, world))
        if not arrays:
            return
        live = arrays.pop("live")
        for start in range(0, len(live), rows):
            yield make_batch(arrays, slice(start, start + rows), live[start:start + rows], self.shards[0].pad_id)
