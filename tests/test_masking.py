"""Masking at load time (encode.masking: dynamic): the files hold the unmasked rows of the static recipe, the loader
draws Google's masks with the statistics of static ones, keyed by (seed, epoch, shard, instance) only."""
import pickle
import shutil
from dataclasses import replace

import h5py
import numpy as np
import pytest
import torch

from tests.fixtures.real_shaped_text import tokenized_sample
from workflow.data.encode import EncodeSettings, Vocab, encode_shard
from workflow.data.pack import PackSettings
from workflow.train.masking import LoadTimeMasker
from workflow.train.pretraining_data import PretrainingSequences, list_shards

RECIPE = dict(max_seq_length=128, max_predictions_per_seq=20, dupe_factor=10)


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    """The sample dump tokenized: (directory, vocab path, tokenized shard, Vocab)."""
    root = tmp_path_factory.mktemp("masking")
    vocab, tokenized = tokenized_sample(root)
    return root, vocab, tokenized, Vocab.read(vocab)


def encoded(sample, name, packing=None, **settings):
    root, vocab, tokenized, _ = sample
    path = root / name / "training" / "shard_0.hdf5"
    path.parent.mkdir(parents=True, exist_ok=True)
    encode_shard(tokenized, vocab, path, EncodeSettings(**settings), seed=12345, split="training", shard_index=0,
                 packing=packing)
    with h5py.File(path, "r") as handle:
        return path, {name: handle[name][()] for name in handle}


def mask_statistics(arrays: dict, vocab: Vocab) -> dict:
    """Counts of the masks of unpacked rows: predictions, their 80/10/10 outcome, position, whole-word groups."""
    positions, labels, ids = arrays["masked_lm_positions"], arrays["masked_lm_ids"], arrays["input_ids"]
    valid = positions > 0
    rows = np.nonzero(valid)[0]
    now, label = ids[rows, positions[valid]], labels[valid]
    n_tokens = arrays["input_mask"].sum(axis=1)
    masked = np.zeros(ids.shape, bool)
    masked[rows, positions[valid]] = True
    original = ids.copy()
    original[rows, positions[valid]] = label
    ordinary = (arrays["input_mask"] > 0) & ~np.isin(original, [vocab.cls, vocab.sep])
    continues = vocab.continues_word[original] & ordinary
    return {"predictions": valid.sum(axis=1), "expected": np.minimum(20, np.maximum(1, np.rint(n_tokens * 0.15))),
            "n": len(label), "tokens": int(n_tokens.sum()), "mask": int((now == vocab.mask).sum()),
            "same": int((now == label).sum()), "relative_position": positions[valid] / n_tokens[rows],
            "continuation": int(continues[masked].sum()),
            "split_words": int((masked[:, :-1] != masked[:, 1:])[continues[:, 1:] & ordinary[:, :-1]].sum())}


def loaded(path, epochs, seed=7) -> dict:
    """The file's rows masked by the loader in each of `epochs`, concatenated."""
    with h5py.File(path, "r") as handle:
        rows = {name: handle[name][()] for name in ("input_ids", "input_mask", "masked_lm_positions", "masked_lm_ids")}
    masker = LoadTimeMasker.of_shard(str(path), seed)
    parts = [masker(rows, epoch, 0, np.arange(len(rows["input_ids"]))) for epoch in range(epochs)]
    return {name: np.concatenate([part[name] for part in parts]) for name in rows}


def close(a: int, n_a: int, b: int, n_b: int) -> bool:
    """Two binomial shares equal within 4 standard errors of their difference (false alarm ~6e-5)."""
    pooled = (a + b) / (n_a + n_b)
    return abs(a / n_a - b / n_b) < 4 * np.sqrt(pooled * (1 - pooled) * (1 / n_a + 1 / n_b))


