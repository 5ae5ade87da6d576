"""The HDF5 shard files of the encode stage: dataset names of both layouts, the writer, the reader of an encoded shard.

Layouts: NVIDIA's schema (`ENCODED`, one instance per row; workflow.data.encode) and the packed one (`PACKED`,
several instances per row; workflow.data.pack). Chunks hold whole rows, gzip level 1 with byte shuffle.

API:
    write_shard(output, attributes, {name: (shape, dtype)}, batches, compression)   atomically, row block by block
    read_encoded(path) -> (arrays, attributes)   an encoded (NVIDIA-schema) shard, validated (with its TABLES)
    pad_attributes(pad_id) -> dict, pad_id_of(attributes) -> int   the padding id a shard's input_ids hold
"""
import os

import h5py
import numpy as np

from workflow.atomic import atomic_path
from workflow.cli import UserError

ENCODED = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids", "next_sentence_labels")
PACKED = ("input_ids", "segment_ids", "input_mask", "position_ids", "cls_positions", "sequence_lengths",
          "next_sentence_labels", "instance_index", "masked_lm_positions", "masked_lm_ids")  # the order files get them
TABLES = ("continues_word",)  # whole datasets beside the rows (a dynamic-masking file's vocab table)
# Version of the packed layout, root attribute `packed_version` of every packed shard (absent = 1). Version 1 packed
# each full-sentences instance within a document one token too long, the row's padding: a [PAD] inside every such
# sequence; the trainer refuses those shards (workflow.train.pretraining_data) and the DAG rebuilds them.
PACKED_VERSION = 2
PAD_ID = "pad_id"  # root attribute: the id input_ids are padded with, where it is not 0 (absent = 0, BERT's [PAD])
CHUNK_ROWS = 64  # HDF5 chunk = 64 whole rows: a random row read decompresses little (see benchmarks/)
CHUNK_WIDTH = 128  # narrower datasets (predictions, per-pack slots, labels) get proportionally more rows per chunk


def pad_attributes(pad_id: int) -> dict:
    """The root attributes that record padding id `pad_id`: none for 0 (NVIDIA's and BERT's files keep their bytes),
    else PAD_ID (a tokenizer.json whose id 0 is text, e.g. a GPT-2-style BPE's "!")."""
    return {PAD_ID: int(pad_id)} if pad_id else {}


def pad_id_of(attributes) -> int:
    """The padding id of a shard with root `attributes` (pad_attributes's)."""
    return int(attributes.get(PAD_ID, 0))


def write_shard(output, attributes: dict, shapes: dict, batches, compression: str,
                tables: dict[str, np.ndarray] | None = None) -> None:
    """HDF5 file `output` (atomically) with the datasets `shapes` {name: (shape, dtype)}, filled row-block by
    row-block from `batches` (dicts of arrays, in row order), root attributes `attributes`, and whole `tables`
    (datasets that are not rows, e.g. a dynamic file's vocab table)."""
    try:
        with atomic_path(output) as temporary:
            # NVIDIA's layout stays readable by the oldest HDF5 (DLE's); a file with tables (dynamic masking, which
            # DLE cannot train on anyway) uses HDF5 1.10's chunk indexes: ~25 KB less per file, most of a small one.
            with h5py.File(temporary, "w", libver=("v110", "v110") if tables else "earliest") as handle:
                handle.attrs.update(attributes)
                datasets = {
                    name: handle.create_dataset(name, shape, dtype, track_times=False, **_layout(shape, compression))
                    for name, (shape, dtype) in shapes.items()
                }
                for name, table in (tables or {}).items():
                    handle.create_dataset(name, data=table, track_times=False)
                start = 0
                for arrays in batches:
                    rows = 0
                    for name, array in arrays.items():
                        datasets[name][start : start + len(array)] = array
                        rows = len(array)
                    start += rows
    except OSError as error:
        raise UserError(f"{output}: cannot write ({error.strerror or error})") from None


def _layout(shape: tuple[int, ...], compression: str) -> dict:
    """Row-shaped chunks of CHUNK_ROWS whole rows, or more for narrow datasets (at least CHUNK_ROWS x CHUNK_WIDTH
    cells: a chunk of a few hundred bytes costs more in overhead than in compression), so a random row read
    decompresses one small chunk; gzip level 1 with byte shuffle (the zero high bytes of int32 ids then cost
    nothing). Not lzf: its output bytes vary from run to run for the same data, which would break byte-identical
    outputs."""
    if compression == "none" or shape[0] == 0:
        return {}
    rows = CHUNK_ROWS * max(1, CHUNK_WIDTH // int(np.prod(shape[1:])))
    return {"chunks": (min(rows, shape[0]),) + shape[1:], "compression": "gzip", "compression_opts": 1, "shuffle": True}


def read_encoded(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays, root attributes) of an encoded shard."""
    try:
        with h5py.File(path, "r") as handle:
            missing = [name for name in ENCODED if name not in handle]
            if missing:
                raise UserError(f"{path}: missing dataset(s) {', '.join(missing)}; not an encoded shard")
            if "position_ids" in handle:
                raise UserError(f"{path}: already packed")
            arrays = {name: handle[name][()] for name in ENCODED + TABLES if name in handle}
            attributes = dict(handle.attrs)
    except FileNotFoundError:
        raise UserError(f"{path}: encoded shard not found") from None
    except OSError as error:
        raise UserError(f"{path}: not a readable HDF5 file ({error})") from None
    n = arrays["input_ids"].shape[0]
    for name, array in arrays.items():
        if name in TABLES:
            continue
        if array.shape[0] != n or array.ndim != (1 if name == "next_sentence_labels" else 2):
            raise UserError(f"{path}: dataset {name} has shape {array.shape}, inconsistent with input_ids {(n,)}")
    return arrays, attributes
