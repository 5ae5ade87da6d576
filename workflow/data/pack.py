"""Sequence packing: the instances of one encoded shard in fewer, fuller rows (Krell et al. 2021, arXiv 2107.02027).

The encode stage packs each shard as it writes it (config `encode.packing`, on by default): in memory, in the
instances' own, measured at ~0.04 CPU s per shard of a real run's size (94k instances at 128, 34k at 512), ~4% of
the unpacked encode job's CPU (noisy shared machine; fresh pages cost more than the copies, hence in place), where
a separate HDF5 -> HDF5 job costs about as much as encoding (I/O + gzip; see benchmarks/packing.py).
`python -m workflow.data.pack` packs an existing NVIDIA-schema shard the same way. The encoder hands its instances
over at their real lengths (RaggedInstances, pack_ragged: the same rows byte for byte as pack_arrays).

Histogram packing: the instance lengths of the shard form a histogram, and the packing is planned on the counts
per length, so its cost grows with the distinct pack layouts (hundreds), not with the instances; instances are then
assigned to the packs length by length, in file order. Algorithms (`algorithm`):
- gapfill (default): the longest instance left opens a pack, and the pair of instances left (else the single one)
  that fills its free space best completes it. Pairs win ties, so the short instances are spent filling gaps rather
  than left over to share rows of their own, which is where greedy packing loses most at 512 (most instances there
  are long or full, and the short ones are all the filler there is).
- lpfhp / spfhp: Krell et al.'s greedy: lengths longest first, each into the open pack it fits with the least free
  space (longest pack first) or the most.
On the demo sample 40 times over as one shard of a real run's size, with 3 per row: at 512 gapfill fills 99.6% of
the slots (lpfhp 97.0%, spfhp 96.8%; no packing can beat 99.8%, `fewest_packs`), at 128 all three fill 98.8% (bound
99.0%): the instances over half full there outnumber the short ones that could complete them
(benchmarks/packing.py).

Input: an encoded shard in NVIDIA's schema (workflow.data.encode). Output (root attributes `packing` = the
algorithm, `max_sequences_per_pack`, `packed_version` (workflow.data.hdf5.PACKED_VERSION) and the fill statistics of
`packing_stats`), padded (input_ids with the encoded shard's padding id, root attribute pad_id where it is not 0:
workflow.data.hdf5.pad_attributes; the rest with zeros), one row per pack of S = max_sequences_per_pack slots
(`auto`: as many as fit, sequence_slots):

    input_ids [R,L] int32, segment_ids [R,L] int8,
    input_mask [R,L] int8            sub-sequence number of each token, 1..S (0 = padding; > 0 = NVIDIA's mask;
                                     int16 where S > 127),
    position_ids [R,L] int16         restarting at 0 at each sub-sequence,
    cls_positions [R,S] int32        the [CLS] slot (= start) of each sub-sequence,
    sequence_lengths [R,S] int32     its length (0 = empty slot): sub-sequence s spans cls..cls+length,
    next_sentence_labels [R,S] int8  its NSP label (-1 = empty slot),
    instance_index [R,S] int32       its row in the encoded shard (-1 = empty slot),
    masked_lm_positions [R,W] int32  positions in the packed row, ascending (0 = empty slot: a [CLS] is never masked),
    masked_lm_ids [R,W] int32,

with W = min(S * max_predictions_per_seq, floor(masked_lm_prob * L) + S) under masking_rule google (encode predicts
at most max(1, rint(masked_lm_prob * n)) tokens of an instance of n tokens) and min(S * max_predictions_per_seq,
the derived cap of L tokens) under per_token (workflow.data.masking_rule: a row of L tokens draws more ~1e-9 of the
time; its last predictions are then unmasked, counted as masks_over_row_width, and the rest packed as they were).
Packs are ordered by their first instance's row, so the file keeps the encode stage's shuffled order. The whole
shard is held in memory (a shard is bounded by the shard stage's size). Every shard written is checked first
(check_packed): each sequence is its instance's tokens, [CLS] first and [SEP] last, with no padding or other special
token inside but [SEP] and masked cells.
"""
import argparse
import logging
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from workflow.cli import UserError, run
from workflow.data.hdf5 import PACKED, PACKED_VERSION, TABLES, pad_id_of, read_encoded, write_shard
from workflow.data.masking_rule import derived_max_predictions

log = logging.getLogger(__name__)

ALGORITHMS = ("gapfill", "lpfhp", "spfhp")
MAX_SEQUENCES_PER_PACK = 3  # the default: gapfill then reaches >= 99% fill at 512
AUTO = "auto"  # max_sequences_per_pack: as many instances as fit (sequence_slots)
SHORTEST_INSTANCE = 3  # [CLS] one token [SEP]: no objective writes a shorter instance
PACK_CHUNK_CELLS = 1 << 18  # cells moved at a time when packing in place: the block stays in cache


