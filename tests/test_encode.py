"""Stages 7-8: masked-LM/NSP instances with Google/NVIDIA semantics in NVIDIA's HDF5 schema, deterministic
whatever the parallelism, the data/hdf5_seq{L} directory and its manifest, clear errors."""
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from benchmarks import google_reference
from workflow.data.encode import (EncodeSettings, Vocab, _truncate_pair, build_batch, encode_shard, plan_instances,
                                  ragged_instances, shard_rng)
from workflow.data.masking_rule import MASKING_RULES, MASKINGS, OBJECTIVES, derived_max_predictions
from workflow.cli import UserError
from workflow.data.hdf5_dir import build_hdf5_dir
from workflow.data.pack import PackSettings, check_packed, pack_arrays
from workflow.data.tokenize import load_tokenized, tokenize_shard
from workflow.data.vocab import read_vocab, special_token_ids, train_vocab
from workflow.train.masking import LoadTimeMasker
from workflow.train.pretraining_data import list_shards

REPO = Path(__file__).resolve().parents[1]
SCHEMA = {
    "input_ids": (np.int32, "L"),
    "input_mask": (np.int8, "L"),
    "segment_ids": (np.int8, "L"),
    "masked_lm_positions": (np.int32, "P"),
    "masked_lm_ids": (np.int32, "P"),
    "next_sentence_labels": (np.int8, None),
}
NOUNS = "river castle engine village council railway album treaty island museum composer bridge harbour".split()
VERBS = "built crossed recorded signed governed painted restored founded visited described opened".split()
OTHER = "the a of in on with and during after before near its their ancient northern famous unbelievably".split()


def corpus_text(n_documents: int, seed: int) -> str:
    """Shard-format text: documents of 1-30 sentences of 2-60 words (a few very long), blank line between."""
    rng = random.Random(seed)
    documents = []
    for _ in range(n_documents):
        sentences = []
        for _ in range(rng.choice([1, 2, 3]) if rng.random() < 0.15 else rng.randint(4, 30)):
            n_words = rng.randint(150, 250) if rng.random() < 0.02 else rng.randint(2, 60)
            words = [rng.choice(NOUNS + VERBS + OTHER * 2) for _ in range(n_words)]
            sentences.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ", indeed."]))
        documents.append("\n".join(sentences))
    return "\n\n".join(documents) + "\n"


def tokenized_shard(directory, n_documents, vocab_size, seed):
    """A vocab trained on a generated shard, and that shard tokenized: (vocab path, tokenized path, Vocab)."""
    text = directory / "shard_0.txt"
    text.write_text(corpus_text(n_documents, seed=seed), encoding="utf-8")
    train_vocab([text], directory / "vocab.txt", size=vocab_size, lowercase=True)
    tokenize_shard(text, directory / "vocab.txt", directory / "shard_0.npz")
    return directory / "vocab.txt", directory / "shard_0.npz", Vocab.read(directory / "vocab.txt")


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """A trained vocab and one tokenized shard: (vocab path, tokenized path, Vocab)."""
    return tokenized_shard(tmp_path_factory.mktemp("encode"), n_documents=300, vocab_size=300, seed=1)


def build(shard, settings: EncodeSettings, seed: int = 7):
    """(plan, arrays, flat ids, document offsets in tokens) of a whole shard, built in memory."""
    _, tokenized, vocab = shard
    ids, sentence_offsets, document_offsets = load_tokenized(tokenized)
    plan_rng, mask_rng = shard_rng(seed, "training", 0)
    plan = plan_instances(sentence_offsets, document_offsets, settings, plan_rng)
    arrays = build_batch(np.append(ids, 0).astype(ids.dtype), plan, settings, vocab, mask_rng)
    return plan, arrays, ids, sentence_offsets[document_offsets]


def originals(arrays) -> np.ndarray:
    """input_ids with the masked positions restored from masked_lm_ids."""
    restored = arrays["input_ids"].copy()
    rows, slots = np.nonzero(arrays["masked_lm_positions"])
    restored[rows, arrays["masked_lm_positions"][rows, slots]] = arrays["masked_lm_ids"][rows, slots]
    return restored


@pytest.mark.parametrize("length,predictions", [(128, 20), (32, 5)])
def test_instances_are_cls_a_sep_b_sep_from_the_shard_tokens(shard, length, predictions):
    settings = EncodeSettings(max_seq_length=length, max_predictions_per_seq=predictions)
    plan, arrays, ids, document_starts = build(shard, settings)
    vocab = shard[2]
    restored = originals(arrays)
    n_tokens = arrays["input_mask"].sum(axis=1)
    assert (n_tokens <= length).all() and n_tokens.max() == length
    for row, (a_start, a_end, b_start, b_end, is_random) in enumerate(plan):
        n, len_a = n_tokens[row], a_end - a_start
        assert (arrays["input_mask"][row, :n] == 1).all() and (arrays["input_mask"][row, n:] == 0).all()
        expected = np.concatenate([[vocab.cls], ids[a_start:a_end], [vocab.sep], ids[b_start:b_end], [vocab.sep]])
        assert np.array_equal(restored[row, :n], expected)
        assert (arrays["input_ids"][row, n:] == 0).all()
        segments = arrays["segment_ids"][row]
        assert (segments[: len_a + 2] == 0).all() and (segments[len_a + 2 : n] == 1).all() and (segments[n:] == 0).all()
        assert len_a >= 1 and b_end - b_start >= 1
        doc_a = np.searchsorted(document_starts, a_start, side="right")
        doc_b = np.searchsorted(document_starts, b_start, side="right")
        assert np.searchsorted(document_starts, a_end - 1, side="right") == doc_a  # A within one document
        assert np.searchsorted(document_starts, b_end - 1, side="right") == doc_b
        if is_random:
            assert doc_b != doc_a  # B from another document
        else:
            assert doc_b == doc_a and b_start >= a_end  # B is A's continuation
    assert np.array_equal(arrays["next_sentence_labels"], plan[:, 4])


