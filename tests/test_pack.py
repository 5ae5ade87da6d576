"""Stage pack: every encoded instance lands in exactly one pack, unchanged; packs respect the length and the
sequences-per-pack cap; SPFHP fills rows; byte-identical output; one-line errors and no partial file."""
import hashlib
import subprocess
import sys

import h5py
import numpy as np
import pytest

from tests.conftest import REPO
from tests.test_encode import tokenized_shard
from workflow.data.encode import EncodeSettings, encode_shard
from workflow.data.hdf5 import read_encoded
from workflow.data.pack import (ALGORITHMS, RaggedInstances, as_written_by_encode, fewest_packs, histogram_packing,
                                pack_arrays, pack_ragged, pack_shard)

PREDICTIONS = {128: 20, 512: 80}


@pytest.fixture(scope="module")
def encoded(tmp_path_factory):
    """Encoded shards of one generated tokenized shard: {max_seq_length: path}."""
    directory = tmp_path_factory.mktemp("pack")
    vocab, tokenized, _ = tokenized_shard(directory, n_documents=200, vocab_size=200, seed=3)
    paths = {}
    for length, predictions in PREDICTIONS.items():
        paths[length] = directory / f"encoded_{length}.hdf5"
        settings = EncodeSettings(max_seq_length=length, max_predictions_per_seq=predictions, dupe_factor=2)
        encode_shard(tokenized, vocab, paths[length], settings, seed=5, split="training", shard_index=0)
    return paths


def read(path):
    with h5py.File(path, "r") as handle:
        return {name: handle[name][()] for name in handle}, dict(handle.attrs)


@pytest.mark.parametrize("length", [128, 512])
@pytest.mark.parametrize("max_sequences_per_pack", [2, 3])
def test_every_instance_is_in_exactly_one_pack_with_its_tokens_predictions_and_label(encoded, tmp_path, length,
                                                                                     max_sequences_per_pack):
    original, _ = read_encoded(encoded[length])
    pack_shard(encoded[length], tmp_path / "packed.hdf5", max_sequences_per_pack)
    packed, attributes = read(tmp_path / "packed.hdf5")
    n = len(original["input_ids"])
    assert sorted(packed["instance_index"][packed["instance_index"] >= 0]) == list(range(n))
    assert len(packed["input_ids"]) < n  # packing merged rows

    for row in range(len(packed["input_ids"])):
        covered = np.zeros(length, bool)
        predictions = dict(zip(packed["masked_lm_positions"][row], packed["masked_lm_ids"][row]))
        predictions.pop(0, None)
        for slot in range(max_sequences_per_pack):
            instance, start = packed["instance_index"][row, slot], packed["cls_positions"][row, slot]
            size = packed["sequence_lengths"][row, slot]
            if instance < 0:
                assert size == 0 and packed["next_sentence_labels"][row, slot] == -1
                continue
            span = slice(start, start + size)
            assert size == original["input_mask"][instance].sum()
            assert np.array_equal(packed["input_ids"][row, span], original["input_ids"][instance, :size])
            assert np.array_equal(packed["segment_ids"][row, span], original["segment_ids"][instance, :size])
            assert np.all(packed["input_mask"][row, span] == slot + 1)
            assert np.array_equal(packed["position_ids"][row, span], np.arange(size))
            assert packed["next_sentence_labels"][row, slot] == original["next_sentence_labels"][instance]
            valid = original["masked_lm_positions"][instance] > 0
            expected = dict(zip(original["masked_lm_positions"][instance][valid] + start,
                                original["masked_lm_ids"][instance][valid]))
            assert {p: i for p, i in predictions.items() if start <= p < start + size} == expected
            covered[span] = True
        assert not covered[~(packed["input_mask"][row] > 0)].any()
        assert np.all(packed["input_ids"][row, ~covered] == 0) and np.all(packed["input_mask"][row, ~covered] == 0)
        assert all(covered[p] for p in predictions)  # no prediction outside a sub-sequence
        positions = packed["masked_lm_positions"][row]
        assert np.all(np.diff(positions[positions > 0]) > 0)
    real = original["input_mask"].sum()
    assert attributes["fill"] == pytest.approx(real / packed["input_ids"].size)
    assert attributes["max_sequences_per_pack"] == max_sequences_per_pack and attributes["n_instances"] == n