@dataclass(frozen=True)
class PackSettings:
    """Config `encode.packing` (when enabled)."""

    max_sequences_per_pack: int | str = MAX_SEQUENCES_PER_PACK  # or AUTO
    algorithm: str = "gapfill"

    def slots(self, max_seq_length: int) -> int:
        """Sequence slots of a row of `max_seq_length` tokens (sequence_slots)."""
        return sequence_slots(self.max_sequences_per_pack, max_seq_length)

    def attributes(self, max_seq_length: int) -> dict:
        """The packed file's root attributes saying how it was packed (the slot count, `auto` resolved)."""
        return {"packing": self.algorithm, "max_sequences_per_pack": self.slots(max_seq_length),
                "packed_version": PACKED_VERSION}


def sequence_slots(max_sequences_per_pack: int | str, max_seq_length: int) -> int:
    """The slots S of a packed row: `max_sequences_per_pack`, or for "auto" as many instances as can fit,
    max_seq_length // SHORTEST_INSTANCE (341 at 1,024, 2,730 at 8,192): one shape per length whatever the data,
    so every micro-batch of a phase has one shape, and the per-slot arrays stay ~13 bytes x S a row."""
    if max_sequences_per_pack == AUTO:
        return max_seq_length // SHORTEST_INSTANCE
    try:
        slots = int(max_sequences_per_pack)  # a command line's string too
    except (TypeError, ValueError):
        slots = 0
    if slots < 1 or isinstance(max_sequences_per_pack, (bool, float)):
        raise UserError(f"encode packing.max_sequences_per_pack {max_sequences_per_pack}: must be at least 1, "
                        f"or {AUTO}")
    return slots


def sequence_number_dtype(slots: int) -> type:
    """input_mask's type in packed rows: int8 (NVIDIA's) while the slot numbers fit it, else int16."""
    return np.int8 if slots <= np.iinfo(np.int8).max else np.int16


def packing_stats(lengths: np.ndarray, max_length: int, n_packs: int) -> dict:
    """Instances, packs, real tokens and the fill (real tokens / slots) packed and unpacked."""
    n_real = int(lengths.sum())
    return {"n_instances": len(lengths), "n_packs": n_packs, "n_real_tokens": n_real,
            "fill": n_real / max(1, n_packs * max_length), "fill_unpacked": n_real / max(1, len(lengths) * max_length)}


def histogram_packing(histogram: np.ndarray, max_length: int, max_sequences_per_pack: int,
                      algorithm: str = "gapfill") -> list[tuple[tuple[int, ...], int]]:
    """Histogram packing: [(lengths of one pack, how many such packs)], deterministic.

    `histogram[n]` counts the sequences of length n (1 <= n <= max_length). Every sequence is in exactly one pack,
    of at most `max_sequences_per_pack` sequences and `max_length` tokens. Algorithms: module docstring.
    """
    if algorithm not in ALGORITHMS:
        raise UserError(f"pack algorithm {algorithm!r}: must be one of {', '.join(ALGORITHMS)}")
    counts = np.zeros(max_length + 1, np.int64)
    counts[1 : len(histogram)] = np.asarray(histogram[1 : max_length + 1], np.int64)
    if algorithm == "gapfill":
        return _gap_fill(counts, max_length, max_sequences_per_pack)
    return _fit_decreasing(counts, max_length, max_sequences_per_pack, max if algorithm == "spfhp" else min)