def test_masking_rate_and_80_10_10_split_and_positions(shard):
    settings = EncodeSettings(max_seq_length=64, max_predictions_per_seq=10, dupe_factor=10)
    plan, arrays, ids, _ = build(shard, settings)
    vocab = shard[2]
    positions, masked_ids = arrays["masked_lm_positions"], arrays["masked_lm_ids"]
    n_tokens = arrays["input_mask"].sum(axis=1)
    valid = positions > 0
    expected = np.minimum(10, np.maximum(1, np.rint(n_tokens * 0.15)))
    assert np.array_equal(valid.sum(axis=1), expected)  # Google's count: round(15% of tokens), capped
    assert abs(valid.sum() / n_tokens.sum() - 0.15) < 0.01
    # Valid positions ascending, then zero padding; never [CLS], [SEP] or padding.
    assert (np.diff(valid.astype(int), axis=1) <= 0).all()
    assert (np.diff(positions, axis=1)[valid[:, 1:]] > 0).all()
    assert (masked_ids[~valid] == 0).all()
    rows = np.nonzero(valid)[0]
    at = positions[valid]
    restored = originals(arrays)
    assert (at < n_tokens[rows]).all() and (at > 0).all()
    assert not np.isin(restored[rows, at], [vocab.cls, vocab.sep]).any()
    assert np.array_equal(restored[rows, at], masked_ids[valid])  # labels are the original tokens
    # 80% [MASK], 10% random, 10% unchanged (a random token equal to the original counts as unchanged).
    now = arrays["input_ids"][rows, at]
    n = len(at)
    share_mask = (now == vocab.mask).mean()
    share_same = (now == masked_ids[valid]).mean()
    sigma = np.sqrt(0.1 * 0.9 / n)
    assert n > 20_000
    assert abs(share_mask - 0.8) < 4 * np.sqrt(0.8 * 0.2 / n)
    assert abs(share_same - (0.1 + 0.1 / vocab.size)) < 4 * sigma
    assert abs(1 - share_mask - share_same - 0.1) < 4 * sigma


def test_next_sentence_labels_are_about_half_random(shard):
    # Documents of many short sentences: every chunk has >= 2 sentences, so B is random exactly half the time.
    sentence_offsets = np.arange(0, 400 * 60 * 10 + 1, 10)
    document_offsets = np.arange(0, 400 * 60 + 1, 60)
    settings = EncodeSettings(max_seq_length=128, max_predictions_per_seq=20, short_seq_prob=0.0)
    labels = plan_instances(sentence_offsets, document_offsets, settings, shard_rng(1, "test", 0)[0])[:, 4]
    assert len(labels) > 10_000
    assert abs(labels.mean() - 0.5) < 4 * np.sqrt(0.25 / len(labels)) + 0.01, labels.mean()
    # On the varied shard, Google's rule (a one-sentence chunk always takes a random B) adds a little.
    _, arrays, _, _ = build(shard, EncodeSettings(max_seq_length=128, max_predictions_per_seq=20, dupe_factor=10))
    assert 0.48 < arrays["next_sentence_labels"].mean() < 0.62


def test_short_seq_prob_makes_some_instances_short(shard):
    settings = EncodeSettings(max_seq_length=128, max_predictions_per_seq=20, short_seq_prob=0.0)
    _, full, _, _ = build(shard, settings)
    _, mixed, _, _ = build(shard, EncodeSettings(max_seq_length=128, max_predictions_per_seq=20, short_seq_prob=0.5))
    assert mixed["input_mask"].sum(axis=1).mean() < 0.9 * full["input_mask"].sum(axis=1).mean()
    assert len(mixed["input_mask"]) > 1.2 * len(full["input_mask"])  # the same text cut into more instances


@pytest.fixture(scope="module")
def split_shard(tmp_path_factory):
    """A shard tokenized with a tiny vocab, so most words are several WordPieces."""
    return tokenized_shard(tmp_path_factory.mktemp("split"), n_documents=60, vocab_size=100, seed=2)


