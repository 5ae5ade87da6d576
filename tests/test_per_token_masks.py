"""encode.masking_rule per_token (each token masked on its own, ModernBERT's), encode.eval_masked_lm_prob (the test
split's rate) and max_predictions_per_seq derived where null; google, the default, keeps NVIDIA's files byte for
byte."""
import hashlib
import json
import logging
import math
import re

import h5py
import numpy as np
import pytest
import torch

from tests.conftest import REPO
from tests.fixtures.real_shaped_text import tokenized_sample
from tests.test_masking import loaded, masks_alike_on_any_layout
from workflow.config import load_config
from workflow.data.encode import EncodeSettings, Vocab, encode_shard, main as encode_main
from workflow.data.masking_rule import (derived_max_predictions, encode_config_error, mask_rows,
                                        phase_max_predictions)
from workflow.data.pack import PackSettings, pack_arrays, prediction_width
from workflow.train.evaluation import EvaluationSet
from workflow.train.masking import KeyedDraws, LoadTimeMasker, sequence_keys
from workflow.train.pretraining_data import list_shards

P = 0.3
PER_TOKEN = dict(max_seq_length=128, max_predictions_per_seq=72, masked_lm_prob=P, masking_rule="per_token")


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    """The sample dump tokenized: (directory, vocab path, tokenized shard, Vocab)."""
    root = tmp_path_factory.mktemp("per_token")
    vocab, tokenized = tokenized_sample(root)
    return root, vocab, tokenized, Vocab.read(vocab)


def encoded(sample, name, split="training", packing=None, **settings):
    root, vocab, tokenized, _ = sample
    path = root / name / split / "shard_0.hdf5"
    path.parent.mkdir(parents=True, exist_ok=True)
    encode_shard(tokenized, vocab, path, EncodeSettings(**settings), 12345, split, 0, "none", packing)
    with h5py.File(path, "r") as handle:
        return path, {name: handle[name][()] for name in handle}


def masks(arrays: dict, vocab: Vocab) -> dict:
    """Unpacked rows' masks: per-sequence counts and candidates, the 80/10/10 outcomes, the words masked."""
    positions, labels, ids = arrays["masked_lm_positions"], arrays["masked_lm_ids"], arrays["input_ids"]
    valid = positions > 0
    rows = np.nonzero(valid)[0]
    original = ids.copy()
    original[rows, positions[valid]] = labels[valid]
    masked = np.zeros(ids.shape, bool)
    masked[rows, positions[valid]] = True
    candidate = (arrays["input_mask"] > 0) & ~np.isin(original, [0, vocab.cls, vocab.sep, vocab.mask])
    previous = np.zeros_like(candidate)
    previous[:, 1:] = candidate[:, :-1]
    word_start = candidate & ~(vocab.continues_word[original] & previous)
    word = np.cumsum(word_start, axis=1) - 1
    split_words = (masked[:, 1:] != masked[:, :-1]) & candidate[:, 1:] & ~word_start[:, 1:]
    return {"counts": valid.sum(axis=1), "candidates": candidate.sum(axis=1), "n": int(valid.sum()),
            "mask": int((ids[rows, positions[valid]] == vocab.mask).sum()),
            "same": int((ids[rows, positions[valid]] == labels[valid]).sum()),
            "specials": int((masked & ~candidate).sum()), "words": int(word_start.sum()),
            "masked_words": int((masked & word_start).sum()), "split_words": int(split_words.sum()),
            "word_lengths": np.bincount((word + np.arange(len(word))[:, None] * ids.shape[1])[candidate])}


def within(count: int, n: int, p: float, sigmas: float = 4.0) -> bool:
    """`count` successes of `n` within `sigmas` binomial standard deviations of n * p (false alarm ~6e-5 at 4)."""
    return abs(count - n * p) < sigmas * math.sqrt(n * p * (1 - p))


