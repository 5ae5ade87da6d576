"""Masking at load time (config encode.masking: dynamic): the loader draws each sequence's masks as it reads it.

The files then hold unmasked rows (workflow.data.encode, masked_lm_* all zero) and what the masker needs: the
settings as root attributes and the vocab's "##" continuation table (dataset `continues_word`, for whole-word
masking); [CLS]/[SEP] are found by their ids. Whatever the files hold, the masker never picks the padding (id 0,
[PAD]), [CLS], [SEP] or [MASK] as a candidate: only text is predicted. The rule is encode's own (workflow.data.masking_rule.mask_rows: Google's
create_pretraining_data.py, or per_token), so dynamic masks have the statistics of static ones (tests/test_masking.py).
A test shard (root attribute `split`) is masked at the held-out probability (`eval_masked_lm_prob` where the file
names one). Under per_token, a sequence's draws beyond max_predictions_per_seq and a packed row's predictions beyond
the file's prediction width (~1e-9 of rows where the cap is derived) are not made: the tokens stay as they were, and
a warning counts them by reason.

The random numbers are counter-based: each is a hash (SplitMix64's finaliser) of (seed, epoch, shard, instance,
stream, column), so a sequence's masks depend on nothing but its identity and the epoch: the same on any number of
ranks or loader workers, after a resume, and across reruns. Vectorised over a whole read of rows.

API:
    LoadTimeMasker.of_shard(path, seed) -> masker or None (a static shard)
    masker(arrays, epoch, shard, rows) -> arrays with input_ids masked and masked_lm_positions / masked_lm_ids filled
"""
from __future__ import annotations

from dataclasses import dataclass

import logging

import h5py
import numpy as np

from workflow.data.masking_rule import EncodeSettings, Vocab, mask_rows

log = logging.getLogger(__name__)

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
STREAMS = {"keys": 0, "fractions": 1, "tokens": 2}


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijection of uint64 whose outputs pass BigCrush for counter inputs."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sequence_keys(seed: int, epoch: int, shard: int, instances: np.ndarray) -> np.ndarray:
    """[N] uint64: one key per sequence, from (seed, epoch, shard, instance index)."""
    with np.errstate(over="ignore"):
        key = _mix(np.uint64(seed) + GOLDEN)
        key = _mix(key + np.uint64(epoch) * GOLDEN)
        key = _mix(key + np.uint64(shard) * GOLDEN)
        return _mix(key + instances.astype(np.uint64) * GOLDEN)


class KeyedDraws:
    """mask_rows' random numbers for rows of sequences with `keys` [N]: element [i, j] of a stream is a hash of
    (keys[i], stream, j), so it does not depend on the other rows of the read."""

    def __init__(self, keys: np.ndarray):
        self.row_keys = keys[:, None]

    def _bits(self, stream: str, shape) -> np.ndarray:
        column = np.arange(shape[1], dtype=np.uint64)[None, :] + np.uint64(STREAMS[stream] << 32)
        with np.errstate(over="ignore"):
            return _mix(self.row_keys ^ _mix(column * GOLDEN))

    def keys(self, shape) -> np.ndarray:
        return (self._bits("keys", shape) >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)

    def fractions(self, shape) -> np.ndarray:
        return (self._bits("fractions", shape) >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)

    def tokens(self, where: np.ndarray, vocab_size: int) -> np.ndarray:
        return (self._bits("tokens", where.shape)[where] % np.uint64(vocab_size)).astype(np.int64)