def test_whole_word_masking_masks_every_piece_of_a_word(split_shard):
    vocab = split_shard[2]
    settings = EncodeSettings(max_seq_length=64, max_predictions_per_seq=10, whole_word_masking=True)
    plan, arrays, _, _ = build(split_shard, settings)
    restored = originals(arrays)
    continues = vocab.continues_word[restored] & (arrays["input_mask"] == 1)
    assert continues.sum() > 1000  # the small vocab splits many words
    masked = np.zeros_like(restored, dtype=bool)
    rows, slots = np.nonzero(arrays["masked_lm_positions"])
    masked[rows, arrays["masked_lm_positions"][rows, slots]] = True
    n_tokens = arrays["input_mask"].sum(axis=1)
    limit = np.minimum(10, np.maximum(1, np.rint(n_tokens * 0.15)))
    assert (masked.sum(axis=1) <= limit).all() and masked.sum() > 0.9 * limit.sum()
    special = np.isin(restored, [vocab.cls, vocab.sep])
    # A continuation piece is masked exactly when the piece before it is (unless [SEP] separates them).
    inner = continues[:, 1:] & ~special[:, :-1]
    assert np.array_equal(masked[:, 1:][inner], masked[:, :-1][inner])


@pytest.fixture(scope="module")
def encoded(shard, tmp_path_factory):
    directory = tmp_path_factory.mktemp("encoded")
    vocab, tokenized, _ = shard
    settings = EncodeSettings(max_seq_length=128, max_predictions_per_seq=20)
    encode_shard(tokenized, vocab, directory / "a.hdf5", settings, seed=12345, split="training", shard_index=0)
    return directory, settings


def test_hdf5_file_has_nvidia_schema_and_settings(encoded):
    directory, settings = encoded
    with h5py.File(directory / "a.hdf5", "r") as handle:
        assert set(handle) == set(SCHEMA)
        n = handle["next_sentence_labels"].shape[0]
        assert n > 1000
        for name, (dtype, width) in SCHEMA.items():
            dataset = handle[name]
            assert dataset.dtype == dtype, name
            shape = (n,) if width is None else (n, {"L": 128, "P": 20}[width])
            assert dataset.shape == shape, name
            if width:
                assert dataset.chunks[1] == shape[1]  # row-shaped chunks: a row read touches one chunk
        assert handle.attrs["max_seq_length"] == 128 and handle.attrs["n_instances"] == n
        assert handle.attrs["seed"] == 12345 and handle.attrs["split"] == "training"
        ids = handle["input_ids"][:]
        assert (ids[:, 0] == ids[0, 0]).all()  # [CLS] first


def test_same_seed_same_bytes_other_seed_or_shard_differs(shard, encoded):
    directory, settings = encoded
    vocab, tokenized, _ = shard
    encode_shard(tokenized, vocab, directory / "b.hdf5", settings, seed=12345, split="training", shard_index=0)
    encode_shard(tokenized, vocab, directory / "c.hdf5", settings, seed=54321, split="training", shard_index=0)
    encode_shard(tokenized, vocab, directory / "d.hdf5", settings, seed=12345, split="test", shard_index=0)
    digest = {name: hashlib.sha256((directory / f"{name}.hdf5").read_bytes()).hexdigest() for name in "abcd"}
    assert digest["a"] == digest["b"]
    assert len({digest["a"], digest["c"], digest["d"]}) == 3


def test_hdf5_dir_links_shards_and_writes_manifest(shard, encoded, tmp_path):
    directory, settings = encoded
    source = tmp_path / "encoded_seq128"
    for split in ("training", "test"):
        (source / split).mkdir(parents=True)
        shutil.copyfile(directory / "a.hdf5", source / split / "shard_0.hdf5")
    manifest = build_hdf5_dir(source, {"training": 1, "test": 1}, tmp_path / "hdf5_seq128")
    written = json.loads((tmp_path / "hdf5_seq128" / "manifest.json").read_text())
    assert written == manifest
    n = h5py.File(directory / "a.hdf5", "r")["input_ids"].shape[0]
    assert manifest["n_instances"] == {"training": n, "test": n}
    assert manifest["settings"]["max_seq_length"] == 128 and manifest["settings"]["seed"] == 12345
    assert [entry["path"] for entry in manifest["shards"]] == ["training/seq128_training_shard_0.hdf5",
                                                              "test/seq128_test_shard_0.hdf5"]
    for entry, split in zip(manifest["shards"], ("training", "test")):
        linked = tmp_path / "hdf5_seq128" / entry["path"]
        assert os.path.samefile(linked, source / split / "shard_0.hdf5")  # hard link, no copy
        assert hashlib.sha256(linked.read_bytes()).hexdigest() == entry["sha256"]
    # A stale shard encoded with other settings is refused, and nothing is promoted.
    vocab, tokenized, _ = shard
    stale = source / "test" / "shard_0.hdf5"
    encode_shard(tokenized, vocab, stale, settings, seed=99, split="test", shard_index=0)
    with pytest.raises(UserError, match=r"shard_0.hdf5: encoded with other settings \(seed\) than training/shard_0"):
        build_hdf5_dir(source, {"training": 1, "test": 1}, tmp_path / "again")
    assert not (tmp_path / "again").exists()


def read_all(path) -> tuple[dict, dict]:
    with h5py.File(path, "r") as handle:
        return {name: handle[name][()] for name in handle}, dict(handle.attrs)