def test_one_sequence_per_pack_reproduces_the_encoded_rows(encoded, tmp_path):
    original, _ = read_encoded(encoded[128])
    pack_shard(encoded[128], tmp_path / "packed.hdf5", max_sequences_per_pack=1)
    packed, _ = read(tmp_path / "packed.hdf5")
    for name in ("input_ids", "segment_ids", "next_sentence_labels"):
        assert np.array_equal(packed[name].reshape(original[name].shape), original[name])
    assert np.array_equal(packed["input_mask"], original["input_mask"])
    width = min(packed["masked_lm_positions"].shape[1], original["masked_lm_positions"].shape[1])
    assert np.array_equal(packed["masked_lm_positions"][:, :width], original["masked_lm_positions"][:, :width])


def assert_same_arrays(actual: dict, expected: dict) -> None:
    assert list(actual) == list(expected)
    for name in expected:
        assert actual[name].dtype == expected[name].dtype, name
        np.testing.assert_array_equal(actual[name], expected[name], err_msg=name)


@pytest.mark.parametrize("length", [128, 512])
@pytest.mark.parametrize("max_sequences_per_pack", [1, 3, 5])
def test_packing_in_the_instances_memory_gives_the_same_packs(encoded, length, max_sequences_per_pack):
    original, _ = read_encoded(encoded[length])
    lengths = original["input_mask"].sum(axis=1)
    expected = pack_arrays(original, max_sequences_per_pack)
    scratch = {name: array.copy() for name, array in original.items()}
    assert_same_arrays(pack_arrays(scratch, max_sequences_per_pack, lengths=lengths, in_place=True), expected)


@pytest.mark.parametrize("max_sequences_per_pack", [2, 3])
def test_what_a_file_holds_past_its_tokens_and_predictions_does_not_reach_the_packs(encoded, max_sequences_per_pack):
    original, _ = read_encoded(encoded[128])
    rng = np.random.default_rng(0)
    padding = original["input_mask"] == 0
    dirty = {**original, "input_ids": np.where(padding, rng.integers(1, 200, padding.shape), original["input_ids"]),
             "segment_ids": np.where(padding, 1, original["segment_ids"]).astype(np.int8)}
    # Every 3rd row's predictions after some empty slots (in order), with junk ids and negative positions in those.
    positions, ids = original["masked_lm_positions"].copy(), original["masked_lm_ids"].copy()
    for row in range(0, len(positions), 3):
        shift = rng.integers(0, (positions[row] == 0).sum() + 1)  # into the empty slots at the end
        positions[row], ids[row] = np.roll(positions[row], shift), np.roll(ids[row], shift)
    empty = positions == 0
    dirty["masked_lm_positions"] = np.where(empty, -1, positions)
    dirty["masked_lm_ids"] = np.where(empty, rng.integers(1, 200, empty.shape), ids)
    assert_same_arrays(pack_arrays(dirty, max_sequences_per_pack), pack_arrays(original, max_sequences_per_pack))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("max_sequences_per_pack", [1, 2, 3, 5])
def test_packs_keep_every_sequence_within_the_length_and_the_cap(algorithm, max_sequences_per_pack):
    rng = np.random.default_rng(0)
    histogram = np.bincount(rng.integers(1, 129, 5000), minlength=129)
    histogram[128] += 3000
    strategies = histogram_packing(histogram, 128, max_sequences_per_pack, algorithm)
    packed = np.zeros(129, np.int64)
    for lengths, count in strategies:
        assert count > 0 and 1 <= len(lengths) <= max_sequences_per_pack and sum(lengths) <= 128
        np.add.at(packed, list(lengths), count)
    assert np.array_equal(packed, histogram)