@dataclass(frozen=True)
class LoadTimeMasker:
    settings: EncodeSettings
    vocab: Vocab
    seed: int

    @classmethod
    def of_shard(cls, path: str, seed: int | None = None) -> "LoadTimeMasker | None":
        """The masker of a dynamic shard (keyed by `seed`, default the encode seed), None for a static one."""
        with h5py.File(path, "r") as handle:
            attributes = dict(handle.attrs)
            if attributes.get("masking", "static") != "dynamic":
                return None
            continues = handle["continues_word"][()].astype(bool)
        masked_lm_prob = float(attributes["masked_lm_prob"])
        if attributes.get("split") == "test":  # the held-out set's own probability
            masked_lm_prob = float(attributes.get("eval_masked_lm_prob", masked_lm_prob))
        settings = EncodeSettings(
            max_seq_length=int(attributes["max_seq_length"]),
            max_predictions_per_seq=int(attributes["max_predictions_per_seq"]),
            masked_lm_prob=masked_lm_prob,
            whole_word_masking=bool(attributes["whole_word_masking"]),
            masking="dynamic", masking_rule=str(attributes.get("masking_rule", "google")))
        vocab = Vocab(len(continues), int(attributes["cls_id"]), int(attributes["sep_id"]), int(attributes["mask_id"]),
                      continues)
        return cls(settings, vocab, int(attributes["seed"]) if seed is None else seed)

    @property
    def special_ids(self) -> np.ndarray:
        """Ids never masked: the padding (0, [PAD] in BERT's vocab), [CLS], [SEP], [MASK] ([UNK] is text)."""
        return np.array([0, self.vocab.cls, self.vocab.sep, self.vocab.mask])

    def __call__(self, arrays: dict[str, np.ndarray], epoch: int, shard: int, rows: np.ndarray) -> dict[str, np.ndarray]:
        """`arrays` (the file rows `rows` of shard number `shard`, either layout) with every sequence masked: each sequence's cells are
        masked as a row of its own, then the rows put back together."""
        input_ids, sequence = arrays["input_ids"], arrays["input_mask"].astype(np.int64)
        n_rows, length = input_ids.shape
        packed = "instance_index" in arrays
        instances = arrays["instance_index"] if packed else np.asarray(rows)[:, None]
        slots = instances.shape[1]
        owned = sequence[:, None, :] == np.arange(1, slots + 1)[None, :, None]  # [B, S, L]
        ids = np.broadcast_to(input_ids[:, None, :], owned.shape).reshape(-1, length).copy()
        owned = owned.reshape(-1, length)
        candidate = owned & ~np.isin(ids, self.special_ids)
        n_tokens = owned.sum(axis=1)
        draws = KeyedDraws(sequence_keys(self.seed, epoch, shard, instances.reshape(-1)))
        counts = {"masks_over_cap": 0}
        positions, labels = mask_rows(ids, candidate, n_tokens, self.settings, self.vocab, draws, counts)
        masked = np.take_along_axis(ids.reshape(n_rows, slots, length), np.maximum(sequence - 1, 0)[:, None, :],
                                    axis=1)[:, 0]
        positions, labels = positions.reshape(n_rows, -1), labels.reshape(n_rows, -1)
        # Each row's predictions first, ascending (0 = empty), cut to the file's prediction width.
        order = np.argsort(np.where(positions > 0, positions, length), axis=1, kind="stable")
        width = arrays["masked_lm_positions"].shape[1]
        positions, labels = np.take_along_axis(positions, order, axis=1), np.take_along_axis(labels, order, axis=1)
        cut_rows, cut_columns = np.nonzero(positions[:, width:] > 0)
        if len(cut_rows):  # per_token only (google's count fits the width): those tokens stay unmasked
            cut_positions = positions[cut_rows, width + cut_columns]
            masked[cut_rows, cut_positions] = labels[cut_rows, width + cut_columns]
        if counts["masks_over_cap"] or len(cut_rows):
            log.warning("shard %d, epoch %d: masks drawn but not made: %d over max_predictions_per_seq %d, %d over "
                        "the packed rows' prediction width %d", shard, epoch, counts["masks_over_cap"],
                        self.settings.max_predictions_per_seq, len(cut_rows), width)
        out = dict(arrays)
        out["input_ids"] = np.where(sequence > 0, masked, input_ids).astype(input_ids.dtype)
        out["masked_lm_positions"] = positions[:, :width].astype(np.int32)
        out["masked_lm_ids"] = labels[:, :width].astype(np.int32)
        return out