def test_packed_encode_writes_the_packs_of_its_own_instances_and_says_so(shard, encoded, tmp_path):
    directory, settings = encoded
    vocab, tokenized, _ = shard
    packing = PackSettings(max_sequences_per_pack=3, algorithm="gapfill")
    encode_shard(tokenized, vocab, tmp_path / "p.hdf5", settings, seed=12345, split="training", shard_index=0,
                 packing=packing)
    unpacked, unpacked_attributes = read_all(directory / "a.hdf5")
    packed, attributes = read_all(tmp_path / "p.hdf5")
    expected = pack_arrays(unpacked, 3, settings.masked_lm_prob, "gapfill")
    assert sorted(packed) == sorted(expected)
    for name in expected:
        np.testing.assert_array_equal(packed[name], expected[name], err_msg=name)
    assert attributes["packing"] == "gapfill" and attributes["max_sequences_per_pack"] == 3
    assert attributes["n_instances"] == unpacked_attributes["n_instances"] == len(unpacked["input_ids"])
    assert attributes["n_packs"] == len(packed["input_ids"]) < len(unpacked["input_ids"])
    assert attributes["fill"] == unpacked["input_mask"].sum() / packed["input_ids"].size
    # The manifest says which format a directory holds and counts instances, not rows.
    source = tmp_path / "encoded"
    for split in ("training", "test"):
        (source / split).mkdir(parents=True)
        shutil.copyfile(tmp_path / "p.hdf5", source / split / "shard_0.hdf5")
    manifest = build_hdf5_dir(source, {"training": 1, "test": 1}, tmp_path / "hdf5")
    assert manifest["format"] == "packed" and manifest["settings"]["max_sequences_per_pack"] == 3
    assert manifest["n_instances"]["training"] == len(unpacked["input_ids"])
    assert manifest["shards"][0]["n_rows"] == len(packed["input_ids"])
    # An unpacked shard beside packed ones is refused.
    shutil.copyfile(directory / "a.hdf5", source / "test" / "shard_0.hdf5")
    with pytest.raises(UserError, match=r"test/shard_0.hdf5: unpacked, but training/shard_0.hdf5 is packed"):
        build_hdf5_dir(source, {"training": 1, "test": 1}, tmp_path / "again")


@pytest.mark.parametrize("max_sequences_per_pack, algorithm", [(1, "lpfhp"), (5, "spfhp")])
def test_packed_encode_with_any_cap_and_algorithm_writes_the_packs_of_its_unpacked_file(shard, encoded, tmp_path,
                                                                                        max_sequences_per_pack,
                                                                                        algorithm):
    directory, settings = encoded
    vocab, tokenized, _ = shard
    encode_shard(tokenized, vocab, tmp_path / "p.hdf5", settings, seed=12345, split="training", shard_index=0,
                 packing=PackSettings(max_sequences_per_pack, algorithm))
    unpacked, _ = read_all(directory / "a.hdf5")
    packed, _ = read_all(tmp_path / "p.hdf5")
    expected = pack_arrays(unpacked, max_sequences_per_pack, settings.masked_lm_prob, algorithm)
    assert sorted(packed) == sorted(expected)
    for name in expected:
        np.testing.assert_array_equal(packed[name], expected[name], err_msg=name)
    held = (packed["instance_index"] >= 0).sum(axis=1)
    assert held.max() <= max_sequences_per_pack and (held.max() > 1) == (max_sequences_per_pack > 1)


def test_packing_off_on_the_command_line_writes_the_library_default_nvidia_file_byte_for_byte(shard, encoded,
                                                                                              tmp_path):
    directory, settings = encoded
    vocab, tokenized, _ = shard
    common = ("--tokenized", tokenized, "--vocab", vocab, "--max-seq-length", 128, "--max-predictions-per-seq", 20,
              "--split", "training", "--shard-index", 0, "--seed", 12345)
    result = run_stage("workflow.data.encode", *common, "--output", tmp_path / "off.hdf5", "--no-packing")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "off.hdf5").read_bytes() == (directory / "a.hdf5").read_bytes()
    result = run_stage("workflow.data.encode", *common, "--output", tmp_path / "on.hdf5")
    assert result.returncode == 0, result.stderr
    assert read_all(tmp_path / "on.hdf5")[1]["packing"] == "gapfill"  # the command line packs by default


def nvidia_training_files(input_dir: str) -> list[str]:
    """NVIDIA DLE run_pretraining.py's file list, verbatim: the files of --input_dir whose name contains 'training'."""
    return [os.path.join(input_dir, f) for f in os.listdir(input_dir) if
            os.path.isfile(os.path.join(input_dir, f)) and 'training' in f]


