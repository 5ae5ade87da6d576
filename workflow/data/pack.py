"""Sequence packing: the instances of one encoded shard in fewer, fuller rows (Krell et al. 2021, arXiv 2107.02027).

The encode stage packs each shard as it writes it (config `encode.packing`, on by default): in memory, measured at
0.13-0.5 CPU s per 44k instances at 512 (~10-40% of that encode job's CPU on 8 MB of real text, noisy shared
machine; fresh pages are most of it), where a separate HDF5 -> HDF5 job costs about as much as encoding (I/O + gzip;
see benchmarks/packing.py). `python -m workflow.data.pack` packs an existing NVIDIA-schema shard the same way.

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
algorithm, `max_sequences_per_pack`, and the fill statistics of `packing_stats`), zero-padded, one row per pack of
S = max_sequences_per_pack slots:

    input_ids [R,L] int32, segment_ids [R,L] int8,
    input_mask [R,L] int8            sub-sequence number of each token, 1..S (0 = padding; > 0 = NVIDIA's mask),
    position_ids [R,L] int16         restarting at 0 at each sub-sequence,
    cls_positions [R,S] int32        the [CLS] slot (= start) of each sub-sequence,
    sequence_lengths [R,S] int32     its length (0 = empty slot): sub-sequence s spans cls..cls+length,
    next_sentence_labels [R,S] int8  its NSP label (-1 = empty slot),
    instance_index [R,S] int32       its row in the encoded shard (-1 = empty slot),
    masked_lm_positions [R,W] int32  positions in the packed row, ascending (0 = empty slot: a [CLS] is never masked),
    masked_lm_ids [R,W] int32,

with W = min(S * max_predictions_per_seq, floor(masked_lm_prob * L) + S) (encode predicts at most
max(1, rint(masked_lm_prob * n)) tokens of an instance of n tokens). Packs are ordered by their first instance's
row, so the file keeps the encode stage's shuffled order. The whole shard is held in memory (a shard is bounded
by the shard stage's size).
"""
import argparse
import logging
import os
from dataclasses import dataclass
from typing import Sequence

import h5py
import numpy as np

from workflow.cli import UserError, run

log = logging.getLogger(__name__)

ENCODED = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids", "next_sentence_labels")
ALGORITHMS = ("gapfill", "lpfhp", "spfhp")
MAX_SEQUENCES_PER_PACK = 3  # the default: gapfill then reaches >= 99% fill at 512


@dataclass(frozen=True)
class PackSettings:
    """Config `encode.packing` (when enabled)."""

    max_sequences_per_pack: int = MAX_SEQUENCES_PER_PACK
    algorithm: str = "gapfill"

    def attributes(self) -> dict:
        """The packed file's root attributes saying how it was packed."""
        return {"packing": self.algorithm, "max_sequences_per_pack": self.max_sequences_per_pack}


