"""Masking at load time (config encode.masking: dynamic): the loader draws each sequence's masks as it reads it.

The files then hold unmasked rows (workflow.data.encode, masked_lm_* all zero) and what the masker needs: the
settings as root attributes and the vocab's "##" continuation table (dataset `continues_word`, for whole-word
masking); [CLS]/[SEP] are found by their ids, the padding by the root attribute pad_id (absent: 0, BERT's [PAD];
workflow.data.hdf5.pad_attributes). Whatever the files hold, the masker never picks the padding, [CLS], [SEP] or
[MASK] as a candidate: only text is predicted (a text token with id 0 too, where the padding id is another). The
rule is encode's own (workflow.data.masking_rule.mask_rows: Google's create_pretraining_data.py, or per_token), so dynamic masks have the statistics of static ones (tests/test_masking.py).
A test shard (root attribute `split`) is masked at the held-out probability (`eval_masked_lm_prob` where the file
names one). Under per_token, a sequence's draws beyond max_predictions_per_seq and a packed row's predictions beyond
the file's prediction width (~1e-9 of rows where the cap is derived) are not made: the tokens stay as they were, and
a warning counts them by reason.

The random numbers are counter-based: each is a hash (SplitMix64's finaliser) of (seed, epoch, shard, instance,
stream, column), so a sequence's masks depend on its identity in its shard (the instance), the epoch and the columns
of its row that it occupies: the same on any number of ranks or loader workers, after a resume, and across reruns.
They are not the same for a sequence packed and unpacked (it starts at another column), only alike in their
statistics. Vectorised over a whole read: each sequence is masked in the window of its row that holds it, so the
work follows the real tokens, not slots x length; the rare sequence whose masks the order of equal keys decides is
masked on a full-length copy of its row, as every sequence once was, so the masks stay what they were.

API:
    LoadTimeMasker.of_shard(path, seed) -> masker or None (a static shard)
    masker(arrays, epoch, shard, rows) -> arrays with input_ids masked and masked_lm_positions / masked_lm_ids filled
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import logging

import h5py
import numpy as np

from workflow.data.hdf5 import pad_id_of
from workflow.data.masking_rule import EncodeSettings, Vocab, mask_rows, word_index

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
    (keys[i], stream, j), so it does not depend on the other rows of the read. `first_columns` [N], when given, says
    row i is a window of its sequence's row starting at that column: the "keys" stream (one key per token) is then
    the row's own from that column on. The last keys drawn stay in `drawn_keys`."""

    def __init__(self, keys: np.ndarray, first_columns: np.ndarray | None = None):
        self.row_keys = keys[:, None]
        self.first_columns = first_columns
        self.drawn_keys: np.ndarray | None = None

    def _bits(self, stream: str, shape, first_columns: np.ndarray | None = None) -> np.ndarray:
        column = np.arange(shape[1], dtype=np.uint64)[None, :] + np.uint64(STREAMS[stream] << 32)
        if first_columns is not None:
            column = column + first_columns.astype(np.uint64)[:, None]
        with np.errstate(over="ignore"):
            return _mix(self.row_keys ^ _mix(column * GOLDEN))

    def keys(self, shape) -> np.ndarray:
        self.drawn_keys = (self._bits("keys", shape, self.first_columns) >> np.uint64(40)).astype(np.float32) * \
            np.float32(2.0**-24)
        return self.drawn_keys

    def fractions(self, shape) -> np.ndarray:
        return (self._bits("fractions", shape) >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)

    def tokens(self, where: np.ndarray, vocab_size: int) -> np.ndarray:
        return (self._bits("tokens", where.shape)[where] % np.uint64(vocab_size)).astype(np.int64)