def test_nvidia_trainer_file_filter_finds_exactly_the_training_shards(shard, encoded, tmp_path):
    directory, _ = encoded
    source = tmp_path / "encoded_seq128"
    counts = {"training": 12, "test": 3}
    for split, count in counts.items():
        (source / split).mkdir(parents=True)
        for index in range(count):
            os.link(directory / "a.hdf5", source / split / f"shard_{index}.hdf5")
    output = tmp_path / "hdf5_seq128"
    manifest = build_hdf5_dir(source, counts, output)
    on_disk = {split: sorted(p.relative_to(output).as_posix() for p in (output / split).iterdir()) for split in counts}
    listed = {split: sorted(e["path"] for e in manifest["shards"] if e["path"].startswith(f"{split}/")) for split in counts}
    assert on_disk == listed and [len(listed[s]) for s in counts] == [12, 3]
    # The directory a user passes as --input_dir: every training shard, nothing else.
    found = nvidia_training_files(str(output / "training"))
    assert sorted(os.path.relpath(f, output) for f in found) == listed["training"]
    # No test shard passes the filter, wherever it is pointed; nor does the manifest.
    assert nvidia_training_files(str(output / "test")) == [] and nvidia_training_files(str(output)) == []
    # Our trainer reads the same shards, in the same order as before the rename (sorted by name).
    ours = list_shards(output, "training")
    assert [Path(s.path).name for s in ours] == sorted(Path(f).name for f in found)
    assert [Path(s.path).name for s in ours][:3] == [f"seq128_training_shard_{i}.hdf5" for i in (0, 1, 10)]
    assert len(list_shards(output, "test")) == 3


def run_stage(module, *args, cwd=None):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd)


def test_vocab_without_mask_is_a_one_line_error(shard, tmp_path):
    vocab, tokenized, _ = shard
    bad = tmp_path / "vocab.txt"
    bad.write_text("".join(t + "\n" for t in vocab.read_text().split("\n") if t and t != "[MASK]"))
    output = tmp_path / "out.hdf5"
    result = run_stage("workflow.data.encode", "--tokenized", tokenized, "--vocab", bad, "--output", output,
                       "--max-seq-length", 128, "--max-predictions-per-seq", 20, "--split", "training",
                       "--shard-index", 0)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == f"error: {bad}: vocab lacks the special token(s) [MASK]"
    assert not output.exists()


def unwritable_dirs(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    yield blocker / "sub"  # a parent that is a file: fails even for root
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        yield locked


def test_unwritable_output_dir_is_a_clear_error_and_nothing_is_promoted(shard, tmp_path):
    vocab, tokenized, _ = shard
    for directory in unwritable_dirs(tmp_path):
        output = directory / "shard_0.hdf5"
        result = run_stage("workflow.data.encode", "--tokenized", tokenized, "--vocab", vocab, "--output", output,
                           "--max-seq-length", 128, "--max-predictions-per-seq", 20, "--split", "training",
                           "--shard-index", 0)
        assert result.returncode == 1
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: {output}: cannot write"), last
        assert not output.exists() and not list(directory.parent.glob("**/.shard_0.hdf5.tmp-*"))


# --- the real DAG ------------------------------------------------------------------------------------------------


def snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir),
               "--configfile", str(workdir / "test-config.yaml"), "--allowed-rules", "vocab", "tokenize", "encode",
               "hdf5_dir", "--quiet", "rules", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=workdir)


def make_workdir(workdir: Path, vocab: Path, n_training: int = 3, n_test: int = 1) -> None:
    for split, count in (("training", n_training), ("test", n_test)):
        (workdir / "data" / "shards" / split).mkdir(parents=True)
        for index in range(count):
            seed = 100 * (split == "test") + index
            (workdir / "data" / "shards" / split / f"shard_{index}.txt").write_text(corpus_text(40, seed))
    shutil.copyfile(REPO / "config.yaml", workdir / "config.yaml")
    (workdir / "test-config.yaml").write_text(
        f"shard: {{n_training_shards: {n_training}, n_test_shards: {n_test}}}\n"
        f"vocab: {{file: {vocab}}}\n"
        "encode: {dupe_factor: 2, phase1: {max_seq_length: 64, max_predictions_per_seq: 10}}\n"
    )


def tree_digest(directory: Path) -> dict[str, str]:
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != ".snakemake_timestamp"  # Snakemake's marker in directory outputs
    }


def test_snakemake_hdf5_seq_target_is_byte_identical_with_1_or_2_jobs(shard, tmp_path):
    vocab = shard[0]
    trees = []
    for jobs in ("1", "2"):
        workdir = tmp_path / f"j{jobs}"
        make_workdir(workdir, vocab)
        result = snakemake(workdir, "--cores", jobs, "data/hdf5_seq64")
        assert result.returncode == 0, result.stderr[-3000:]
        assert not (workdir / "data" / "encoded_seq512").exists()  # phase-1 target builds phase-1 data only
        trees.append(tree_digest(workdir / "data" / "hdf5_seq64"))
    assert trees[0] == trees[1]
    assert sorted(trees[0]) == ["manifest.json", "test/seq64_test_shard_0.hdf5"] + [
        f"training/seq64_training_shard_{i}.hdf5" for i in range(3)]
    manifest = json.loads((tmp_path / "j1" / "data" / "hdf5_seq64" / "manifest.json").read_text())
    assert manifest["format"] == "packed" and manifest["settings"]["packing"] == "gapfill"  # packed by default
    assert manifest["settings"]["max_seq_length"] == 64 and manifest["settings"]["dupe_factor"] == 2
    assert manifest["n_instances"]["training"] == sum(e["n_instances"] for e in manifest["shards"][:3])
    assert all(trees[0][entry["path"]] == entry["sha256"] for entry in manifest["shards"])
    # Phase 2 reuses the tokenized shards: only encode + hdf5_dir jobs are planned for it.
    plan = snakemake(tmp_path / "j1", "--dry-run", "data/hdf5_seq512")
    assert plan.returncode == 0, plan.stderr[-3000:]
    jobs = dict(re.findall(r"^(\w+)\s+(\d+)$", plan.stdout.split("Job stats:")[-1], flags=re.M))
    assert jobs == {"encode": "4", "hdf5_dir": "1", "total": "5"}, plan.stdout