@pytest.mark.parametrize("masking", ["static", "dynamic"])
@pytest.mark.parametrize("whole_word_masking", [False, True], ids=["tokens", "whole_words"])
def test_per_token_masks_each_token_at_the_rate_within_binomial_bounds_and_80_10_10(sample, masking,
                                                                                   whole_word_masking):
    vocab = sample[3]
    settings = dict(PER_TOKEN, dupe_factor=10, masking=masking, whole_word_masking=whole_word_masking)
    path, arrays = encoded(sample, f"rate_{masking}_{whole_word_masking}", **settings)
    m = masks(loaded(path, epochs=4) if masking == "dynamic" else arrays, vocab)
    assert m["n"] > 50_000 and m["specials"] == 0
    n_candidates = int(m["candidates"].sum())
    if whole_word_masking:  # each word drawn on its own: the words' rate is binomial, no word split
        assert m["split_words"] == 0
        assert within(m["masked_words"], m["words"], P), m["masked_words"] / m["words"]
        # Tokens: a sum of word lengths, each word in with probability P.
        spread = math.sqrt(P * (1 - P) * float((m["word_lengths"] ** 2).sum()))
        assert abs(m["n"] - P * n_candidates) < 4 * spread
    else:
        assert within(m["n"], n_candidates, P), m["n"] / n_candidates
        # The count per sequence is binomial, not Google's fixed count: its variance is n p (1 - p).
        variance = float(((m["counts"] - P * m["candidates"]) ** 2).sum())
        assert variance / float((m["candidates"] * P * (1 - P)).sum()) == pytest.approx(1, abs=0.1)
    assert len(np.unique(m["counts"] - np.rint(P * m["candidates"]))) > 10
    assert within(m["mask"], m["n"], 0.8)  # 80% [MASK]
    assert within(m["same"], m["n"], 0.1 + 0.1 / vocab.size)  # 10% kept (+ a random draw of the same token)
    assert within(m["n"] - m["mask"] - m["same"], m["n"], 0.1 - 0.1 / vocab.size)  # 10% random


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_per_token_dynamic_masks_are_the_same_on_any_ranks_after_a_resume_and_in_a_worker(sample, packed):
    path, _ = encoded(sample, f"loader_{packed}", packing=PackSettings() if packed else None, **PER_TOKEN,
                      masking="dynamic", objective="documents")
    shards = list_shards(path.parent.parent, "training")
    sequences, start, count, one_rank = masks_alike_on_any_layout(shards)
    # Three ranks, micro-batches of 16 rows: the same sequences masked alike.
    thirds = [batch for rank in range(3) for batch in sequences.micro_batches(start, count, rank, 3, 16)]
    assert sum(int((b["masked_lm_labels"] >= 0).sum()) for b in thirds) >= int(
        (one_rank[0]["masked_lm_labels"] >= 0).sum())  # straddling rows carried twice, each with its own live part
    labels = one_rank[0]["masked_lm_labels"]
    assert within(int((labels >= 0).sum()), int((one_rank[0]["attention_mask"] > 0).sum()), P, 6)  # the rate
    epoch_later = sequences.read(start + sequences.epoch_length, count)
    assert not torch.equal(epoch_later["masked_lm_positions"], sequences.read(start, count)["masked_lm_positions"])


@pytest.mark.parametrize("masking", ["static", "dynamic"])
def test_the_test_split_is_masked_at_the_held_out_probability_whatever_the_training_rate(sample, masking):
    vocab = sample[3]
    rates = {}
    for split in ("training", "test"):
        path, arrays = encoded(sample, f"held_out_{masking}", split, **PER_TOKEN, dupe_factor=4, masking=masking)
        with h5py.File(path, "r") as handle:
            assert handle.attrs["masking_rule"] == "per_token" and handle.attrs["eval_masked_lm_prob"] == 0.15
            assert handle.attrs["masked_lm_prob"] == P
        m = masks(loaded(path, epochs=2) if masking == "dynamic" else arrays, vocab)
        rates[split] = (m["n"], int(m["candidates"].sum()))
    assert within(*rates["training"], P) and within(*rates["test"], 0.15), rates
    # The held-out set the trainer scores (workflow.train.evaluation) holds the test split's 15% masks.
    test_shards = list_shards(path.parent.parent, "test")
    batch = next(EvaluationSet(test_shards, None, 0).batches(0, 1, 10_000))
    predicted, tokens = int((batch["masked_lm_labels"] >= 0).sum()), int((batch["attention_mask"] > 0).sum())
    assert within(predicted, tokens - 2 * len(batch["input_ids"]), 0.15, 6)