def lengths_of(distribution: str, length: int, rng, n: int = 100_000) -> np.ndarray:
    if distribution == "uniform":
        return rng.integers(8, length + 1, n)
    if distribution == "mostly full":  # NVIDIA's instances: most rows full, documents' last chunks below
        return np.where(rng.random(n) < 0.65, length, rng.integers(8, length, n))
    # Wikipedia-like: half full, the rest documents' ends, many short (stubs), log-normal
    ends = np.exp(rng.normal(np.log(0.4 * length), 0.9, n)).astype(np.int64)
    return np.clip(np.where(rng.random(n) < 0.5, length, ends), 8, length)


def fill_of(lengths: np.ndarray, length: int, n_packs: int) -> float:
    return lengths.sum() / (n_packs * length)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("distribution", ["uniform", "mostly full"])
@pytest.mark.parametrize("length", [128, 512])
def test_histogram_packing_of_a_large_shard_is_within_2_percent_of_the_optimum(algorithm, distribution, length):
    lengths = lengths_of(distribution, length, np.random.default_rng(1))
    histogram = np.bincount(lengths, minlength=length + 1)
    n_packs = sum(count for _, count in histogram_packing(histogram, length, 3, algorithm))
    lower_bound = fewest_packs(histogram, length, 3)
    assert lower_bound <= n_packs <= 1.02 * lower_bound
    assert fill_of(lengths, length, n_packs) >= 0.98


@pytest.mark.parametrize("length", [128, 512])
def test_gapfill_fills_99_percent_of_wikipedia_like_rows_where_greedy_packing_does_not(length):
    lengths = lengths_of("wikipedia-like", length, np.random.default_rng(2))
    histogram = np.bincount(lengths, minlength=length + 1)
    fills = {algorithm: fill_of(lengths, length, sum(count for _, count in histogram_packing(histogram, length, 3,
                                                                                                 algorithm)))
             for algorithm in ALGORITHMS}
    best_possible = fill_of(lengths, length, fewest_packs(histogram, length, 3))
    assert fills["gapfill"] >= 0.99 and best_possible - fills["gapfill"] < 0.006
    assert fills["lpfhp"] < 0.98 and fills["spfhp"] < 0.98


def optimum(lengths: list[int], length: int, cap: int) -> int:
    """Fewest packs, by exhaustive search (a few sequences only)."""
    best = len(lengths)

    def place(index: int, packs: list[list[int]]) -> None:
        nonlocal best
        if len(packs) >= best:
            return
        if index == len(lengths):
            best = len(packs)
            return
        tried = set()
        for pack in packs:
            key = (sum(pack), len(pack))
            if key not in tried and sum(pack) + lengths[index] <= length and len(pack) < cap:
                tried.add(key)
                pack.append(lengths[index])
                place(index + 1, packs)
                pack.pop()
        place(index + 1, packs + [[lengths[index]]])

    place(0, [])
    return best


def test_fewest_packs_never_exceeds_the_optimum_and_gapfill_is_near_it_on_small_shards():
    rng = np.random.default_rng(3)
    gaps = []
    for _ in range(150):
        lengths = sorted(rng.integers(1, 17, rng.integers(3, 10)).tolist(), reverse=True)
        histogram = np.bincount(lengths, minlength=17)
        best = optimum(lengths, 16, 3)
        n_packs = sum(count for _, count in histogram_packing(histogram, 16, 3))
        assert fewest_packs(histogram, 16, 3) <= best <= n_packs
        gaps.append(n_packs - best)
    assert max(gaps) <= 1 and np.mean(gaps) < 0.05  # measured: optimal on all 150 (lpfhp misses 9%)


