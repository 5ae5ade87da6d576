"""Reading pretraining HDF5 shards, NVIDIA's schema or packed (workflow.data.pack): validation, the global sequence
order, batches.

API:
    list_shards(directory, split) -> [ShardInfo]     every `directory/split/*.hdf5`, validated (datasets, shapes);
                                                     all of one format and one sequence length
    data_identity(directory, shards) -> dict         what identifies the training data (for a run's fingerprint)
    row_tokens_per_sequence(directory) -> float      rows x max_seq_length per training sequence (a batch in tokens)
    read_shard(shard) -> dict of numpy arrays
    make_batch(arrays, rows, live=None, pad_id=0) -> dict of torch tensors: input_ids, token_type_ids, attention_mask,
        masked_lm_positions, masked_lm_labels ([B, P], -1 where no prediction), next_sentence_labels; packed rows
        add position_ids, cls_positions and instance_index, and their next_sentence_labels are [B, S] (-1 = no
        sequence) and attention_mask each token's sequence number (0 = padding), as BertForPreTraining expects;
        input_ids hold the shards' padding id (ShardInfo.pad_id) where no sequence is trained on.
    PretrainingSequences(shards, seed).read(start, count) -> batch
        sequences [start, start + count) of one endless global order (epochs of one seeded shuffle of every
        shard's chunks of ORDER_CHUNK_ROWS rows, a packed row's sequences in slot order) that does not depend on the
        number of ranks: resuming at a position is exact on any number of ranks. `.sources(start, count)`: their
        (shard, row), without reading; `.micro_batches(...)`: one rank's share of a step in micro-batches of rows.

Packed rows and batch boundaries: the data position counts sequences, never rows. A read of sequences [a, b)
carries every row holding one of them; a row whose sequences straddle a or b (a step's or a micro-batch's edge) is
carried by both reads, each with only its own sequences live (the others' tokens turned into padding, their
labels -1), so every sequence is trained on exactly once and a step's loss is that of the same sequences unpacked.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import torch

from workflow.cli import UserError
from workflow.data.hdf5 import CHUNK_ROWS, PACKED_VERSION, pad_id_of
from workflow.train.checkpoint import file_sha256
from workflow.train.masking import LoadTimeMasker

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


@dataclass(frozen=True, eq=False)
class ShardInfo:
    path: str
    n: int                 # sequences
    seq_length: int
    max_predictions: int
    packed: bool = False
    sequences_per_row: np.ndarray | None = None  # packed: each row's number of sequences (uint16; its leading slots)
    slots: int = 1         # sequence slots per row (packed: max_sequences_per_pack)
    dynamic: bool = False  # unmasked rows: the loader masks them (workflow.train.masking)
    objective: str = "nsp"  # encode.objective: nsp (segment pairs), full_sentences or documents (no NSP labels)
    pad_id: int = 0        # the id input_ids are padded with (the tokenizer's; root attribute pad_id, absent = 0)

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
        dynamic = handle.attrs.get("masking", "static") == "dynamic"
        objective = str(handle.attrs.get("objective", "nsp"))
        packed_version = int(handle.attrs.get("packed_version", 1))
        pad_id = pad_id_of(handle.attrs)
    if packed and objective == "full_sentences" and packed_version < PACKED_VERSION:
        # Such a shard holds a [PAD] inside every sequence (workflow.data.hdf5.PACKED_VERSION): never train on it.
        raise UserError(f"{path}: packed full-sentences data of layout version {packed_version}, which holds a [PAD] "
                        f"inside every sequence; rebuild it (snakemake rebuilds data/encoded_seq* and "
                        f"data/hdf5_seq* on its own) and start the pretraining run over in a new run directory")
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
                         sequences_per_row.astype(np.uint16), shapes["cls_positions"][1], dynamic, objective, pad_id)
    return ShardInfo(str(path), n, seq_length, max_predictions, dynamic=dynamic, objective=objective, pad_id=pad_id)


def _recipe(shard: ShardInfo) -> str:
    return f"{'dynamic' if shard.dynamic else 'static'}/{shard.objective}"


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
        if (shard.dynamic, shard.objective) != (first.dynamic, first.objective):
            raise UserError(f"{shard.path}: masking/objective {_recipe(shard)}, but {first.path} has "
                            f"{_recipe(first)}; one data directory holds one recipe")
        if shard.pad_id != first.pad_id:
            raise UserError(f"{shard.path}: padding id {shard.pad_id}, but {first.path} has {first.pad_id}; one data "
                            f"directory holds one vocab")
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
            raise UserError(f"{manifest_path}: lists other training shards or counts than "
                            f"{Path(directory) / 'training'} holds ({len(listed)} listed, {len(found)} found); "
                            f"rebuild the directory")
        checksums = [listed[name]["sha256"] for name in names]
    else:
        settings = None
        log.info("%s: no manifest.json; the training data's digest is computed from the shards themselves", directory)
        checksums = [file_sha256(Path(shard.path)) for shard in shards]
    digest = hashlib.sha256(json.dumps([names, [s.n for s in shards], checksums]).encode()).hexdigest()[:16]
    return {"encode.masking": "dynamic" if shards[0].dynamic else "static", "encode.objective": shards[0].objective,
            "training data": f"{len(shards)} {'packed ' if shards[0].packed else ''}shards, "
                             f"{sum(s.n for s in shards)} sequences, sha256 {digest}",
            "training data settings": settings}


def row_tokens_per_sequence(directory: str | Path) -> float:
    """Row tokens (rows x max_seq_length) per training sequence of `directory`, on average: max_seq_length unpacked,
    max_seq_length x rows / sequences packed (what a phase given in tokens divides by). From manifest.json's counts
    where there is one, else from the shards."""
    manifest_path = Path(directory) / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    training = [shard for shard in manifest.get("shards", []) if shard["path"].startswith("training/")]
    if training and all("n_rows" in shard for shard in training):
        length, rows, sequences = (manifest["settings"]["max_seq_length"], sum(s["n_rows"] for s in training),
                                   sum(s["n_instances"] for s in training))
    else:
        shards = list_shards(directory, "training")
        length, rows, sequences = shards[0].seq_length, sum(s.rows for s in shards), sum(s.n for s in shards)
    if not sequences:
        raise UserError(f"{Path(directory) / 'training'}: the training shards hold no sequences")
    return length * rows / sequences


def _names(shard: ShardInfo) -> list[str]:
    return [name for name in (PACKED_SCHEMA if shard.packed else SCHEMA) if name != "sequence_lengths"]


def datasets(handle: h5py.File, shard: ShardInfo) -> dict[str, h5py.Dataset]:
    """The datasets a batch is made of (looking one up by name costs more than reading a few rows of it)."""
    return {name: handle[name] for name in _names(shard)}


def read_rows(arrays: dict[str, h5py.Dataset], first: int, stop: int) -> dict[str, np.ndarray]:
    """Rows [first, stop) of a shard's datasets: one contiguous slice each (HDF5 decompresses only its chunks)."""
    return {name: dataset[first:stop] for name, dataset in arrays.items()}