def test_google_test_split_takes_eval_masked_lm_prob_when_set(sample):
    path, arrays = encoded(sample, "google_eval", "test", max_seq_length=128, max_predictions_per_seq=20,
                           masked_lm_prob=0.2, eval_masked_lm_prob=0.1)
    n_tokens = arrays["input_mask"].sum(axis=1)
    expected = np.minimum(20, np.maximum(1, np.rint(n_tokens * 0.1)))
    np.testing.assert_array_equal((arrays["masked_lm_positions"] > 0).sum(axis=1), expected)
    with h5py.File(path, "r") as handle:
        assert "masking_rule" not in handle.attrs and handle.attrs["eval_masked_lm_prob"] == 0.1


def content_digest(path) -> str:
    """sha256 of a shard's datasets and root attributes (what it holds, whatever HDF5 library wrote it)."""
    digest = hashlib.sha256()
    with h5py.File(path, "r") as handle:
        for name in sorted(handle):
            values = handle[name][()]
            digest.update(f"{name} {values.dtype} {values.shape}".encode() + values.tobytes())
        attributes = {key: (value.item() if hasattr(value, "item") else value) for key, value in handle.attrs.items()}
    digest.update(json.dumps(attributes, sort_keys=True).encode())
    return digest.hexdigest()[:16]


# Written by the encoder before masking_rule existed (commit 119b6ff), on the sample: the google rule keeps them.
BEFORE_MASKING_RULE = {
    ("static nsp", "training"): "8f31cca44112e150", ("static nsp", "test"): "80af5d858b8f5028",
    ("static nsp packed", "training"): "6f4294f829ede348", ("static nsp packed", "test"): "bfc665fb45726b0e",
    ("static whole words", "training"): "7109ab6ca97dc765", ("static whole words", "test"): "d5a87014ebf4bf69",
    ("dynamic full_sentences packed", "training"): "1fc7f80d2f8a9ee2",
    ("dynamic full_sentences packed", "test"): "f6aa7cb72b4974b2"}
CELLS = {"static nsp": (dict(), None), "static nsp packed": (dict(), PackSettings()),
         "static whole words": (dict(whole_word_masking=True), PackSettings()),
         "dynamic full_sentences packed": (dict(masking="dynamic", objective="full_sentences"), PackSettings())}


def test_google_masks_write_the_bytes_they_did_before_masking_rule_existed(sample):
    digests = {}
    for name, (settings, packing) in CELLS.items():
        for split in ("training", "test"):
            path, _ = encoded(sample, f"bytes_{name.replace(' ', '_')}", split, packing, max_seq_length=128,
                              max_predictions_per_seq=20, dupe_factor=2, masking_rule="google", **settings)
            digests[name, split] = content_digest(path)
    assert digests == BEFORE_MASKING_RULE


def binomial_tail(n: int, p: float, above: int) -> float:
    """P(Binomial(n, p) > above), summed in logs."""
    return sum(math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p)
                        + (n - k) * math.log(1 - p)) for k in range(above + 1, n + 1))


def test_max_predictions_per_seq_is_derived_from_the_length_and_the_larger_probability():
    derived = {length: derived_max_predictions(length, "per_token", (0.3, 0.15)) for length in (128, 512, 1024, 8192)}
    assert derived == {128: 72, 512: 216, 1024: 400, 8192: 2712}
    for length, cap in derived.items():
        assert cap % 8 == 0 and binomial_tail(length, 0.3, cap) < 3e-9  # a sequence draws more ~once in 10^9
    assert derived_max_predictions(128, "per_token", (0.15,)) == 48
    assert derived_max_predictions(128, "google", (0.15,)) == 19  # Google's largest count: never cut
    assert derived_max_predictions(8, "per_token", (0.9,)) == 8  # never more than the length
    config = load_config(REPO / "config.yaml")
    encode = config["encode"]
    assert (phase_max_predictions(encode, "phase1"), phase_max_predictions(encode, "phase2")) == (20, 80)  # NVIDIA's
    encode.update(masking_rule="per_token", masked_lm_prob=0.3, phase1={"max_seq_length": 1024},
                  phase2={"max_seq_length": 8192, "max_predictions_per_seq": None})
    assert (phase_max_predictions(encode, "phase1"), phase_max_predictions(encode, "phase2")) == (400, 2712)
    namespace = {"config": config, "PHASES": ["phase1", "phase2"],
                 "seq_length": lambda phase: config["encode"][phase]["max_seq_length"]}
    exec((REPO / "rules/functions/encode.smk").read_text(), namespace)
    assert namespace["max_predictions_per_seq"](type("W", (), {"seq": "8192"})) == 2712