def packing_stats(input_mask: np.ndarray, n_packs: int) -> dict:
    """Instances, packs, real tokens and the fill (real tokens / slots) packed and unpacked."""
    n_real = int(np.count_nonzero(input_mask))
    return {"n_instances": len(input_mask), "n_packs": n_packs, "n_real_tokens": n_real,
            "fill": n_real / max(1, n_packs * input_mask.shape[1]), "fill_unpacked": n_real / max(1, input_mask.size)}


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
                chosen = _best_fill(counts, space, 2 if free_slots >= 2 else 1, lengths)
                if not chosen:
                    break
                for length in chosen:
                    counts[length] -= 1
                members += chosen
                space -= sum(chosen)
                free_slots -= len(chosen)
            need = np.bincount(members, minlength=max_length + 1)
            used = np.flatnonzero(need)
            more = int((counts[used] // need[used]).min())
            counts[used] -= more * need[used]
            packs.append((tuple(members), more + 1))
    return packs


def _best_fill(counts: np.ndarray, space: int, most: int, lengths: np.ndarray) -> tuple[int, ...]:
    """The 1 or 2 (at most `most`) available lengths with the largest sum <= space; among equal sums a pair
    (short sequences are used up where they fit rather than left to fill packs of their own), then the more
    unequal pair. () when nothing fits."""
    largest_up_to = np.maximum.accumulate(np.where(counts > 0, lengths, 0))  # [x]: largest available length <= x
    first = np.flatnonzero(counts[1 : space + 1]) + 1
    if not len(first):
        return ()
    if most == 1:
        return (int(first[-1]),)
    # The second is the largest available length <= min(space - first, first); equal to first only if two exist.
    limit = np.minimum(space - first, first)
    second = largest_up_to[limit]
    lone = (second == first) & (counts[first] < 2)
    second[lone] = largest_up_to[first[lone] - 1]
    total = first + second
    best = np.flatnonzero(total == total.max())
    pick = best[np.argmax((second[best] > 0) * len(lengths) + first[best])]
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


def prediction_width(max_length: int, max_predictions_per_seq: int, masked_lm_prob: float,
                     max_sequences_per_pack: int) -> int:
    """Prediction slots of a packed row (see the module docstring)."""
    return int(min(max_sequences_per_pack * max_predictions_per_seq,
                   np.floor(masked_lm_prob * max_length) + max_sequences_per_pack))


def pack_arrays(arrays: dict[str, np.ndarray], max_sequences_per_pack: int = MAX_SEQUENCES_PER_PACK,
                masked_lm_prob: float = 0.15, algorithm: str = "lpfhp", source: str = "input") -> dict[str, np.ndarray]:
    """The packed arrays (module docstring) of the NVIDIA-schema `arrays` of one shard."""
    if max_sequences_per_pack < 1:
        raise UserError(f"pack max_sequences_per_pack {max_sequences_per_pack}: must be at least 1")
    n, length = arrays["input_ids"].shape
    if length > np.iinfo(np.int16).max:
        raise UserError(f"{source}: sequence length {length} does not fit int16 position ids")
    n_predictions = arrays["masked_lm_positions"].shape[1]
    slots = max_sequences_per_pack
    width = prediction_width(length, n_predictions, masked_lm_prob, slots)
    lengths = sequence_lengths_of(arrays["input_mask"], source)

    strategies = histogram_packing(np.bincount(lengths, minlength=length + 1), length, slots, algorithm)
    n_packs = sum(count for _, count in strategies)
    # Packs in strategy order: each strategy takes the next `count` instances (in file order) of every length it holds.
    by_length = np.argsort(lengths, kind="stable")
    cursor = np.searchsorted(lengths[by_length], np.arange(length + 1))
    members = np.full((n_packs, slots), -1, np.int64)
    row = 0
    for pack_lengths, count in strategies:
        for slot, size in enumerate(pack_lengths):
            members[row : row + count, slot] = by_length[cursor[size] : cursor[size] + count]
            cursor[size] += count
        row += count
    # In the file, packs go by their first instance's row, so the file keeps the encode stage's shuffled order.
    order = np.argsort(np.where(members >= 0, members, n).min(axis=1), kind="stable")
    # The packs of one strategy share one layout and are built side by side (block copies into a slice of rows),
    # then put in file order with one take per array.
    out = {name: np.zeros((n_packs, length), dtype) for name, dtype in
           (("input_ids", np.int32), ("segment_ids", np.int8), ("input_mask", np.int8), ("position_ids", np.int16))}
    positions = np.arange(length, dtype=np.int16)
    row = 0
    for pack_lengths, count in strategies:
        rows, start = slice(row, row + count), 0
        for slot, size in enumerate(pack_lengths):
            chosen, span = members[rows, slot], slice(start, start + size)
            out["input_ids"][rows, span] = arrays["input_ids"][chosen, :size]
            out["segment_ids"][rows, span] = arrays["segment_ids"][chosen, :size]
            out["input_mask"][rows, span] = slot + 1
            out["position_ids"][rows, span] = positions[:size]
            start += size
        row += count
    out = {name: array[order] for name, array in out.items()}
    members = members[order]

    present = members >= 0
    member = np.where(present, members, 0)
    member_lengths = np.where(present, lengths[member], 0)
    starts = np.cumsum(member_lengths, axis=1) - member_lengths
    out.update(cls_positions=np.where(present, starts, 0).astype(np.int32),
               sequence_lengths=member_lengths.astype(np.int32),
               next_sentence_labels=np.where(present, arrays["next_sentence_labels"][member], -1).astype(np.int8),
               instance_index=members.astype(np.int32))

    # Predictions, in row-major order of the (pack, slot) instances: an instance's valid predictions lead its row,
    # and a pack's lead the packed row, so one boolean selection fills them.
    pack_of, slot_of = np.nonzero(present)
    instance = members[pack_of, slot_of]
    positions = arrays["masked_lm_positions"][instance]
    valid = positions > 0  # encode puts a row's predictions first, then zeros
    per_pack = np.bincount(pack_of, weights=valid.sum(axis=1), minlength=n_packs).astype(np.int64)
    if n_packs and per_pack.max() > width:
        raise UserError(f"{source}: a pack needs {int(per_pack.max())} prediction slots, more than {width} "
                        f"(masked_lm_prob {masked_lm_prob}); the shard was not encoded with these settings")
    packed_valid = np.arange(width)[None, :] < per_pack[:, None]
    shifted = positions + starts[pack_of, slot_of][:, None]
    for name, values in (("masked_lm_positions", shifted), ("masked_lm_ids", arrays["masked_lm_ids"][instance])):
        out[name] = np.zeros((n_packs, width), np.int32)
        out[name][packed_valid] = values[valid]
    return out


def read_encoded(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays, root attributes) of an encoded shard."""
    try:
        with h5py.File(path, "r") as handle:
            missing = [name for name in ENCODED if name not in handle]
            if missing:
                raise UserError(f"{path}: missing dataset(s) {', '.join(missing)}; not an encoded shard")
            if "position_ids" in handle:
                raise UserError(f"{path}: already packed")
            arrays = {name: handle[name][()] for name in ENCODED}
            attributes = dict(handle.attrs)
    except FileNotFoundError:
        raise UserError(f"{path}: encoded shard not found") from None
    except OSError as error:
        raise UserError(f"{path}: not a readable HDF5 file ({error})") from None
    n = arrays["input_ids"].shape[0]
    for name, array in arrays.items():
        if array.shape[0] != n or array.ndim != (1 if name == "next_sentence_labels" else 2):
            raise UserError(f"{path}: dataset {name} has shape {array.shape}, inconsistent with input_ids {(n,)}")
    return arrays, attributes


def pack_shard(encoded: str | os.PathLike, output: str | os.PathLike,
               max_sequences_per_pack: int = MAX_SEQUENCES_PER_PACK, algorithm: str = PackSettings.algorithm,
               compression: str = "gzip") -> dict:
    """Pack one encoded shard into the HDF5 file `output` (atomically), as encode does; returns its statistics."""
    from workflow.data.encode import write_shard  # encode imports this module

    arrays, attributes = read_encoded(encoded)
    masked_lm_prob = float(attributes.get("masked_lm_prob", 0.15))
    packed = pack_arrays(arrays, max_sequences_per_pack, masked_lm_prob, algorithm, source=str(encoded))
    stats = packing_stats(arrays["input_mask"], packed["input_ids"].shape[0])
    attributes.update(stats, **PackSettings(max_sequences_per_pack, algorithm).attributes())
    write_shard(output, attributes, {name: (packed[name].shape, packed[name].dtype) for name in sorted(packed)},
                [packed], compression)
    log.info("%s: %d instances in %d packs of %d, fill %.4f (unpacked %.4f)", output, stats["n_instances"],
             stats["n_packs"], packed["input_ids"].shape[1], stats["fill"], stats["fill_unpacked"])
    return stats


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encoded", required=True, help="encoded shard (HDF5 from workflow.data.encode)")
    parser.add_argument("--output", required=True, help="packed HDF5 file to write")
    parser.add_argument("--max-sequences-per-pack", type=int, default=MAX_SEQUENCES_PER_PACK)
    parser.add_argument("--algorithm", choices=ALGORITHMS, default=PackSettings.algorithm)
    parser.add_argument("--compression", choices=["gzip", "none"], default="gzip")
    args = parser.parse_args(argv)
    pack_shard(args.encoded, args.output, args.max_sequences_per_pack, args.algorithm, args.compression)


if __name__ == "__main__":
    run(main)