def read_shard(shard: ShardInfo) -> dict[str, np.ndarray]:
    """A whole shard in memory (tests and the input benchmark's baseline; training reads chunks of rows)."""
    with h5py.File(shard.path, "r") as handle:
        return read_rows(datasets(handle, shard), 0, shard.rows)


def make_batch(arrays: dict[str, np.ndarray], rows, live: np.ndarray | None = None,
               pad_id: int = 0) -> dict[str, torch.Tensor]:
    """The batch of `rows`; for packed rows, `live` [B, S] (default: all) says which of their sequences it trains
    on: the others become padding (input_ids `pad_id`); for unpacked rows, `live` [B] marks the empty rows (no NSP
    label) as False."""
    def take(name):
        return torch.from_numpy(np.ascontiguousarray(arrays[name][rows]).astype(np.int64))

    positions = take("masked_lm_positions")
    if "cls_positions" not in arrays:
        # A zero position after the first entry ends the list of predictions (position 0 is [CLS], never masked).
        valid = torch.cumprod((positions != 0).long(), dim=1).bool()
        labels = torch.where(valid, take("masked_lm_ids"), torch.full_like(positions, -1))
        nsp = take("next_sentence_labels")
        if live is not None:  # [B]: a row that is not live is an empty row (its masked positions are all 0)
            nsp = nsp.masked_fill(~torch.from_numpy(np.asarray(live, dtype=bool)), -1)
        return {
            "input_ids": take("input_ids"),
            "token_type_ids": take("segment_ids"),
            "attention_mask": take("input_mask"),
            "masked_lm_positions": positions * valid,
            "masked_lm_labels": labels,
            "next_sentence_labels": nsp,
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
        "input_ids": take("input_ids").masked_fill(sequence == 0, pad_id),
        "token_type_ids": take("segment_ids") * (sequence > 0),
        "attention_mask": sequence,
        "position_ids": take("position_ids") * (sequence > 0),
        "cls_positions": take("cls_positions"),
        "masked_lm_positions": positions * valid,
        "masked_lm_labels": torch.where(valid, take("masked_lm_ids"), torch.full_like(positions, -1)),
        "next_sentence_labels": nsp,
        "instance_index": instance,
    }