def test_the_encode_command_derives_max_predictions_where_not_given(sample, tmp_path):
    _, vocab, tokenized, _ = sample
    encode_main(["--tokenized", str(tokenized), "--vocab", str(vocab), "--output", str(tmp_path / "e.hdf5"),
                 "--max-seq-length", "256", "--masked-lm-prob", "0.3", "--masking-rule", "per_token",
                 "--split", "training", "--shard-index", "0", "--no-packing", "--dupe-factor", "1"])
    with h5py.File(tmp_path / "e.hdf5", "r") as handle:
        assert handle.attrs["max_predictions_per_seq"] == 128 == handle["masked_lm_positions"].shape[1]  # 120.8


def test_draws_beyond_the_cap_stay_unmasked_and_are_counted():
    vocab = Vocab(1000, 2, 3, 4, np.arange(1000) % 3 == 0)
    rng = np.random.default_rng(0)
    for whole_word_masking in (False, True):
        settings = EncodeSettings(**dict(PER_TOKEN, max_predictions_per_seq=30), whole_word_masking=whole_word_masking)
        ids = rng.integers(5, 1000, (2000, 128)).astype(np.int32)
        ids[:, 0], ids[:, -1] = 2, 3
        original, candidate = ids.copy(), np.ones(ids.shape, bool)
        candidate[:, [0, -1]] = False
        counts = {}
        draws = KeyedDraws(sequence_keys(1, 0, 0, np.arange(2000)))
        positions, labels = mask_rows(ids, candidate, np.full(2000, 128), settings, vocab, draws, counts)
        made = (positions > 0).sum(axis=1)
        assert made.max() == 30 and counts["masks_over_cap"] > 0
        # Drawn = made + counted: the same keys under a cap no row reaches.
        uncapped = EncodeSettings(**dict(PER_TOKEN, max_predictions_per_seq=128), whole_word_masking=whole_word_masking)
        drawn = mask_rows(original.copy(), candidate, np.full(2000, 128), uncapped, vocab, draws, {})[0]
        assert int((drawn > 0).sum()) == int(made.sum()) + counts["masks_over_cap"]
        changed = ids != original
        predicted = np.zeros(ids.shape, bool)
        rows, slots = np.nonzero(positions > 0)
        predicted[rows, positions[rows, slots]] = True
        assert not (changed & ~predicted).any()  # nothing masked without its label


def test_a_packed_row_beyond_its_prediction_width_unmasks_its_last_predictions_and_counts_them(sample):
    vocab = sample[3]
    _, arrays = encoded(sample, "overflow", **dict(PER_TOKEN, max_predictions_per_seq=20), dupe_factor=1)
    original = {name: values.copy() for name, values in arrays.items()}
    lengths = arrays["input_mask"].sum(axis=1)
    width = prediction_width(128, 20, 0.05, 3, "per_token")  # a width made for 5%: 30% overflows it
    assert width == 24
    counts = {}
    packed = pack_arrays(arrays, 3, 0.05, "gapfill", "overflow", lengths, masking_rule="per_token", counts=counts)
    assert counts["masks_over_row_width"] > 0
    kept = int((packed["masked_lm_positions"] > 0).sum())
    assert kept + counts["masks_over_row_width"] == int((original["masked_lm_positions"] > 0).sum())
    rows, slots = np.nonzero(packed["sequence_lengths"] > 0)
    for row, slot in zip(rows.tolist(), slots.tolist()):
        instance = packed["instance_index"][row, slot]
        start, n = packed["cls_positions"][row, slot], packed["sequence_lengths"][row, slot]
        positions = packed["masked_lm_positions"][row]
        mine = (positions >= start) & (positions < start + n) & (positions > 0)
        theirs = original["masked_lm_positions"][instance] > 0
        assert mine.sum() <= theirs.sum()
        # The first predictions stay as drawn; the unmasked ones hold their original token again.
        np.testing.assert_array_equal(positions[mine] - start,
                                      original["masked_lm_positions"][instance][theirs][:mine.sum()])
        restored = original["input_ids"][instance, :n].copy()
        dropped = original["masked_lm_positions"][instance][theirs][mine.sum():]
        restored[dropped] = original["masked_lm_ids"][instance][theirs][mine.sum():]
        np.testing.assert_array_equal(packed["input_ids"][row, start:start + n], restored)
    assert not np.isin(packed["masked_lm_ids"][packed["masked_lm_positions"] > 0], [vocab.cls, vocab.sep]).any()