def test_a_dynamic_file_holds_the_static_files_rows_unmasked_and_no_predictions(sample):
    _, static = encoded(sample, "static", **RECIPE)
    path, dynamic = encoded(sample, "dynamic", **RECIPE, masking="dynamic")
    original = static["input_ids"].copy()
    valid = static["masked_lm_positions"] > 0
    original[np.nonzero(valid)[0], static["masked_lm_positions"][valid]] = static["masked_lm_ids"][valid]
    assert np.array_equal(dynamic["input_ids"], original)
    for name in ("input_mask", "segment_ids", "next_sentence_labels"):
        assert np.array_equal(dynamic[name], static[name]), name
    assert not dynamic["masked_lm_positions"].any() and not dynamic["masked_lm_ids"].any()
    assert np.array_equal(dynamic["continues_word"].astype(bool), sample[3].continues_word)
    with h5py.File(path, "r") as handle:
        assert handle.attrs["masking"] == "dynamic" and handle.attrs["mask_id"] == sample[3].mask
    # Masks depend on the seed and the epoch; a rerun draws the same.
    masks = loaded(path, epochs=1, seed=7)
    assert np.array_equal(masks["input_ids"], loaded(path, epochs=1, seed=7)["input_ids"])
    assert not np.array_equal(masks["input_ids"], loaded(path, epochs=1, seed=8)["input_ids"])
    assert not np.array_equal(masks["input_ids"], loaded(path, epochs=2)["input_ids"][len(original):])


@pytest.mark.parametrize("whole_word_masking", [False, True], ids=["tokens", "whole_words"])
def test_dynamic_masks_have_the_statistics_of_static_masks_on_real_shaped_text(sample, whole_word_masking):
    settings = dict(RECIPE, whole_word_masking=whole_word_masking)
    _, static = encoded(sample, f"static_{whole_word_masking}", **settings)
    path, _ = encoded(sample, f"dynamic_{whole_word_masking}", **settings, masking="dynamic")
    vocab = sample[3]
    s, d = mask_statistics(static, vocab), mask_statistics(loaded(path, epochs=2), vocab)
    assert s["n"] > 30_000 and d["n"] > 60_000
    # Predictions per sequence: Google's count, exactly, both ways (so the masked fraction is the same too).
    assert np.array_equal(s["predictions"], s["expected"]) and np.array_equal(d["predictions"], d["expected"])
    assert s["n"] / s["tokens"] == pytest.approx(d["n"] / d["tokens"], abs=1e-12)
    assert close(s["mask"], s["n"], d["mask"], d["n"])  # 80% [MASK]
    assert close(s["same"], s["n"], d["same"], d["n"])  # 10% unchanged (+ random draws of the same token)
    assert close(s["n"] - s["mask"] - s["same"], s["n"], d["n"] - d["mask"] - d["same"], d["n"])  # 10% random
    assert abs(s["mask"] / s["n"] - 0.8) < 4 * np.sqrt(0.16 / s["n"])
    # Where in the sequence: the mean relative position within 4 standard errors.
    a, b = s["relative_position"], d["relative_position"]
    assert abs(a.mean() - b.mean()) < 4 * np.sqrt(a.var() / len(a) + b.var() / len(b))
    # Whole words: the share of "##" pieces among predictions alike, and never part of a word.
    assert close(s["continuation"], s["n"], d["continuation"], d["n"])
    if whole_word_masking:
        assert s["split_words"] == 0 and d["split_words"] == 0
        assert d["continuation"] > 0.1 * d["n"]  # real text: many words are several pieces
    else:
        assert d["split_words"] > 0