def test_packing_is_byte_identical_run_to_run_and_from_the_command_line(encoded, tmp_path):
    for name, cap in (("a", 3), ("b", 3), ("c", 2)):
        pack_shard(encoded[512], tmp_path / f"{name}.hdf5", cap)
    result = run_pack("--encoded", encoded[512], "--output", tmp_path / "cli.hdf5")
    assert result.returncode == 0, result.stderr
    digests = [hashlib.sha256((tmp_path / f"{name}.hdf5").read_bytes()).hexdigest() for name in ("a", "b", "c", "cli")]
    assert digests[0] == digests[1] == digests[3] != digests[2]


def run_pack(*args):
    return subprocess.run([sys.executable, "-m", "workflow.data.pack", *map(str, args)], capture_output=True,
                          text=True, cwd=REPO)


def test_bad_input_is_a_one_line_error_and_leaves_no_output(encoded, tmp_path):
    pack_shard(encoded[128], tmp_path / "packed.hdf5")
    for source, message in ((tmp_path / "packed.hdf5", "already packed"),
                            (tmp_path / "missing.hdf5", "encoded shard not found")):
        result = run_pack("--encoded", source, "--output", tmp_path / "out.hdf5")
        assert result.returncode == 1
        assert result.stderr.strip().splitlines()[-1] == f"error: {source}: {message}"
        assert not (tmp_path / "out.hdf5").exists() and list(tmp_path.glob(".out.hdf5*")) == []
    result = run_pack("--encoded", encoded[128], "--output", tmp_path / "out.hdf5", "--max-sequences-per-pack", 0)
    assert result.returncode == 1 and "max_sequences_per_pack 0: must be at least 1" in result.stderr


def ragged_of(arrays: dict, max_seq_length: int) -> RaggedInstances:
    """NVIDIA-schema instances (as encode builds them) held at their real lengths."""
    arrays, lengths = as_written_by_encode({name: value.copy() for name, value in arrays.items()})
    real = np.arange(max_seq_length) < lengths[:, None]
    valid = arrays["masked_lm_positions"] > 0
    return RaggedInstances(max_seq_length, arrays["masked_lm_positions"].shape[1], lengths,
                           arrays["input_ids"][real], arrays["segment_ids"][real], arrays["masked_lm_positions"][valid],
                           arrays["masked_lm_ids"][valid], valid.sum(axis=1), arrays["next_sentence_labels"])


@pytest.mark.parametrize("rule, packing_prob", [("google", 0.15), ("per_token", 0.3), ("per_token", 0.05)],
                         ids=["google", "per_token", "per_token_beyond_the_width"])
@pytest.mark.parametrize("slots", [1, 3, 16])
def test_instances_at_their_real_lengths_pack_as_full_length_ones_byte_for_byte(tmp_path, rule, packing_prob, slots):
    """pack_ragged (the encoder's: no instance at max_seq_length) = pack_arrays, the predictions beyond a row's width
    (per_token at a narrower rate than drawn) unmasked and counted alike."""
    vocab, tokenized, _ = tokenized_shard(tmp_path, n_documents=200, vocab_size=200, seed=3)
    p = 0.3 if rule == "per_token" else 0.15
    settings = EncodeSettings(max_seq_length=128, max_predictions_per_seq=72 if rule == "per_token" else 20,
                              masked_lm_prob=p, masking_rule=rule, objective="documents", dupe_factor=1)
    encode_shard(tokenized, vocab, tmp_path / "u.hdf5", settings, 5, "training", 0, "none", None)
    arrays, _ = read_encoded(tmp_path / "u.hdf5")
    instances = ragged_of(arrays, 128)
    dense_counts, ragged_counts = {}, {}
    expected = pack_arrays({name: value.copy() for name, value in arrays.items()}, slots, packing_prob,
                           masking_rule=rule, counts=dense_counts)
    packed = pack_ragged(instances, slots, packing_prob, masking_rule=rule, counts=ragged_counts)
    assert packed.keys() == expected.keys()
    for name in expected:
        assert packed[name].dtype == expected[name].dtype, name
        np.testing.assert_array_equal(packed[name], expected[name], err_msg=name)
    assert ragged_counts == dense_counts
    assert bool(dense_counts) == (packing_prob == 0.05)
