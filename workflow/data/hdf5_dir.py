"""Stage hdf5_dir: the directory a trainer reads for one sequence length, data/hdf5_seq{L}.

It holds training/ and test/ with every encoded shard hard-linked (copied where links are impossible) from
data/encoded_seq{L}, and manifest.json: the shard list with instance counts (and rows: a phase given in tokens
divides by them, workflow.train.pretraining_data.row_tokens_per_sequence), sizes and sha256 checksums,
the encode settings used (read from the shards' own attributes, which must agree), and `format`: "packed"
(workflow.data.pack's schema; settings then include `packing` and `max_sequences_per_pack`, `auto` as its slot
count) or "unpacked" (NVIDIA's schema, one instance per row). Settings also name `masking`, `objective` and
`masking_rule` where the shards are not of NVIDIA's recipe (static, nsp, google), and `eval_masked_lm_prob` where the
test split is masked at another probability than masked_lm_prob.

File names follow NVIDIA DLE's bertPrep.py (`wikicorpus_en_training_0.hdf5`, `wikicorpus_en_test_0.hdf5`):
its run_pretraining.py keeps only the files of `--input_dir` whose name contains "training", so
`--input_dir data/hdf5_seq128/training` finds every training shard, and no test shard could ever be taken.
"""
import argparse
import hashlib
import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import h5py

from workflow.atomic import atomic_path, write_json
from workflow.cli import UserError, run

log = logging.getLogger(__name__)

SETTINGS = (
    "max_seq_length",
    "max_predictions_per_seq",
    "dupe_factor",
    "masked_lm_prob",
    "short_seq_prob",
    "whole_word_masking",
    "seed",
    "vocab_sha256",
)
PACKING = ("packing", "max_sequences_per_pack")  # attributes of packed shards only
RECIPE = ("masking", "objective", "masking_rule", "eval_masked_lm_prob")  # attributes off NVIDIA's recipe only


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def shard_info(path: Path) -> dict:
    """Instance count and encode settings of one encoded shard (its HDF5 root attributes)."""
    try:
        with h5py.File(path, "r") as handle:
            attributes = dict(handle.attrs)
            n_rows = int(handle["input_ids"].shape[0])
    except FileNotFoundError:
        raise UserError(f"{path}: encoded shard not found") from None
    except (OSError, KeyError) as error:
        raise UserError(f"{path}: not an encoded shard ({error})") from None
    missing = [key for key in SETTINGS if key not in attributes]
    if missing:
        raise UserError(f"{path}: lacks the attribute(s) {', '.join(missing)}; re-run the encode stage")
    packed = "packing" in attributes
    settings = {key: _plain(attributes[key]) for key in SETTINGS + (PACKING if packed else ())}
    settings.update({key: _plain(attributes[key]) for key in RECIPE if key in attributes})
    n_instances = int(attributes["n_instances"]) if packed else n_rows
    return {"n_instances": n_instances, "n_rows": n_rows, "settings": settings,
            "format": "packed" if packed else "unpacked"}


def _plain(value):
    """numpy scalars -> JSON-able Python values."""
    return value.item() if hasattr(value, "item") else value


def trainer_name(seq_length: int, split: str, index: int) -> str:
    """Path of shard `index` of `split` inside data/hdf5_seq{L}: only training shards have "training" in the name."""
    return f"{split}/seq{seq_length}_{split}_shard_{index}.hdf5"


def link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def build_hdf5_dir(encoded: str | os.PathLike, n_shards: dict[str, int], output: str | os.PathLike, threads: int = 1) -> dict:
    """Assemble `output` from `encoded`/{split}/shard_{i}.hdf5, i < n_shards[split], under trainer_name()s;
    returns the manifest."""
    encoded, output = Path(encoded), Path(output)
    shards = [(split, index) for split, count in n_shards.items() for index in range(count)]
    names = [f"{split}/shard_{index}.hdf5" for split, index in shards]
    infos = [shard_info(encoded / name) for name in names]
    reference = infos[0]["settings"] if infos else {}
    for name, info in zip(names, infos):
        if info["format"] != infos[0]["format"]:
            raise UserError(f"{encoded / name}: {info['format']}, but {names[0]} is {infos[0]['format']}; "
                            f"re-run the encode stage")
        if info["settings"] != reference:
            changed = sorted(key for key in info["settings"] if info["settings"][key] != reference[key])
            raise UserError(f"{encoded / name}: encoded with other settings ({', '.join(changed)}) than {names[0]}")
    targets = [trainer_name(reference["max_seq_length"], split, index) for split, index in shards]
    with ThreadPoolExecutor(max(1, threads)) as pool:  # hashlib releases the GIL
        checksums = list(pool.map(sha256, (encoded / name for name in names)))
    manifest = {
        "format": infos[0]["format"] if infos else "unpacked",
        "settings": reference,
        "n_instances": {split: sum(i["n_instances"] for n, i in zip(names, infos) if n.startswith(f"{split}/")) for split in n_shards},
        "shards": [
            {"path": target, "n_instances": info["n_instances"], "n_rows": info["n_rows"], "bytes": (encoded / name).stat().st_size, "sha256": checksum}
            for name, target, info, checksum in zip(names, targets, infos, checksums)
        ],
    }
    try:
        with atomic_path(output) as temporary:
            for split in n_shards:
                (temporary / split).mkdir(parents=True)
            for name, target in zip(names, targets):
                link_or_copy(encoded / name, temporary / target)
            write_json(temporary / "manifest.json", manifest)
    except OSError as error:
        raise UserError(f"{output}: cannot write ({error.strerror or error})") from None
    log.info("%s: %d shards, %s instances", output, len(names), manifest["n_instances"])
    return manifest


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encoded", required=True, help="data/encoded_seq{L}: {training,test}/shard_{i}.hdf5")
    parser.add_argument("--n-training-shards", type=int, required=True)
    parser.add_argument("--n-test-shards", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1, help="checksum threads")
    parser.add_argument("--output", required=True, help="directory to create")
    args = parser.parse_args(argv)
    n_shards = {"training": args.n_training_shards, "test": args.n_test_shards}
    build_hdf5_dir(args.encoded, n_shards, args.output, args.threads)


if __name__ == "__main__":
    run(main)