def test_snakemake_other_seed_changes_the_data(shard, tmp_path):
    vocab = shard[0]
    workdir = tmp_path / "w"
    make_workdir(workdir, vocab, n_training=1, n_test=1)
    assert snakemake(workdir, "--cores", "2", "data/hdf5_seq64").returncode == 0
    before = tree_digest(workdir / "data" / "hdf5_seq64")
    result = snakemake(workdir, "--cores", "2", "data/hdf5_seq64", "--config", "seed=7")
    assert result.returncode == 0, result.stderr[-3000:]
    after = tree_digest(workdir / "data" / "hdf5_seq64")
    assert before["training/seq64_training_shard_0.hdf5"] != after["training/seq64_training_shard_0.hdf5"]
    # Packing off: the same instances in NVIDIA's schema, one per row.
    config = workdir / "test-config.yaml"
    config.write_text(config.read_text().replace("encode: {", "encode: {packing: {enabled: false}, "))
    result = snakemake(workdir, "--cores", "2", "data/hdf5_seq64", "--config", "seed=7")
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((workdir / "data" / "hdf5_seq64" / "manifest.json").read_text())
    assert manifest["format"] == "unpacked" and "packing" not in manifest["settings"]
    unpacked, _ = read_all(workdir / "data" / "hdf5_seq64" / "training" / "seq64_training_shard_0.hdf5")
    assert sorted(unpacked) == sorted(SCHEMA) and manifest["n_instances"]["training"] == len(unpacked["input_ids"])


def reference_pairs(documents: list[list[list[int]]], settings: EncodeSettings, rng: random.Random) -> list[tuple]:
    """(len_a, len_b, is_random_next) of every instance Google's create_training_instances makes (shared port)."""
    instances = google_reference.create_training_instances(
        [list(document) for document in documents], list(range(len(documents))), rng, settings.max_seq_length,
        settings.dupe_factor, settings.short_seq_prob, settings.masked_lm_prob, settings.max_predictions_per_seq)
    pairs = []
    for instance in instances:
        len_a = instance.segment_ids.count(0) - 2
        pairs.append((len_a, len(instance.tokens) - len_a - 3, instance.is_random_next))
    return pairs


@pytest.mark.parametrize("length", [64, 128, 512])
def test_pairing_statistics_match_a_sentence_by_sentence_reference(shard, length):
    settings = EncodeSettings(max_seq_length=length, max_predictions_per_seq=20, dupe_factor=10)
    ids, sentence_offsets, document_offsets = load_tokenized(shard[1])
    sentences = [ids[s:e].tolist() for s, e in zip(sentence_offsets[:-1], sentence_offsets[1:])]
    documents = [sentences[s:e] for s, e in zip(document_offsets[:-1], document_offsets[1:])]
    reference = np.array(reference_pairs(documents, settings, random.Random(3)))
    plan = plan_instances(sentence_offsets, document_offsets, settings, shard_rng(3, "training", 0)[0])
    ours = np.stack([plan[:, 1] - plan[:, 0], plan[:, 3] - plan[:, 2], plan[:, 4]], axis=1)
    assert abs(len(ours) / len(reference) - 1) < 0.03
    for column in range(3):  # mean length of A, of B, share of random B
        mean, spread = reference[:, column].mean(), reference[:, column].std() / np.sqrt(len(reference))
        assert abs(ours[:, column].mean() - mean) < 5 * spread + 0.01 * mean, column
    assert (ours[:, 0] + ours[:, 1] <= length - 3).all()


def test_closed_form_truncation_equals_googles_token_by_token_loop():
    rng = np.random.default_rng(0)
    len_a, len_b = rng.integers(1, 300, 5000), rng.integers(1, 300, 5000)
    a_start, b_start = rng.integers(0, 10**6, 5000), rng.integers(0, 10**6, 5000)
    a0, a1, b0, b1 = _truncate_pair(a_start, a_start + len_a, b_start, b_start + len_b, 125, rng)
    reference_rng = random.Random(0)
    for i in range(5000):
        tokens_a, tokens_b = list(range(len_a[i])), list(range(len_b[i]))
        google_reference.truncate_seq_pair(tokens_a, tokens_b, 125, reference_rng)
        assert (a1[i] - a0[i], b1[i] - b0[i]) == (len(tokens_a), len(tokens_b))
    # Each trimmed token comes off a random end: about half of the trims are at the front.
    trimmed_front = (a0 - a_start).sum() + (b0 - b_start).sum()
    trimmed = (len_a - (a1 - a0)).sum() + (len_b - (b1 - b0)).sum()
    assert a0.min() >= 0 and abs(trimmed_front / trimmed - 0.5) < 0.01