def padded(arrays: dict[str, np.ndarray], rows: int, pad_id: int = 0) -> tuple[dict, slice, np.ndarray]:
    """make_batch's arguments for `arrays` filled up to `rows` rows with empty ones, which carry no label and no live
    sequence (an unpacked empty row attends to its first token: a row with nothing to attend to would give NaN) and
    `pad_id` for input_ids; `arrays["live"]` (default: every sequence) says which sequences of the real rows are
    trained on."""
    n = len(arrays["input_ids"])
    packed = "cls_positions" in arrays
    arrays = {"live": np.ones(arrays["cls_positions"].shape if packed else n, bool), **arrays}
    empty = {name: np.full((rows - n, *values.shape[1:]), pad_id if name == "input_ids" else 0, values.dtype)
             for name, values in arrays.items()}
    arrays = {name: np.concatenate([values, empty[name]]) for name, values in arrays.items()}
    if not packed:
        arrays["input_mask"][n:, 0] = 1
    return arrays, slice(None), arrays.pop("live")


ORDER_CHUNK_ROWS = 4 * CHUNK_ROWS  # rows read together from one shard (256): whole HDF5 chunks of the wide datasets
# The order's name, in the fingerprint: a checkpoint of another order refuses to resume.
ORDER = f"chunks of {ORDER_CHUNK_ROWS} rows of every shard, one seeded shuffle of them all per epoch"