@pytest.fixture(scope="module")
def data_dirs(sample):
    """Dynamic data directories of the sample, unpacked and packed."""
    return {packed: encoded(sample, f"loader_{packed}", PackSettings() if packed else None, **RECIPE,
                            masking="dynamic")[0].parent.parent for packed in (False, True)}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def masks_alike_on_any_layout(shards):
    """Asserts a step's masks (across an epoch boundary) are the same after a resume, in a loader worker and on two
    ranks as on one; (sequences, start, count, the one rank's micro-batches)."""
    sequences = PretrainingSequences(shards, seed=7)
    start, count = sequences.epoch_length - 40, 96  # a step across the epoch boundary
    one_rank = sequences.micro_batches(start, count, 0, 1, 128)
    resumed = PretrainingSequences(shards, seed=7)  # a new process, as after a resume
    assert all(same(a, b) for a, b in zip(one_rank, resumed.micro_batches(start, count, 0, 1, 128)))
    worker = pickle.loads(pickle.dumps(sequences))
    assert same(sequences.read(start, count), worker.read(start, count))
    # Two ranks: their rows are the one rank's rows, masked alike.
    halves = [sequences.micro_batches(start, count, rank, 2, 128)[0] for rank in (0, 1)]
    n = [int((h["next_sentence_labels"].view(len(h["input_ids"]), -1) >= 0).any(1).sum()) for h in halves]
    for name in ("input_ids", "masked_lm_positions", "masked_lm_labels"):
        assert torch.equal(torch.cat([halves[0][name][:n[0]], halves[1][name][:n[1]]]),
                           one_rank[0][name][:n[0] + n[1]]), name
    return sequences, start, count, one_rank


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_a_sequences_masks_are_the_same_on_any_ranks_after_a_resume_and_in_a_worker(data_dirs, packed):
    shards = list_shards(data_dirs[packed], "training")
    sequences, start, count, _ = masks_alike_on_any_layout(shards)
    # The next epoch: other masks.
    epoch_later = sequences.read(start + sequences.epoch_length, count)
    assert not torch.equal(epoch_later["masked_lm_positions"], sequences.read(start, count)["masked_lm_positions"])


def test_a_data_directory_mixing_static_and_dynamic_shards_is_refused(sample, data_dirs, tmp_path):
    from workflow.cli import UserError

    mixed = tmp_path / "mixed" / "training"
    mixed.mkdir(parents=True)
    shutil.copy(data_dirs[False] / "training" / "shard_0.hdf5", mixed / "a.hdf5")
    shutil.copy(encoded(sample, "static_for_mix", **RECIPE)[0], mixed / "b.hdf5")
    with pytest.raises(UserError, match=r"b\.hdf5: masking/objective static/nsp, but .*a\.hdf5 has dynamic/nsp; "
                                        r"one data directory holds one recipe"):
        list_shards(mixed.parent, "training")