# Every cell of objective x masking x masking rule x length x packing algorithm x slots: the invariant of packing
# (issue 37); slots auto (as many as fit: 42 at 128, 170 at 512, with int16 sequence numbers) with gapfill only.
MATRIX = [(objective, masking, rule, length, algorithm, slots) for objective in OBJECTIVES for masking in MASKINGS
          for rule in MASKING_RULES for length in (128, 512) for algorithm in ("gapfill", "lpfhp", "spfhp")
          for slots in (3, "auto") if slots == 3 or algorithm == "gapfill"]


@pytest.mark.parametrize("objective, masking, rule, length, algorithm, slots", MATRIX)
def test_packed_sequences_equal_their_unpacked_instances_token_for_token_with_no_special_token_inside(
        shard, tmp_path, objective, masking, rule, length, algorithm, slots):
    vocab_path, tokenized, vocab = shard
    max_predictions = length * 15 // 100 + 1 if rule == "google" else derived_max_predictions(length, rule, (0.3,))
    settings = EncodeSettings(max_seq_length=length, max_predictions_per_seq=max_predictions, dupe_factor=2,
                              masking=masking, objective=objective, masking_rule=rule,
                              masked_lm_prob=0.15 if rule == "google" else 0.3)
    encode_shard(tokenized, vocab_path, tmp_path / "u.hdf5", settings, 5, "training", 0, "none")
    encode_shard(tokenized, vocab_path, tmp_path / "p.hdf5", settings, 5, "training", 0, "none",
                 PackSettings(slots, algorithm))
    unpacked, _ = read_all(tmp_path / "u.hdf5")
    packed, attributes = read_all(tmp_path / "p.hdf5")
    assert attributes["packed_version"] == 2
    specials = {vocab.cls, vocab.sep, vocab.mask, *special_token_ids(read_vocab(vocab_path)).values()}
    assert_packed_equal_unpacked(packed, unpacked, specials, vocab)
    if masking == "dynamic":  # as the loader masks them: only text predicted, the rest of every row as written
        masked = LoadTimeMasker.of_shard(str(tmp_path / "p.hdf5"), 7)(packed, 0, 0, np.arange(len(packed["input_ids"])))
        rows, columns = np.nonzero(masked["masked_lm_positions"] > 0)
        positions = masked["masked_lm_positions"][rows, columns]
        assert len(rows) > 0.1 * packed["input_mask"].astype(bool).sum()
        restored = masked["input_ids"].copy()
        restored[rows, positions] = masked["masked_lm_ids"][rows, columns]
        np.testing.assert_array_equal(restored, packed["input_ids"])
        assert not np.isin(packed["input_ids"][rows, positions], list(specials)).any()
    if objective == "documents":  # one document per sequence: [CLS] text [SEP], no [SEP] inside
        original = unpacked["input_ids"].copy()
        rows, columns = np.nonzero(unpacked["masked_lm_positions"] > 0)
        original[rows, unpacked["masked_lm_positions"][rows, columns]] = unpacked["masked_lm_ids"][rows, columns]
        assert ((original == vocab.sep).sum(axis=1) == 1).all()


def assert_packed_equal_unpacked(packed: dict, unpacked: dict, specials: set, vocab) -> None:
    """Each packed sequence is its instance token for token (ids, segments, positions, label, predictions), each
    instance packed once, and no special token inside but its [CLS] and [SEP]s."""
    rows, slots = np.nonzero(packed["sequence_lengths"] > 0)
    instances = packed["instance_index"][rows, slots]
    assert sorted(instances.tolist()) == list(range(len(unpacked["input_ids"])))  # each instance once
    for row, slot, instance in zip(rows.tolist(), slots.tolist(), instances.tolist()):
        start, n = int(packed["cls_positions"][row, slot]), int(packed["sequence_lengths"][row, slot])
        cells = slice(start, start + n)
        assert n == unpacked["input_mask"][instance].sum() and unpacked["input_mask"][instance, :n].all()
        np.testing.assert_array_equal(packed["input_ids"][row, cells], unpacked["input_ids"][instance, :n])
        np.testing.assert_array_equal(packed["segment_ids"][row, cells], unpacked["segment_ids"][instance, :n])
        np.testing.assert_array_equal(packed["position_ids"][row, cells], np.arange(n))
        assert (packed["input_mask"][row, cells] == slot + 1).all()
        assert packed["next_sentence_labels"][row, slot] == unpacked["next_sentence_labels"][instance]
        positions = packed["masked_lm_positions"][row]
        mine = (positions >= start) & (positions < start + n) & (positions > 0)
        theirs = unpacked["masked_lm_positions"][instance] > 0
        np.testing.assert_array_equal(positions[mine] - start, unpacked["masked_lm_positions"][instance][theirs])
        np.testing.assert_array_equal(packed["masked_lm_ids"][row][mine], unpacked["masked_lm_ids"][instance][theirs])
        # No special token inside but its [CLS] and [SEP]s (a masked cell may hold any token: Google's 10% random).
        text = np.ones(n, bool)
        text[positions[mine] - start] = False
        ids = packed["input_ids"][row, cells]
        assert ids[0] == vocab.cls and ids[-1] == vocab.sep
        inner = ids[1:][text[1:]]
        assert not np.isin(inner, list(specials - {vocab.sep})).any(), (row, slot, ids)
    assert packed["input_mask"].astype(bool).sum() == unpacked["input_mask"].sum()  # no extra token anywhere