class PretrainingSequences:
    """Every training sequence in one global order that does not depend on the number of ranks.

    Epoch e cuts every shard into chunks of `chunk_rows` consecutive rows and visits the chunks of all shards in one
    permutation seeded by (seed, e); a chunk's rows in file order (encode shuffled the instances), a packed row's
    sequences in slot order. Sequence i of the run is the (i mod N)-th of epoch i // N (N = all training sequences).
    A step of G sequences thus spans ~G / (chunk_rows x sequences per row) chunks of as many shards, close to a
    uniform shuffle (tests/test_pretrain.py measures it), while every read stays a contiguous, HDF5-chunk-aligned
    slice. `read` returns any range, so every rank reads its own part of a step and a resumed run (on any number of
    ranks) continues with exactly the next sequences. A process holds the few chunks it is reading (decompressed
    once) and a few open files, never a whole shard.
    """

    def __init__(self, shards: list[ShardInfo], seed: int, chunk_rows: int = ORDER_CHUNK_ROWS,
                 cached_chunks: int = 4, open_files: int = 16):
        self.shards, self.seed, self.chunk_rows = shards, seed, chunk_rows
        self._cached_chunks, self._open_files = cached_chunks, open_files
        shard, first, sequences = [], [], []
        for index, info in enumerate(shards):
            starts = np.arange(0, info.rows, chunk_rows)
            shard.append(np.full(len(starts), index, np.int32))
            first.append(starts)
            sequences.append(np.add.reduceat(info.sequences_per_row, starts, dtype=np.int64) if info.packed and len(
                starts) else np.minimum(chunk_rows, info.rows - starts))
        self._chunk_shard, self._chunk_first = np.concatenate(shard), np.concatenate(first)
        self._chunk_sequences = np.concatenate(sequences).astype(np.int64)
        self.epoch_length = int(self._chunk_sequences.sum())
        if self.epoch_length == 0:
            raise UserError(f"{Path(shards[0].path).parent}: the training shards hold no sequences")
        self._epochs: dict[int, tuple] = {}     # epoch -> (chunk order, running sequence total), newest 2
        self._chunks: dict[int, dict] = {}      # chunk -> its rows' arrays, oldest first
        self._files: dict[int, tuple] = {}      # shard -> (open file, its datasets), oldest first
        self._pid = os.getpid()
        self._masker = LoadTimeMasker.of_shard(shards[0].path, seed) if shards[0].dynamic else None

    def __getstate__(self):  # a spawned loader worker opens its own files
        return {**self.__dict__, "_files": {}, "_chunks": {}}

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if epoch not in self._epochs:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self._chunk_shard))
            self._epochs[epoch] = order, np.cumsum(self._chunk_sequences[order])
            while len(self._epochs) > 2:
                self._epochs.pop(next(iter(self._epochs)))
        return self._epochs[epoch]

    def pieces(self, start: int, count: int):
        """(chunk, first sequence within it, count, epoch) of the chunks holding sequences [start, start + count)."""
        while count > 0:
            epoch, offset = divmod(start, self.epoch_length)
            order, ends = self._epoch(epoch)
            k = int(np.searchsorted(ends, offset, side="right"))
            chunk = int(order[k])
            take = min(count, int(ends[k]) - offset)
            yield chunk, offset - (int(ends[k]) - int(self._chunk_sequences[chunk])), take, epoch
            start, count = start + take, count - take

    def _chunk_rows(self, chunk: int) -> tuple[ShardInfo, int, int]:
        info = self.shards[self._chunk_shard[chunk]]
        first = int(self._chunk_first[chunk])
        return info, first, min(first + self.chunk_rows, info.rows)

    def sources(self, start: int, count: int) -> np.ndarray:
        """[count, 2]: the (shard index, row) of each of sequences [start, start + count), without reading data."""
        parts = []
        for chunk, offset, take, _ in self.pieces(start, count):
            info, first, stop = self._chunk_rows(chunk)
            rows = np.arange(first, stop)
            if info.packed:
                rows = np.repeat(rows, info.sequences_per_row[first:stop])
            parts.append(np.stack([np.full(take, self._chunk_shard[chunk]), rows[offset:offset + take]], 1))
        return np.concatenate(parts)

    def _datasets(self, shard: int) -> dict[str, h5py.Dataset]:
        if self._pid != os.getpid():  # a forked loader worker: the parent's HDF5 handles are not ours to use
            self._files, self._chunks, self._pid = {}, {}, os.getpid()
        if shard not in self._files:
            # A small chunk cache per dataset: the chunks read are used once (the narrow datasets' a few times).
            handle = h5py.File(self.shards[shard].path, "r", rdcc_nbytes=1 << 18)
            self._files[shard] = handle, datasets(handle, self.shards[shard])
            while len(self._files) > self._open_files:
                self._files.pop(next(iter(self._files)))[0].close()
        return self._files[shard][1]

    def _load(self, chunk: int) -> dict:
        if chunk not in self._chunks:
            _, first, stop = self._chunk_rows(chunk)
            self._chunks[chunk] = read_rows(self._datasets(int(self._chunk_shard[chunk])), first, stop)
            while len(self._chunks) > self._cached_chunks:
                self._chunks.pop(next(iter(self._chunks)))
        return self._chunks[chunk]

    def _rows(self, chunk: int, offset: int, count: int) -> tuple[int, int, np.ndarray]:
        """(first, stop, live) of sequences [offset, offset + count) of a chunk, without reading data: the chunk's rows
        [first, stop) holding them and which of each row's sequences they are ([rows, S] packed, [rows] unpacked)."""
        info, first, stop = self._chunk_rows(chunk)
        if not info.packed:
            return offset, offset + count, np.ones(count, bool)
        per_row = info.sequences_per_row[first:stop].astype(np.int64)
        ends = np.cumsum(per_row)
        a, b = np.searchsorted(ends, [offset, offset + count - 1], side="right")
        # Index (within the chunk) of each slot's sequence; live if it falls in the range.
        slot = np.arange(info.slots)
        index = (ends[a:b + 1] - per_row[a:b + 1])[:, None] + slot
        return a, b + 1, (index >= offset) & (index < offset + count) & (slot < per_row[a:b + 1, None])

    def _step_rows(self, start: int, count: int) -> list[tuple]:
        """(chunk, first, stop, live, epoch) of every chunk holding sequences [start, start + count), in order."""
        return [(chunk, *self._rows(chunk, offset, take), epoch)
                for chunk, offset, take, epoch in self.pieces(start, count)]

    def _part(self, chunk: int, a: int, b: int, epoch: int) -> dict[str, np.ndarray]:
        """Rows [a, b) of a chunk; with dynamic masking, masked for `epoch` (each sequence by its own key)."""
        rows = {name: values[a:b] for name, values in self._load(chunk).items()}
        if self._masker is None:
            return rows
        return self._masker(rows, epoch, int(self._chunk_shard[chunk]), int(self._chunk_first[chunk]) + np.arange(a, b))

    def _arrays(self, rows: list[tuple]) -> dict[str, np.ndarray]:
        """The data of `rows` ((chunk, first, stop, live, epoch) as _step_rows gives), concatenated; live as "live"."""
        parts = [{**self._part(chunk, a, b, epoch), "live": live} for chunk, a, b, live, epoch in rows]
        return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}

    def read(self, start: int, count: int) -> dict[str, torch.Tensor]:
        """Sequences [start, start + count) of the global order as one batch."""
        arrays = self._arrays(self._step_rows(start, count))
        return make_batch(arrays, slice(None), arrays.pop("live"), self.shards[0].pad_id)

    def micro_batches(self, start: int, count: int, rank: int, world: int, rows: int) -> list[dict]:
        """Rank `rank`'s share of the step of sequences [start, start + count) as micro-batches of exactly `rows` rows:
        the step's rows (a straddling row on both sides, as in `read`) split into `world` contiguous parts, the last
        micro-batch filled up with empty rows, which carry no label. Every rank runs as many micro-batches as the one
        with the most rows (a part of ceil(total / world) rows): a rank with fewer ends with all-padding ones (no label:
        the step's loss is unchanged), so every rank does the same work per step. Only this rank's rows are read."""
        step = self._step_rows(start, count)
        total = sum(b - a for _, a, b, _, _ in step)
        largest_part = -(-total // world)  # rows (ceiling divisions)
        micro_batches = max(1, -(-largest_part // rows))
        low, high, seen, mine = total * rank // world, total * (rank + 1) // world, 0, []
        for chunk, a, b, live, epoch in step:
            first, stop = max(a, a + low - seen), min(b, a + high - seen)
            if first < stop or not mine and seen + b - a >= high:  # (an empty part keeps the shapes)
                mine.append((chunk, first, max(first, stop), live[first - a:max(first, stop) - a], epoch))
            seen += b - a
        arrays = self._arrays(mine)
        pad_id = self.shards[0].pad_id
        return [make_batch(*padded({name: values[k:k + rows] for name, values in arrays.items()}, rows, pad_id), pad_id)
                for k in range(0, micro_batches * rows, rows)]

    def close(self) -> None:
        if self._pid == os.getpid():
            for handle, _ in self._files.values():
                handle.close()
        self._files, self._chunks = {}, {}