def test_the_load_time_masker_unmasks_what_exceeds_the_files_width_and_warns(sample, caplog):
    path, _ = encoded(sample, "narrow", packing=PackSettings(), **PER_TOKEN, masking="dynamic")
    with h5py.File(path, "r") as handle:
        rows = {name: handle[name][:64] for name in ("input_ids", "input_mask", "instance_index",
                                                     "masked_lm_positions", "masked_lm_ids")}
    masker = LoadTimeMasker.of_shard(str(path), 7)
    wide = masker(rows, 0, 0, np.arange(64))
    narrow_rows = dict(rows, masked_lm_positions=rows["masked_lm_positions"][:, :20],
                       masked_lm_ids=rows["masked_lm_ids"][:, :20])
    with caplog.at_level(logging.WARNING, logger="workflow.train.masking"):
        narrow = masker(narrow_rows, 0, 0, np.arange(64))
    cut = int((wide["masked_lm_positions"][:, 20:] > 0).sum())
    assert cut > 0
    assert f"0 over max_predictions_per_seq 72, {cut} over the packed rows' prediction width 20" in caplog.text
    np.testing.assert_array_equal(narrow["masked_lm_positions"], wide["masked_lm_positions"][:, :20])
    rows_cut, columns = np.nonzero(wide["masked_lm_positions"][:, 20:] > 0)
    restored = wide["input_ids"].copy()
    restored[rows_cut, wide["masked_lm_positions"][:, 20:][rows_cut, columns]] = \
        wide["masked_lm_ids"][:, 20:][rows_cut, columns]
    np.testing.assert_array_equal(narrow["input_ids"], restored)


@pytest.mark.parametrize("override, message", [
    ({"masking_rule": "per_token", "masked_lm_prob": 0.3},
     "config key 'encode.phase1.max_predictions_per_seq': 20 would cut per_token masks (about 38 of 128 tokens at "
     "masked_lm_prob 0.3); at least 72, or null to derive it"),
    ({"phase2": {"max_seq_length": 64, "max_predictions_per_seq": 80}},
     "config key 'encode.phase2.max_predictions_per_seq': 80 exceeds encode.phase2.max_seq_length (64)"),
    ({"masking_rule": "per_token", "phase1": {"max_seq_length": 128, "max_predictions_per_seq": None},
      "phase2": {"max_seq_length": 512, "max_predictions_per_seq": None}}, None),
])
def test_encode_settings_that_do_not_fit_are_one_line_naming_the_key(override, message):
    config = load_config(REPO / "config.yaml")
    config["encode"].update(override)
    assert encode_config_error(config) == message


def test_masking_rule_and_held_out_rate_change_the_encode_jobs_params_only_where_set():
    """Snakemake reruns a job whose params changed: NVIDIA's recipe keeps its command line."""
    config = load_config(REPO / "config.yaml")
    namespace = {"config": config}
    exec((REPO / "rules/functions/encode.smk").read_text(), namespace)
    default = (namespace["masking_arguments"](None), namespace["packing_arguments"](None))
    assert default == ("--no-whole-word-masking", "--packing --max-sequences-per-pack 3 --pack-algorithm gapfill")
    config["encode"]["masking_rule"] = "per_token"
    assert namespace["masking_arguments"](None) == "--no-whole-word-masking --masking-rule per_token"
    config["encode"].update(eval_masked_lm_prob=0.2, objective="documents")
    assert namespace["masking_arguments"](None) == ("--no-whole-word-masking --objective documents --masking-rule "
                                                    "per_token --eval-masked-lm-prob 0.2")
    assert namespace["packing_arguments"](None).endswith(" --packed-version 2")