def test_the_packer_refuses_to_write_a_shard_whose_sequences_hold_padding(shard, tmp_path, monkeypatch):
    """The defect of issue 37 put back: a full-sentences instance within a document given a+b+3 tokens."""
    vocab_path, tokenized, vocab = shard
    from workflow.data import encode

    def instances_with_the_old_lengths(batches, lengths, settings):  # a+b+3: one more where B is empty (one [SEP])
        batches = list(batches)
        single = np.concatenate([(batch["input_ids"] == vocab.sep).sum(axis=1) == 1 for batch in batches])
        return ragged_instances(iter(batches), lengths + single, settings)

    monkeypatch.setattr(encode, "ragged_instances", instances_with_the_old_lengths)
    settings = EncodeSettings(max_seq_length=128, max_predictions_per_seq=20, masking="dynamic",
                              objective="full_sentences")
    with pytest.raises(UserError, match=r"p\.hdf5: packed row \d+, slot \d does not start with \[CLS\] and end with "
                                        r"\[SEP\]; the packer was given wrong lengths$"):
        encode_shard(tokenized, vocab_path, tmp_path / "p.hdf5", settings, 5, "training", 0, "none", PackSettings())
    assert not (tmp_path / "p.hdf5").exists()


def test_check_packed_names_the_padding_inside_a_sequence(shard, tmp_path):
    vocab_path, tokenized, vocab = shard
    settings = EncodeSettings(max_seq_length=128, max_predictions_per_seq=20, objective="full_sentences")
    encode_shard(tokenized, vocab_path, tmp_path / "p.hdf5", settings, 5, "training", 0, "none", PackSettings())
    packed, _ = read_all(tmp_path / "p.hdf5")
    check_packed(packed, vocab.cls, vocab.sep, (0, vocab.mask), "p")  # the shard as written passes
    row = int(np.flatnonzero(packed["sequence_lengths"][:, 0] > 3)[0])
    start = int(packed["cls_positions"][row, 0])
    predicted = set(packed["masked_lm_positions"][row].tolist())
    column = next(c for c in range(start + 1, start + packed["sequence_lengths"][row, 0] - 1) if c not in predicted
                  and packed["input_ids"][row, c] != vocab.sep)
    packed["input_ids"][row, column] = 0
    with pytest.raises(UserError, match=rf"^p: 1 \[PAD\], \[MASK\] or \[CLS\] token\(s\) inside packed sequences "
                                        rf"\(first in row {row}\); the packer was given wrong lengths$"):
        check_packed(packed, vocab.cls, vocab.sep, (0, vocab.mask), "p")


def test_the_trainer_refuses_packed_full_sentences_of_the_old_layout_with_one_error_line(shard, tmp_path):
    vocab_path, tokenized, _ = shard
    settings = EncodeSettings(max_seq_length=128, max_predictions_per_seq=20, masking="dynamic",
                              objective="full_sentences")
    for split in ("training", "test"):
        encode_shard(tokenized, vocab_path, tmp_path / "encoded" / split / "shard_0.hdf5", settings, 5, split, 0,
                     "none", PackSettings())
    build_hdf5_dir(tmp_path / "encoded", {"training": 1, "test": 1}, tmp_path / "hdf5")
    assert list_shards(tmp_path / "hdf5", "training")[0].packed  # the current layout trains
    path = tmp_path / "hdf5" / "training" / "seq128_training_shard_0.hdf5"
    with h5py.File(path, "r+") as handle:  # as the encoder before the fix wrote it
        del handle.attrs["packed_version"]
    with pytest.raises(UserError, match=r"^\S+seq128_training_shard_0\.hdf5: packed full-sentences data of layout "
                                        r"version 1, which holds a \[PAD\] inside every sequence; rebuild it "
                                        r"\(snakemake rebuilds data/encoded_seq\* and data/hdf5_seq\* on its own\) "
                                        r"and start the pretraining run over in a new run directory$"):
        list_shards(tmp_path / "hdf5", "training")


def test_a_new_packed_layout_changes_the_params_of_full_sentences_encode_jobs_only():
    """Snakemake reruns a job whose params changed: the DAG rebuilds the shards the layout version changed."""
    namespace = {"config": {"encode": {"objective": "full_sentences",
                                       "packing": {"enabled": True, "max_sequences_per_pack": 3,
                                                   "algorithm": "gapfill"}}}}
    exec((REPO / "rules/functions/encode.smk").read_text(), namespace)
    assert namespace["packing_arguments"](None).endswith(" --packed-version 2")
    namespace["config"]["encode"]["objective"] = "nsp"
    assert namespace["packing_arguments"](None) == "--packing --max-sequences-per-pack 3 --pack-algorithm gapfill"
    namespace["config"]["encode"]["packing"]["enabled"] = False
    assert namespace["packing_arguments"](None) == "--no-packing"