def test_packing_a_dynamic_file_keeps_what_its_masker_needs(sample, tmp_path):
    from workflow.data.pack import pack_shard

    path, _ = encoded(sample, "to_pack", **RECIPE, masking="dynamic")
    pack_shard(path, tmp_path / "packed.hdf5")
    packed, unpacked = LoadTimeMasker.of_shard(str(tmp_path / "packed.hdf5")), LoadTimeMasker.of_shard(str(path))
    assert (packed.settings, packed.seed) == (unpacked.settings, unpacked.seed)
    assert (packed.vocab.size, packed.vocab.cls, packed.vocab.sep, packed.vocab.mask) == (
        unpacked.vocab.size, unpacked.vocab.cls, unpacked.vocab.sep, unpacked.vocab.mask)
    assert np.array_equal(packed.vocab.continues_word, sample[3].continues_word)


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("whole_word_masking", [False, True], ids=["tokens", "whole_words"])
def test_the_load_time_masker_never_picks_padding_or_a_special_token_whatever_the_file_holds(packed,
                                                                                           whole_word_masking):
    """Rows whose sequences hold [PAD]s (the defect of issue 37), stray [CLS]/[SEP]/[MASK]s and text: over many
    epochs every prediction is a text token, and every text token is predicted some time."""
    size, cls, sep, mask = 50, 2, 3, 4  # [PAD] 0, [UNK] 1 (text: it stands for a word)
    vocab = Vocab(size, cls, sep, mask, np.arange(size) % 3 == 0)
    masker = LoadTimeMasker(EncodeSettings(max_seq_length=32, max_predictions_per_seq=6, masking="dynamic",
                                           whole_word_masking=whole_word_masking), vocab, seed=3)
    rng = np.random.default_rng(0)
    input_ids = rng.integers(5, size, (64, 32)).astype(np.int32)
    input_ids[rng.random(input_ids.shape) < 0.05] = 1  # [UNK]
    specials = np.array([0, cls, sep, mask])
    stray = rng.random(input_ids.shape) < 0.25
    input_ids[stray] = specials[rng.integers(0, 4, int(stray.sum()))]
    input_ids[:, 0] = cls
    if packed:  # two sequences of 16 per row
        sequence = np.repeat(np.array([1, 2], np.int8), 16)[None, :].repeat(64, axis=0)
        input_ids[:, 16] = cls
        arrays = {"input_ids": input_ids, "input_mask": sequence,
                  "instance_index": np.arange(128, dtype=np.int32).reshape(64, 2),
                  "masked_lm_positions": np.zeros((64, 12), np.int32), "masked_lm_ids": np.zeros((64, 12), np.int32)}
    else:
        arrays = {"input_ids": input_ids, "input_mask": np.ones((64, 32), np.int8),
                  "masked_lm_positions": np.zeros((64, 6), np.int32), "masked_lm_ids": np.zeros((64, 6), np.int32)}
    picked = np.zeros(input_ids.shape, bool)
    for epoch in range(30):
        out = masker(arrays, epoch, 0, np.arange(64))
        rows, slots = np.nonzero(out["masked_lm_positions"])
        assert len(rows) > 0
        labels = out["masked_lm_ids"][rows, slots]
        assert not np.isin(labels, specials).any(), labels[np.isin(labels, specials)]
        np.testing.assert_array_equal(labels, input_ids[rows, out["masked_lm_positions"][rows, slots]])
        picked[rows, out["masked_lm_positions"][rows, slots]] = True
    text = ~np.isin(input_ids, specials)
    assert picked[text].mean() > 0.8 and not picked[~text].any()  # only text, and most of it in 30 epochs


def masks_on_slot_rows(masker: LoadTimeMasker, arrays: dict, epoch: int, shard: int, rows: np.ndarray) -> dict:
    """The masker as it was before it masked windows (frozen here as the reference): every slot of a read masked on
    a full-length copy of its row, in one mask_rows call."""
    from workflow.data.masking_rule import mask_rows
    from workflow.train.masking import KeyedDraws, sequence_keys

    input_ids, sequence = arrays["input_ids"], arrays["input_mask"].astype(np.int64)
    n_rows, length = input_ids.shape
    instances = arrays["instance_index"] if "instance_index" in arrays else np.asarray(rows)[:, None]
    slots = instances.shape[1]
    owned = sequence[:, None, :] == np.arange(1, slots + 1)[None, :, None]
    ids = np.broadcast_to(input_ids[:, None, :], owned.shape).reshape(-1, length).copy()
    owned = owned.reshape(-1, length)
    candidate = owned & ~np.isin(ids, masker.vocab.never_masked)
    draws = KeyedDraws(sequence_keys(masker.seed, epoch, shard, instances.reshape(-1)))
    positions, labels = mask_rows(ids, candidate, owned.sum(axis=1), masker.settings, masker.vocab, draws, {})
    masked = np.take_along_axis(ids.reshape(n_rows, slots, length), np.maximum(sequence - 1, 0)[:, None, :],
                                axis=1)[:, 0]
    positions, labels = positions.reshape(n_rows, -1), labels.reshape(n_rows, -1)
    order = np.argsort(np.where(positions > 0, positions, length), axis=1, kind="stable")
    width = arrays["masked_lm_positions"].shape[1]
    positions, labels = np.take_along_axis(positions, order, axis=1), np.take_along_axis(labels, order, axis=1)
    cut_rows, cut_columns = np.nonzero(positions[:, width:] > 0)
    masked[cut_rows, positions[cut_rows, width + cut_columns]] = labels[cut_rows, width + cut_columns]
    return {"input_ids": np.where(sequence > 0, masked, input_ids).astype(input_ids.dtype),
            "masked_lm_positions": positions[:, :width].astype(np.int32),
            "masked_lm_ids": labels[:, :width].astype(np.int32)}