def test_a_change_of_masking_rule_reruns_the_encode_jobs_and_nothing_else(tmp_path):
    """Built by NVIDIA's recipe, then masking_rule per_token: Snakemake plans the encode and hdf5_dir jobs again
    (their params changed), not the tokenize or vocab ones, and the shards record the rule and the derived cap."""
    from tests.test_encode import make_workdir, snakemake, tokenized_shard

    (tmp_path / "vocab").mkdir()
    vocab = tokenized_shard(tmp_path / "vocab", n_documents=50, vocab_size=300, seed=1)[0]
    make_workdir(tmp_path / "w", vocab)
    assert snakemake(tmp_path / "w", "--cores", "1", "data/hdf5_seq64").returncode == 0
    config = tmp_path / "w" / "test-config.yaml"
    config.write_text(config.read_text().replace(
        "encode: {dupe_factor: 2, phase1: {max_seq_length: 64, max_predictions_per_seq: 10}}",
        "encode: {dupe_factor: 2, masking_rule: per_token, masked_lm_prob: 0.3,"
        " phase1: {max_seq_length: 64, max_predictions_per_seq: null}, phase2: {max_predictions_per_seq: null}}"))
    plan = snakemake(tmp_path / "w", "--dry-run", "data/hdf5_seq64")
    assert plan.returncode == 0, plan.stderr[-3000:]
    jobs = dict(re.findall(r"^(\w+)\s+(\d+)$", plan.stdout.split("Job stats:")[-1], flags=re.M))
    assert jobs == {"encode": "4", "hdf5_dir": "1", "total": "5"}, plan.stdout
    assert snakemake(tmp_path / "w", "--cores", "1", "data/hdf5_seq64").returncode == 0
    manifest = json.loads((tmp_path / "w" / "data" / "hdf5_seq64" / "manifest.json").read_text())
    settings = manifest["settings"]
    assert (settings["masking_rule"], settings["max_predictions_per_seq"], settings["eval_masked_lm_prob"]) == (
        "per_token", 48, 0.15)  # 64 x 0.3 + 6 sd = 41.2, up to a multiple of 8


# Written by the encoder that built every instance at full length before packing (commit 58df03e), on the sample at
# 8,192 tokens: instances kept at their real lengths give the same files.
AT_8192_BEFORE_RAGGED = {
    "per_token documents dynamic": {(None, "training"): "abceb50b6156f164", (None, "test"): "3c815669ce4e7839",
                                    (16, "training"): "d92e99d88714b434", (16, "test"): "c674d180245fbaac"},
    "per_token documents static": {(None, "training"): "f6f614f7064da208", (None, "test"): "700a8a11941954ce",
                                   (16, "training"): "14878b5e5585aeda", (16, "test"): "ae76cd0f22b5d05a"},
    "google full_sentences dynamic": {(None, "training"): "13efab6db604a30b", (None, "test"): "23866d08bd4eb689",
                                      (16, "training"): "5a387eda839632a4", (16, "test"): "48489f21cf00fb1f"},
    "google nsp static": {(None, "training"): "a8e2d78726f55b8a", (None, "test"): "5cac98e30b769c20",
                          (16, "training"): "1d37dd6aafa041fc", (16, "test"): "d65c3f4be5f35a8d"},
}


@pytest.mark.parametrize("cell", sorted(AT_8192_BEFORE_RAGGED))
def test_shards_at_8192_tokens_keep_the_bytes_of_full_length_instances(sample, cell):
    rule, objective, masking = cell.split()
    p = 0.3 if rule == "per_token" else 0.15
    digests = {}
    for packing in (None, 16):
        for split in ("training", "test"):
            path, _ = encoded(sample, f"at_8192_{cell.replace(' ', '_')}_{packing}", split,
                              PackSettings(packing) if packing else None, max_seq_length=8192, masked_lm_prob=p,
                              dupe_factor=2, masking_rule=rule, objective=objective, masking=masking,
                              max_predictions_per_seq=derived_max_predictions(8192, rule, (p, 0.15)))
            digests[packing, split] = content_digest(path)
    assert digests == AT_8192_BEFORE_RAGGED[cell]