def sequence_spans(sequence: np.ndarray, slots: int) -> tuple[np.ndarray, ...]:
    """(row, number, first, stop, n_tokens) [K] of each sequence of the rows whose cells `sequence` [B, L] numbers
    1..slots (0 = padding): its cells lie in columns [first, stop), n_tokens of them. O(cells), whatever the slots."""
    n_rows, length = sequence.shape
    number = sequence.astype(np.int64)
    change = np.ones(number.shape, bool)
    change[:, 1:] = number[:, 1:] != number[:, :-1]
    rows, columns = np.nonzero(change)  # runs of equal numbers, row-major
    ends = np.append(columns[1:], length)
    ends[np.append(rows[1:] != rows[:-1], True)] = length  # a row's last run ends at the row's end
    values = number[rows, columns]
    run = (values >= 1) & (values <= slots)
    rows, columns, ends, values = rows[run], columns[run], ends[run], values[run]
    key = rows * slots + values - 1
    first = np.full(n_rows * slots, length, np.int64)
    stop = np.zeros(n_rows * slots, np.int64)
    n_tokens = np.zeros(n_rows * slots, np.int64)
    np.minimum.at(first, key, columns)
    np.maximum.at(stop, key, ends)
    np.add.at(n_tokens, key, ends - columns)
    present = np.flatnonzero(n_tokens)
    return present // slots, present % slots + 1, first[present], stop[present], n_tokens[present]


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
                      continues, pad_id_of(attributes))
        return cls(settings, vocab, int(attributes["seed"]) if seed is None else seed)

    def __call__(self, arrays: dict[str, np.ndarray], epoch: int, shard: int, rows: np.ndarray) -> dict[str, np.ndarray]:
        """`arrays` (the file rows `rows` of shard number `shard`, either layout) with every sequence masked: each
        sequence is masked as a row of its own, the window of its row that holds it (widths rounded up to powers of
        two, so the work follows the real tokens, not slots x length), then the rows put back together."""
        input_ids, sequence = arrays["input_ids"], arrays["input_mask"]
        n_rows, length = input_ids.shape
        instances = arrays["instance_index"] if "instance_index" in arrays else np.asarray(rows)[:, None]
        row, number, first, stop, n_tokens = sequence_spans(sequence, instances.shape[1])
        keys = sequence_keys(self.seed, epoch, shard, instances[row, number - 1])
        # A window starts a cell early: its column 0 (never a candidate) is "no prediction" in mask_rows' output.
        start = np.maximum(first - 1, 0)
        widths = np.minimum(length, 2 ** np.ceil(np.log2(np.maximum(stop - start, 16))).astype(np.int64))
        found, order_dependent, drawn = [], [], np.zeros(len(row), np.int64)
        for width in np.unique(widths).tolist():
            chosen = np.flatnonzero(widths == width)
            columns = start[chosen, None] + np.arange(width)
            inside = columns < length
            columns = np.minimum(columns, length - 1)
            at = row[chosen, None]
            ids = input_ids[at, columns]
            candidate = ((sequence[at, columns] == number[chosen, None]) & inside
                         & ~np.isin(ids, self.vocab.never_masked))
            settings = replace(self.settings, max_predictions_per_seq=min(self.settings.max_predictions_per_seq, width))
            draws = KeyedDraws(keys[chosen], None if settings.whole_word_masking else start[chosen])
            # Words are read from the ids before they are masked.
            word = np.maximum(word_index(ids, candidate, self.vocab), 0) if settings.whole_word_masking else None
            positions, labels = mask_rows(ids, candidate, n_tokens[chosen], settings, self.vocab, draws)
            dependent, drawn[chosen] = self._order_dependent(candidate, word, n_tokens[chosen], positions,
                                                             draws.drawn_keys, settings)
            order_dependent.append(chosen[dependent])
            keep = ~dependent[:, None] & (positions > 0)
            at_row, at_column = np.nonzero(keep)
            found.append((chosen[at_row], start[chosen][at_row] + positions[keep], labels[keep],
                          ids[at_row, positions[keep]]))
        found.append(self._mask_whole_rows(input_ids, sequence, row, number, n_tokens, keys,
                                           np.concatenate(order_dependent or [np.zeros(0, np.int64)])))
        owner, positions, labels, new_ids = (np.concatenate(part) for part in zip(*found))
        # Each row's predictions ascending (0 = empty), cut to the file's prediction width.
        order = np.lexsort((positions, row[owner]))
        owner, positions, labels, new_ids = owner[order], positions[order], labels[order], new_ids[order]
        owner_row = row[owner]
        rank = np.arange(len(owner_row)) - np.searchsorted(owner_row, owner_row)
        width = min(arrays["masked_lm_positions"].shape[1], instances.shape[1] * self.settings.max_predictions_per_seq)
        cut = rank >= width
        masked = input_ids.copy()
        masked[owner_row[~cut], positions[~cut]] = new_ids[~cut]
        over_cap = int((drawn - np.bincount(owner, minlength=len(row))).sum()) \
            if self.settings.masking_rule == "per_token" else 0
        if over_cap or cut.any():  # per_token only (google's count fits the width): those tokens stay unmasked
            log.warning("shard %d, epoch %d: masks drawn but not made: %d over max_predictions_per_seq %d, %d over "
                        "the packed rows' prediction width %d", shard, epoch, over_cap,
                        self.settings.max_predictions_per_seq, int(cut.sum()), width)
        out = dict(arrays)
        out["input_ids"] = masked
        out["masked_lm_positions"] = np.zeros((n_rows, width), np.int32)
        out["masked_lm_ids"] = np.zeros((n_rows, width), np.int32)
        out["masked_lm_positions"][owner_row[~cut], rank[~cut]] = positions[~cut]
        out["masked_lm_ids"][owner_row[~cut], rank[~cut]] = labels[~cut]
        return out

    @staticmethod
    def _order_dependent(candidate: np.ndarray, word: np.ndarray | None, n_tokens: np.ndarray, positions: np.ndarray,
                         keys: np.ndarray, settings: EncodeSettings) -> tuple[np.ndarray, np.ndarray]:
        """([N] bool, [N] int): of the windows masked by mask_rows (`word`: each candidate's word, with whole-word
        masking), those whose masks the order of equal keys decides, and per_token's draws of each. Equal float32
        keys are ordered by numpy's partition and sort, whose order depends on the whole row: such a sequence is
        masked again on its whole row (_mask_whole_rows), as the masker always did. Where the order decides: google's
        tie at its count's threshold, a whole word tied with another before the greedy stops, and per_token's draws
        beyond the cap."""
        valid = positions > 0
        n_valid = valid.sum(axis=1)
        rows = np.arange(len(candidate))[:, None]
        p = settings.masked_lm_prob
        if settings.whole_word_masking:
            n_words = np.where(candidate, word + 1, 0).max(axis=1, initial=0)
        if settings.masking_rule == "per_token":
            drawn_key = keys[rows, word] if settings.whole_word_masking else keys
            drawn = (candidate & (drawn_key < p)).sum(axis=1)
            return drawn > settings.max_predictions_per_seq, drawn
        none = np.zeros(len(candidate), np.int64)
        if not settings.whole_word_masking:  # a candidate not chosen whose key equals the last chosen one's
            threshold = np.where(valid, keys[rows, positions], -1.0).max(axis=1, initial=-1.0)
            return (candidate & (keys <= threshold[:, None])).sum(axis=1) > n_valid, none
        n_to_predict = np.minimum(settings.max_predictions_per_seq, np.maximum(1, np.rint(n_tokens * p)))
        taken = np.where(valid, keys[rows, word[rows, positions]], -1.0).max(axis=1, initial=-1.0)
        # A full row's greedy stops at its last word taken; one not full went through every word.
        examined = np.where(n_valid >= n_to_predict, taken, 2.0)
        real = (np.arange(keys.shape[1]) < n_words[:, None]) & (keys <= examined[:, None])
        ranked = np.sort(np.where(real, keys, np.nan).astype(np.float64), axis=1)
        return (ranked[:, 1:] == ranked[:, :-1]).any(axis=1), none

    def _mask_whole_rows(self, input_ids: np.ndarray, sequence: np.ndarray, row: np.ndarray, number: np.ndarray,
                         n_tokens: np.ndarray, keys: np.ndarray, which: np.ndarray) -> tuple[np.ndarray, ...]:
        """(owner, positions, labels, new ids) of the sequences `which` masked on full-length copies of their rows,
        as one read of the rows always did: with one row more that sets google's partition to the read's largest
        count (the count of a slot that holds no sequence, 1, is never the largest)."""
        if not len(which):
            empty = np.zeros(0, np.int64)
            return empty, empty, empty, empty
        ids = np.concatenate([input_ids[row[which]], np.zeros((1, input_ids.shape[1]), input_ids.dtype)])
        candidate = np.zeros(ids.shape, bool)
        candidate[:-1] = (sequence[row[which]] == number[which, None]) & ~np.isin(ids[:-1], self.vocab.never_masked)
        counts = np.append(n_tokens[which], n_tokens.max())
        positions, labels = mask_rows(ids, candidate, counts, self.settings, self.vocab,
                                      KeyedDraws(np.append(keys[which], np.uint64(0))))
        positions, labels = positions[:-1], labels[:-1]
        keep = positions > 0
        at_row, _ = np.nonzero(keep)
        return which[at_row], positions[keep], labels[keep], ids[at_row, positions[keep]]