def _gap_fill(counts: np.ndarray, max_length: int, max_sequences_per_pack: int) -> list[tuple[tuple[int, ...], int]]:
    """The longest sequence left opens a pack; the pair (else the one) of sequences left that fills its free space
    best completes it, pairs first, then the next pair in the space still free. Every pack of that layout that the
    counts still allow is taken at once, so the work grows with the distinct layouts, not with the sequences."""
    lengths = np.arange(max_length + 1)
    packs: list[tuple[tuple[int, ...], int]] = []
    for longest in range(max_length, 0, -1):
        while counts[longest]:
            counts[longest] -= 1
            members, space, free_slots = [longest], max_length - longest, max_sequences_per_pack - 1
            while free_slots and space:
                chosen = _best_fill(counts[: space + 1], 2 if free_slots >= 2 else 1, lengths[: space + 1])
                if not chosen:
                    break
                for length in chosen:
                    counts[length] -= 1
                members += chosen
                space -= sum(chosen)
                free_slots -= len(chosen)
            need = {length: members.count(length) for length in members}
            more = min(int(counts[length]) // times for length, times in need.items())
            for length, times in need.items():
                counts[length] -= more * times
            packs.append((tuple(members), more + 1))
    return packs


def _best_fill(counts: np.ndarray, most: int, lengths: np.ndarray) -> tuple[int, ...]:
    """The 1 or 2 (at most `most`) available lengths (counts[n] > 0) with the largest sum <= the last length; among
    equal sums a pair (short sequences are used up where they fit rather than left to fill packs of their own),
    then the more unequal pair. () when nothing fits."""
    available = counts > 0
    first = available.nonzero()[0]
    if not first.size:
        return ()
    if most == 1:
        return (int(first[-1]),)
    space = len(counts) - 1
    largest_up_to = np.maximum.accumulate(np.where(available, lengths, 0))  # [x]: largest available length <= x
    # The second is the largest available length <= min(space - first, first); equal to first only if two exist.
    second = largest_up_to[np.minimum(space - first, first)]
    lone = (second == first) & (counts[first] < 2)
    if lone.any():
        second[lone] = largest_up_to[first[lone] - 1]
    pick = np.argmax(((first + second) * 2 + (second > 0)) * len(counts) + first)
    return (int(first[pick]), int(second[pick])) if second[pick] else (int(first[pick]),)


def _fit_decreasing(counts: np.ndarray, max_length: int, max_sequences_per_pack: int,
                    choose) -> list[tuple[tuple[int, ...], int]]:
    """Lengths longest first, each into the open pack it fits with the least free space (choose=min, lpfhp) or the
    most (choose=max, spfhp)."""
    open_packs: dict[int, list[list]] = {}  # free space -> stack of [count, lengths]
    closed: list[tuple[tuple[int, ...], int]] = []

    def add(lengths: tuple[int, ...], count: int) -> None:
        space = max_length - sum(lengths)
        if space == 0 or len(lengths) == max_sequences_per_pack:
            closed.append((lengths, count))
        else:
            open_packs.setdefault(space, []).append([count, lengths])

    for length in range(max_length, 0, -1):
        remaining = int(counts[length])
        while remaining:
            fitting = [space for space in open_packs if space >= length]
            if not fitting:
                add((length,), remaining)
                break
            space = choose(fitting)
            stack = open_packs[space]
            group = stack[-1]
            used = min(group[0], remaining)
            group[0] -= used
            if group[0] == 0:
                stack.pop()
                if not stack:
                    del open_packs[space]
            add(group[1] + (length,), used)
            remaining -= used
    closed.extend((lengths, count) for stack in open_packs.values() for count, lengths in stack)
    return closed


def fewest_packs(histogram: np.ndarray, max_length: int, max_sequences_per_pack: int) -> int:
    """A lower bound on the packs any packing of `histogram` needs: one per sequence over half the length, plus what
    the shorter ones need beyond the free space of those; every threshold t gives a bound, since sequences of
    length >= t only fit where at least t is free. Also all tokens, and the cap of sequences per pack."""
    counts = np.zeros(max_length + 1, np.int64)
    counts[1 : len(histogram)] = np.asarray(histogram[1 : max_length + 1], np.int64)
    lengths = np.arange(max_length + 1)
    half = max_length // 2
    n_long = int(counts[half + 1 :].sum())
    # tokens of the short sequences of length >= t, and free space >= t in the packs of long ones, for t = 0..half
    short_tokens = np.cumsum((lengths * counts)[: half + 1][::-1])[::-1]
    free = np.zeros(max_length + 1, np.int64)
    free[max_length - lengths[half + 1 :]] = counts[half + 1 :]  # packs of long sequences by free space
    free_tokens = np.cumsum((lengths * free)[::-1])[::-1][: half + 1]
    overflow = int(np.max(short_tokens - free_tokens, initial=0))
    n_short = int(counts[: half + 1].sum())
    short_overflow = max(0, n_short - (max_sequences_per_pack - 1) * n_long)
    total = int((lengths * counts).sum())
    return max(n_long + max(-(-overflow // max_length), -(-short_overflow // max_sequences_per_pack)),
               -(-total // max_length), -(-(n_long + n_short) // max_sequences_per_pack))


def sequence_lengths_of(input_mask: np.ndarray, source: str = "input") -> np.ndarray:
    """Real tokens of each instance; they must be the row's leading cells (as encode writes them)."""
    real = input_mask.astype(bool, copy=False)
    bad = np.flatnonzero((real[:, 1:] > real[:, :-1]).any(axis=1) | ~real[:, 0])  # a 0 before a 1, or empty
    if len(bad):
        raise UserError(f"{source}: instance {int(bad[0])} does not hold its tokens at the start of the row "
                        f"(input_mask must be 1...1 0...0); not an encoded shard")
    return real.sum(axis=1)


def as_written_by_encode(arrays: dict[str, np.ndarray], source: str = "input") -> tuple[dict[str, np.ndarray],
                                                                                       np.ndarray]:
    """(arrays, instance lengths) of NVIDIA-schema `arrays` read from elsewhere, in the form pack_arrays takes:
    zeros beyond each instance's tokens (whatever the padding id) and after its predictions, which lead their row.
    pack_arrays copies whole rows, so what a file holds in those cells must not reach a pack."""
    lengths = sequence_lengths_of(arrays["input_mask"], source)
    arrays = dict(arrays)
    padding = ~arrays["input_mask"].astype(bool, copy=False)
    for name in ("input_ids", "segment_ids"):
        if arrays[name][padding].any():  # encode writes zeros there, but for a padding id other than 0
            arrays[name] = np.where(padding, 0, arrays[name])
    valid = arrays["masked_lm_positions"] > 0
    if (valid[:, 1:] > valid[:, :-1]).any():  # a prediction after an empty slot: move them to the front
        first = np.argsort(~valid, axis=1, kind="stable")
        valid = np.take_along_axis(valid, first, axis=1)
        arrays.update({name: np.take_along_axis(arrays[name], first, axis=1)
                       for name in ("masked_lm_positions", "masked_lm_ids")})
    for name in ("masked_lm_positions", "masked_lm_ids"):
        if arrays[name][~valid].any():
            arrays[name] = np.where(valid, arrays[name], 0)
    return arrays, lengths


def prediction_width(max_length: int, max_predictions_per_seq: int, masked_lm_prob: float,
                     max_sequences_per_pack: int, masking_rule: str = "google") -> int:
    """Prediction slots of a packed row (see the module docstring)."""
    if masking_rule == "per_token":
        row = derived_max_predictions(max_length, masking_rule, (masked_lm_prob,))  # the row's own binomial bound
    else:
        row = np.floor(masked_lm_prob * max_length) + max_sequences_per_pack
    return int(min(max_sequences_per_pack * max_predictions_per_seq, row))


def pack_members(lengths: np.ndarray, max_length: int, max_sequences_per_pack: int = MAX_SEQUENCES_PER_PACK,
                 algorithm: str = PackSettings.algorithm) -> np.ndarray:
    """[R, S] rows of the instances of each pack in slot order (-1 = empty slot), packs in file order (module
    docstring): each strategy of histogram_packing takes the next `count` instances (in file order) of every length
    it holds, slot by slot."""
    n, slots = len(lengths), sequence_slots(max_sequences_per_pack, max_length)
    histogram = np.bincount(lengths, minlength=max_length + 1)
    strategies = histogram_packing(histogram, max_length, slots, algorithm)
    n_packs = sum(count for _, count in strategies)
    by_length = np.argsort(lengths.astype(np.uint16), kind="stable")  # 16-bit keys: a radix sort
    cursor = (np.cumsum(histogram) - histogram).tolist()
    members = np.full((n_packs, slots), -1, np.int64)
    row = 0
    for pack_lengths, count in strategies:
        for slot, size in enumerate(pack_lengths):
            members[row : row + count, slot] = by_length[cursor[size] : cursor[size] + count]
            cursor[size] += count
        row += count
    # File order: by first instance row (column by column: few columns). Every instance is in one pack, so those rows
    # are unique and a counting sort orders them.
    first = members[:, 0].copy()
    for slot in range(1, slots):
        np.minimum(first, np.where(members[:, slot] >= 0, members[:, slot], n), out=first)
    pack_of_first = np.full(n, -1, np.int64)
    pack_of_first[first] = np.arange(n_packs)
    return members[pack_of_first[pack_of_first >= 0]]


def _add_windows(buffer: np.ndarray, row_width: int, packs: np.ndarray, starts: np.ndarray, values: np.ndarray) -> None:
    """Add `values` [k, w] to the windows at (packs[i], starts[i]) of the rows of `row_width` cells that `buffer`
    (flat) holds. A window may run on past its row into the next one, or past the last row into one more row of
    buffer: there it adds the zeros that end `values` rows. `packs` must not hold two neighbouring rows, so that
    no windows overlap: then the gather-add-scatter of numpy's `+=` does each window alone."""
    windows = np.lib.stride_tricks.sliding_window_view(buffer, values.shape[1], writeable=True)
    windows[packs * row_width + starts] += values


def _rows_of(buffer: np.ndarray, n_rows: int, row_width: int) -> np.ndarray:
    """The first `n_rows` rows of `row_width` cells of the flat `buffer`, as a [n_rows, row_width] view."""
    return buffer[: n_rows * row_width].reshape(n_rows, row_width)


def _cumulative_before(values: np.ndarray) -> np.ndarray:
    """[R, S]: the sum of each row's values before each column (an exclusive cumsum over few columns)."""
    before = np.zeros_like(values)
    for column in range(1, values.shape[1]):
        np.add(before[:, column - 1], values[:, column - 1], out=before[:, column])
    return before


def _layout(lengths: np.ndarray, length: int, slots: int, algorithm: str):
    """(members [R, S]: each pack's instances, -1 none; present; member: members with 0 for none; the members'
    lengths; their first tokens' columns) of instances of `lengths` packed into rows of `length`."""
    members = pack_members(lengths, length, slots, algorithm)
    present = members >= 0
    member = np.where(present, members, 0)
    member_lengths = np.where(present, lengths[member], 0)
    return members, present, member, member_lengths, _cumulative_before(member_lengths)


def pack_arrays(arrays: dict[str, np.ndarray], max_sequences_per_pack: int = MAX_SEQUENCES_PER_PACK,
                masked_lm_prob: float = 0.15, algorithm: str = PackSettings.algorithm, source: str = "input",
                lengths: np.ndarray | None = None, in_place: bool = False, masking_rule: str = "google",
                counts: dict | None = None, pad_id: int = 0) -> dict[str, np.ndarray]:
    """The packed arrays (module docstring) of the NVIDIA-schema `arrays` of one shard.

    `lengths`, the real tokens of each instance, says the arrays are in as_written_by_encode's form (zeros past the
    tokens); without it they are checked and brought to that form first. The packed rows are padded with `pad_id`.
    `in_place` writes the packed token rows into the memory of `arrays` (fresh memory costs more than the copy
    itself), which then no longer hold the instances.
    Under masking_rule per_token a pack's predictions beyond the row's width are unmasked in `arrays` and counted
    in `counts["masks_over_row_width"]`; under google they are refused."""
    n, length = arrays["input_ids"].shape
    if length > np.iinfo(np.int16).max:
        raise UserError(f"{source}: sequence length {length} does not fit int16 position ids")
    slots = sequence_slots(max_sequences_per_pack, length)
    if lengths is None:
        arrays, lengths = as_written_by_encode(arrays, source)
    n_predictions = arrays["masked_lm_positions"].shape[1]
    mask_type = sequence_number_dtype(slots)
    width = prediction_width(length, n_predictions, masked_lm_prob, slots, masking_rule)
    members, present, member, member_lengths, starts = _layout(lengths, length, slots, algorithm)
    n_packs = len(members)
    valid = arrays["masked_lm_positions"] > 0
    n_valid = np.where(valid[:, -1], n_predictions, np.argmin(valid, axis=1))  # predictions lead their row
    predicted = np.where(present, n_valid[member], 0)
    prediction_starts = _cumulative_before(predicted)
    per_pack = prediction_starts[:, -1] + predicted[:, -1]
    if n_packs and per_pack.max() > width and masking_rule == "per_token":
        n_valid = _unmask_beyond(lambda instance, columns: _restore_dense(arrays, instance, columns), members,
                                 n_valid, width, counts)
        predicted = np.where(present, n_valid[member], 0)
        prediction_starts = _cumulative_before(predicted)
        per_pack = prediction_starts[:, -1] + predicted[:, -1]
    if n_packs and per_pack.max() > width:
        raise UserError(f"{source}: a pack needs {int(per_pack.max())} prediction slots, more than {width} "
                        f"(masked_lm_prob {masked_lm_prob}); the shard was not encoded with these settings")
    shown = min(n_predictions, width)  # a pack's predictions fit in `width`, so an instance's are in its first columns
    cells = np.arange(length, dtype=np.int16)  # a sequence's mask and position ids, from its length (no L x L table)

    def head(sizes: np.ndarray, window: int) -> np.ndarray:
        """[k, window] int8: 1 on each row's first `sizes` cells."""
        return (cells[:window] < sizes[:, None]).view(np.int8)

    # Slot 0 of every pack is its instance's row, and the mask and position ids of its length. Each
    # later slot is added as windows at its start: its instance's row (zero past its length), as wide as the longest
    # of a group (lengths rounded up to eighths of a row; packs of one parity, see _add_windows), whose zeros land on
    # slots not yet written or on padding. Their values are read first, before `in_place` overwrites any instance.
    later = []
    step = max(1, length // 8)
    for slot in range(1, slots):
        packs = np.flatnonzero(present[:, slot])
        window_and_parity = np.minimum(-(-member_lengths[packs, slot] // step) * step, length) * 2 + packs % 2
        for key in np.unique(window_and_parity).tolist():
            chosen, window = packs[window_and_parity == key], key // 2
            rows, sizes, start = members[chosen, slot], member_lengths[chosen, slot], starts[chosen, slot]
            predicted_width = max(1, int(predicted[chosen, slot].max()))
            instance_positions = arrays["masked_lm_positions"][rows, :predicted_width]
            later.append((chosen, start, prediction_starts[chosen, slot], {
                "input_ids": arrays["input_ids"][rows, :window], "segment_ids": arrays["segment_ids"][rows, :window],
                "input_mask": head(sizes, window) * mask_type(slot + 1),
                "position_ids": cells[:window] * head(sizes, window),
                "masked_lm_positions": np.where(instance_positions > 0, instance_positions + start[:, None], 0),
                "masked_lm_ids": arrays["masked_lm_ids"][rows, :predicted_width]}))

    first, first_length = members[:, 0], member_lengths[:, 0]
    buffers, out = {}, {}
    for name, dtype, row_width in (("input_ids", np.int32, length), ("segment_ids", np.int8, length),
                                   ("input_mask", mask_type, length), ("position_ids", np.int16, length),
                                   ("masked_lm_positions", np.int32, width), ("masked_lm_ids", np.int32, width)):
        instances = arrays.get(name)
        reuse = (in_place and instances is not None and instances.flags.c_contiguous and instances.dtype == dtype
                 and row_width <= instances.shape[1])  # windows mean packs < instances: a row to run on into
        buffers[name] = instances.reshape(-1) if reuse else np.zeros((n_packs + 1) * row_width, dtype)
        out[name] = rows = _rows_of(buffers[name], n_packs, row_width)
        if name == "input_mask" and mask_type == np.int8:
            np.less(cells, first_length[:, None], out=rows.view(bool))
        elif name == "input_mask":
            rows[...] = cells < first_length[:, None]
        elif name == "position_ids":  # after input_mask, which holds slot 0's cells so far
            np.multiply(cells, out["input_mask"], out=rows)
        elif reuse:  # pack p reads instance rows >= p: chunk by chunk, each chunk's reads before its writes
            chunk = max(1, PACK_CHUNK_CELLS // instances.shape[1])
            gathered = np.empty((chunk, instances.shape[1]), dtype)
            for begin in range(0, n_packs, chunk):
                block = np.take(instances, first[begin : begin + chunk], axis=0, out=gathered[: n_packs - begin],
                                mode="clip")
                rows[begin : begin + len(block)] = block[:, :row_width]
        elif row_width == instances.shape[1] and instances.dtype == dtype:
            np.take(instances, first, axis=0, out=rows, mode="clip")
        else:  # predictions: the first `shown`
            columns = min(row_width, instances.shape[1])
            rows[:, :columns] = instances[first, :columns]
    for packs, token_starts, predictions_start, values in later:
        for name, value in values.items():
            row_width = width if name.startswith("masked_lm") else length
            at = predictions_start if name.startswith("masked_lm") else token_starts
            _add_windows(buffers[name], row_width, packs, at, value)
    out.update(cls_positions=np.where(present, starts, 0).astype(np.int32),
               sequence_lengths=member_lengths.astype(np.int32),
               next_sentence_labels=np.where(present, arrays["next_sentence_labels"][member], -1).astype(np.int8),
               instance_index=members.astype(np.int32))
    return _padded_with({name: out[name] for name in PACKED}, pad_id)


@dataclass
class RaggedInstances:
    """One shard's instances at their real lengths (the encoder's, before packing): instance i's tokens are
    input_ids[token_offsets[i]:token_offsets[i + 1]] (and segment_ids), its predictions masked_lm_positions and
    masked_lm_ids[prediction_offsets[i]:prediction_offsets[i + 1]], ascending. Memory follows the real tokens, not
    instances x max_seq_length."""

    max_seq_length: int
    max_predictions_per_seq: int
    lengths: np.ndarray  # [N] int64
    input_ids: np.ndarray  # [T] int32
    segment_ids: np.ndarray  # [T] int8
    masked_lm_positions: np.ndarray  # [M] int32
    masked_lm_ids: np.ndarray  # [M] int32
    n_predictions: np.ndarray  # [N] int64
    next_sentence_labels: np.ndarray  # [N] int8

    @property
    def token_offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lengths)])

    @property
    def prediction_offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.n_predictions)])


def pack_ragged(instances: RaggedInstances, max_sequences_per_pack: int = MAX_SEQUENCES_PER_PACK,
                masked_lm_prob: float = 0.15, algorithm: str = PackSettings.algorithm, source: str = "input",
                masking_rule: str = "google", counts: dict | None = None, pad_id: int = 0) -> dict[str, np.ndarray]:
    """pack_arrays of instances held at their real lengths: the same packed arrays, byte for byte, with no
    instance ever at max_seq_length; padded with `pad_id`. Predictions beyond a row's width: as pack_arrays
    (unmasked in `instances`)."""
    length, lengths = instances.max_seq_length, instances.lengths
    if length > np.iinfo(np.int16).max:
        raise UserError(f"{source}: sequence length {length} does not fit int16 position ids")
    slots = sequence_slots(max_sequences_per_pack, length)
    width = prediction_width(length, instances.max_predictions_per_seq, masked_lm_prob, slots, masking_rule)
    members, present, member, member_lengths, starts = _layout(lengths, length, slots, algorithm)
    n_packs = len(members)
    n_valid = instances.n_predictions
    per_pack = np.where(present, n_valid[member], 0).sum(axis=1)
    if n_packs and per_pack.max() > width and masking_rule == "per_token":
        n_valid = _unmask_beyond(_RaggedRows(instances).restore, members, n_valid, width, counts)
        per_pack = np.where(present, n_valid[member], 0).sum(axis=1)
    if n_packs and per_pack.max() > width:
        raise UserError(f"{source}: a pack needs {int(per_pack.max())} prediction slots, more than {width} "
                        f"(masked_lm_prob {masked_lm_prob}); the shard was not encoded with these settings")
    predicted = np.where(present, n_valid[member], 0)
    prediction_starts = _cumulative_before(predicted)
    out = {name: np.zeros((n_packs, row_width), dtype) for name, dtype, row_width in (
        ("input_ids", np.int32, length), ("segment_ids", np.int8, length),
        ("input_mask", sequence_number_dtype(slots), length),
        ("position_ids", np.int16, length), ("masked_lm_positions", np.int32, width),
        ("masked_lm_ids", np.int32, width))}
    # An instance's first n_valid predictions are packed (those cut above stay where they were, unused).
    token_offsets, prediction_offsets = instances.token_offsets, instances.prediction_offsets
    # Sequences in pack order, a few at a time: the index arrays stay small whatever the shard.
    packs, slot = np.nonzero(present)
    chunk = max(1, PACK_CHUNK_CELLS // max(1, length))
    for begin in range(0, len(packs), chunk):
        at, s = packs[begin : begin + chunk], slot[begin : begin + chunk]
        instance = members[at, s]
        n = lengths[instance]
        cell = _ranges(n)
        source_cells = np.repeat(token_offsets[instance], n) + cell
        target = np.repeat(at * length + starts[at, s], n) + cell
        out["input_ids"].reshape(-1)[target] = instances.input_ids[source_cells]
        out["segment_ids"].reshape(-1)[target] = instances.segment_ids[source_cells]
        out["input_mask"].reshape(-1)[target] = np.repeat(s + 1, n)
        out["position_ids"].reshape(-1)[target] = cell
        k = n_valid[instance]
        column = _ranges(k)
        source_predictions = np.repeat(prediction_offsets[instance], k) + column
        target = np.repeat(at * width + prediction_starts[at, s], k) + column
        out["masked_lm_positions"].reshape(-1)[target] = (instances.masked_lm_positions[source_predictions]
                                                          + np.repeat(starts[at, s], k))
        out["masked_lm_ids"].reshape(-1)[target] = instances.masked_lm_ids[source_predictions]
    out.update(cls_positions=np.where(present, starts, 0).astype(np.int32),
               sequence_lengths=member_lengths.astype(np.int32),
               next_sentence_labels=np.where(present, instances.next_sentence_labels[member], -1).astype(np.int8),
               instance_index=members.astype(np.int32))
    return _padded_with({name: out[name] for name in PACKED}, pad_id)


def _padded_with(packed: dict[str, np.ndarray], pad_id: int) -> dict[str, np.ndarray]:
    """`packed` with `pad_id` in the padding cells of input_ids (the packers write zeros there)."""
    if pad_id:
        packed["input_ids"][packed["input_mask"] == 0] = pad_id
    return packed


def _ranges(sizes: np.ndarray) -> np.ndarray:
    """0..sizes[0]-1, 0..sizes[1]-1, ... concatenated."""
    return np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)


class _RaggedRows:
    """What _unmask_beyond reads and writes of RaggedInstances, in the dense arrays' terms."""

    def __init__(self, instances: RaggedInstances):
        self.instances, self.tokens, self.predictions = instances, instances.token_offsets, instances.prediction_offsets

    def restore(self, instance: int, columns: slice) -> None:
        """Unmask the predictions `columns` of `instance`: its tokens back to their labels."""
        at = slice(self.predictions[instance] + columns.start, self.predictions[instance] + columns.stop)
        self.instances.input_ids[self.tokens[instance] + self.instances.masked_lm_positions[at]] = \
            self.instances.masked_lm_ids[at]


def _unmask_beyond(restore, members: np.ndarray, n_valid: np.ndarray, width: int, counts: dict | None) -> np.ndarray:
    """Unmask the predictions of each pack beyond `width`, the last slot's last ones first (its highest positions:
    an instance's predictions are ascending), by restore(instance, columns) of the instances' predictions; the
    instances' new prediction counts."""
    n_valid = n_valid.copy()
    for pack in np.flatnonzero(np.where(members >= 0, n_valid[np.maximum(members, 0)], 0).sum(axis=1) > width):
        excess = int(n_valid[members[pack][members[pack] >= 0]].sum()) - width
        for instance in members[pack][members[pack] >= 0][::-1].tolist():
            drop = min(excess, int(n_valid[instance]))
            kept = int(n_valid[instance]) - drop
            restore(instance, slice(kept, int(n_valid[instance])))
            n_valid[instance], excess = kept, excess - drop
            if counts is not None:
                counts["masks_over_row_width"] = counts.get("masks_over_row_width", 0) + drop
            if not excess:
                break
    return n_valid


def _restore_dense(arrays: dict[str, np.ndarray], instance: int, columns: slice) -> None:
    """Unmask the predictions `columns` of row `instance` of NVIDIA-schema `arrays`: tokens back, slots emptied."""
    arrays["input_ids"][instance, arrays["masked_lm_positions"][instance, columns]] = \
        arrays["masked_lm_ids"][instance, columns]
    arrays["masked_lm_positions"][instance, columns] = 0
    arrays["masked_lm_ids"][instance, columns] = 0


def check_packed(packed: dict[str, np.ndarray], cls_id: int, sep_id: int, stray_ids: Sequence[int],
                 source: str = "input") -> None:
    """Raise a UserError unless every sequence of the packed arrays is whole: its tokens numbered slot + 1 are
    exactly `sequence_lengths` from its `cls_positions`, the first a [CLS] and the last a [SEP], and none in between
    is a [CLS] or one of `stray_ids` (the padding id, [MASK]) but at a masked position (static masks may put any
    token there). A cheap pass over the rows, run on every shard the packer writes: a wrong length packs padding."""
    ids, sequence, lengths = packed["input_ids"], packed["input_mask"], packed["sequence_lengths"]
    n_rows, n_slots = lengths.shape
    chunk = max(1, PACK_CHUNK_CELLS // max(1, sequence.shape[1]))
    for begin in range(0, n_rows, chunk):  # tokens of each (row, slot) counted in one pass, whatever the slots
        block = sequence[begin : begin + chunk].astype(np.int64)
        keys = np.clip(block, 0, n_slots + 1) + np.arange(len(block))[:, None] * (n_slots + 2)
        counted = np.bincount(keys.ravel(), minlength=len(block) * (n_slots + 2)).reshape(len(block), n_slots + 2)
        wrong = np.argwhere((counted[:, 1 : n_slots + 1] != lengths[begin : begin + chunk]) | (counted[:, -1:] > 0))
        if len(wrong):
            raise UserError(f"{source}: packed row {begin + int(wrong[0][0])} holds another number of tokens in slot "
                            f"{int(wrong[0][1])} than its sequence length; the packer was given wrong lengths")
    rows, slots = np.nonzero(lengths > 0)
    first = packed["cls_positions"][rows, slots]
    last = first + lengths[rows, slots] - 1
    wrong = np.flatnonzero((ids[rows, first] != cls_id) | (ids[rows, last] != sep_id))
    if len(wrong):
        raise UserError(f"{source}: packed row {int(rows[wrong[0]])}, slot {int(slots[wrong[0]])} does not start "
                        f"with [CLS] and end with [SEP]; the packer was given wrong lengths")
    text = sequence > 0
    text[rows, first] = False
    predicted_rows, columns = np.nonzero(packed["masked_lm_positions"] > 0)
    text[predicted_rows, packed["masked_lm_positions"][predicted_rows, columns]] = False
    stray = text & np.isin(ids, np.asarray([cls_id, *stray_ids]))
    if stray.any():
        row = int(np.flatnonzero(stray.any(axis=1))[0])
        raise UserError(f"{source}: {int(stray.sum())} [PAD], [MASK] or [CLS] token(s) inside packed sequences (first "
                        f"in row {row}); the packer was given wrong lengths")


def pack_shard(encoded: str | os.PathLike, output: str | os.PathLike,
               max_sequences_per_pack: int = MAX_SEQUENCES_PER_PACK, algorithm: str = PackSettings.algorithm,
               compression: str = "gzip") -> dict:
    """Pack one encoded shard into the HDF5 file `output` (atomically), as encode does; returns its statistics."""
    arrays, attributes = read_encoded(encoded)
    tables = {name: arrays.pop(name) for name in TABLES if name in arrays}
    arrays, lengths = as_written_by_encode(arrays, str(encoded))
    masked_lm_prob = float(attributes.get("masked_lm_prob", 0.15))
    if attributes.get("split") == "test":  # the held-out masks' probability (workflow.data.masking_rule)
        masked_lm_prob = float(attributes.get("eval_masked_lm_prob", masked_lm_prob))
    masking_rule = str(attributes.get("masking_rule", "google"))
    # An encoded shard's first instance gives the ids: [CLS] first, [SEP] last (a static file does not record them).
    ids = arrays["input_ids"]
    cls_id, sep_id = (int(ids[0, 0]), int(ids[0, lengths[0] - 1])) if len(lengths) else (0, 0)
    counts, pad_id = {}, pad_id_of(attributes)
    packed = pack_arrays(arrays, max_sequences_per_pack, masked_lm_prob, algorithm, str(encoded), lengths,
                         masking_rule=masking_rule, counts=counts, pad_id=pad_id)
    if counts:
        log.warning("%s: %d masks over the packed rows' prediction width unmasked", encoded,
                    counts["masks_over_row_width"])
    # the padding, and [MASK] where the file records it (a dynamic file)
    check_packed(packed, cls_id, sep_id, {pad_id, int(attributes.get("mask_id", pad_id))}, str(encoded))
    stats = packing_stats(lengths, arrays["input_ids"].shape[1], packed["input_ids"].shape[0])
    settings = PackSettings(max_sequences_per_pack, algorithm)
    attributes.update(stats, **settings.attributes(arrays["input_ids"].shape[1]))
    write_shard(output, attributes, {name: (packed[name].shape, packed[name].dtype) for name in sorted(packed)},
                [packed], compression, tables)
    log.info("%s: %d instances in %d packs of %d, fill %.4f (unpacked %.4f)", output, stats["n_instances"],
             stats["n_packs"], packed["input_ids"].shape[1], stats["fill"], stats["fill_unpacked"])
    return stats


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encoded", required=True, help="encoded shard (HDF5 from workflow.data.encode)")
    parser.add_argument("--output", required=True, help="packed HDF5 file to write")
    parser.add_argument("--max-sequences-per-pack", default=MAX_SEQUENCES_PER_PACK,
                        help=f"most instances a row, or {AUTO}: as many as fit")
    parser.add_argument("--algorithm", choices=ALGORITHMS, default=PackSettings.algorithm)
    parser.add_argument("--compression", choices=["gzip", "none"], default="gzip")
    args = parser.parse_args(argv)
    pack_shard(args.encoded, args.output, args.max_sequences_per_pack, args.algorithm, args.compression)


if __name__ == "__main__":
    run(main)