@pytest.mark.parametrize("keys", ["keys", "tied_keys"])
@pytest.mark.parametrize("packing", [None, 3, 16], ids=["unpacked", "3_a_row", "16_a_row"])
@pytest.mark.parametrize("whole_word_masking", [False, True], ids=["tokens", "whole_words"])
@pytest.mark.parametrize("rule", ["google", "per_token", "per_token_capped"])
def test_the_masker_draws_the_masks_it_drew_on_full_length_copies_of_each_slots_row(sample, rule, whole_word_masking,
                                                                                   packing, keys, monkeypatch):
    """Each sequence masked in its own window of its row, not on a full-length copy of the row per slot: the same
    masks bit for bit, on shards of the sample (NSP pairs and documents, 128 and 512 tokens, either split), and with
    keys of 6 bits (`tied_keys`), where equal keys are common: google's count, whole words and per_token's draws
    beyond a small cap (`per_token_capped`) then depend on how the keys' ties are ordered, as they always did."""
    from workflow.data.masking_rule import derived_max_predictions
    from workflow.train.masking import KeyedDraws

    if keys == "tied_keys":
        bits = KeyedDraws._bits
        monkeypatch.setattr(KeyedDraws, "_bits", lambda self, stream, shape, first_columns=None: (
            bits(self, stream, shape, first_columns) & ~np.uint64((1 << 58) - 1) if stream == "keys"
            else bits(self, stream, shape, first_columns)))
    whole_rows, mask_whole_rows = [], LoadTimeMasker._mask_whole_rows
    monkeypatch.setattr(LoadTimeMasker, "_mask_whole_rows", lambda self, *args: (
        whole_rows.append(len(args[-1])) or mask_whole_rows(self, *args)))
    p = 0.15 if rule == "google" else 0.3
    compared = 0
    for length, objective, split in ((128, "nsp", "training"), (512, "documents", "training"),
                                     (128, "documents", "test")):
        cap = derived_max_predictions(length, rule.removesuffix("_capped"), (p, 0.15))
        path, _ = encoded(sample, f"windows_{rule}_{whole_word_masking}_{packing}_{length}_{objective}_{split}",
                          PackSettings(packing) if packing else None, max_seq_length=length, dupe_factor=1,
                          masked_lm_prob=p, max_predictions_per_seq=cap, masking="dynamic", objective=objective,
                          masking_rule=rule.removesuffix("_capped"), whole_word_masking=whole_word_masking)
        masker = LoadTimeMasker.of_shard(str(path), 11)
        if rule == "per_token_capped":
            masker = LoadTimeMasker(replace(masker.settings, max_predictions_per_seq=length // 16), masker.vocab, 11)
        with h5py.File(path, "r") as handle:
            arrays = {name: handle[name][()] for name in ("input_ids", "input_mask", "masked_lm_positions",
                                                          "masked_lm_ids", "instance_index") if name in handle}
        n = len(arrays["input_ids"])
        for epoch, (a, b) in ((0, (0, n)), (1, (n // 3, n // 3 + 17))):
            part = {name: values[a:b] for name, values in arrays.items()}
            new = masker(part, epoch, 4, np.arange(a, b))
            old = masks_on_slot_rows(masker, part, epoch, 4, np.arange(a, b))
            for name in old:
                np.testing.assert_array_equal(new[name], old[name], err_msg=f"{path} {name} epoch {epoch}")
            compared += int((old["masked_lm_positions"] > 0).sum())
    assert compared > 1000
    if rule == "per_token_capped" or (keys == "tied_keys" and rule == "google"):
        assert sum(whole_rows) > 0  # the sequences whose ties decide were masked on whole rows
