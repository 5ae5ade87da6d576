"""Stage encode: turn one tokenized shard into masked-LM + next-sentence training instances in HDF5.

Semantics and defaults are those of Google's create_pretraining_data.py as used by NVIDIA DeepLearningExamples
(dupe_factor, short_seq_prob per document, random split point of each chunk into A/B, B from a random other
document half of the time, truncation of the longer segment from a random end, masked_lm_prob with at most
max_predictions_per_seq, 80/10/10 [MASK]/random/keep, optional whole-word masking, instances shuffled).
The file schema is NVIDIA's, so its loader reads it as is:

    input_ids [N,L] int32, input_mask [N,L] int8, segment_ids [N,L] int8,
    masked_lm_positions [N,P] int32, masked_lm_ids [N,P] int32, next_sentence_labels [N] int8 (1 = random B),

padded: input_ids with the tokenizer's padding id (its pad role: BERT's [PAD] 0; another id is recorded as the
root attribute pad_id, workflow.data.hdf5.pad_attributes), the rest with zeros. Settings off NVIDIA's recipe
(docs/data.md, "Masking at load time and full sentences"): `masking` dynamic writes the rows unmasked
(masked_lm_* zero) with what the loader's masker needs (workflow.train.masking; mask_rows is the one masking rule
of both); `objective` full_sentences plans RoBERTa's FULL-SENTENCES rows and documents its DOC-SENTENCES rows
(plan_full_sentences) instead of pairs; `masking_rule` per_token masks each token on its own
(workflow.data.masking_rule). The test split is masked at the held-out probability
(EncodeSettings.held_out_masked_lm_prob: eval_masked_lm_prob), so held-out accuracies compare across training
rates. With packing (the stage's default; workflow.data.pack), the shard's instances are packed before they are
written, several to a row, in the packed schema of workflow.data.pack. The work is vectorised numpy: instances are
planned for all documents at once (one step = one instance per document), then built and masked in batches of rows,
so memory stays bounded by the batch; with packing, by the shard's real tokens: each batch, built at full length, is
kept at its instances' real lengths (ragged_instances; their lengths come from the plan) until the packer lays them
into rows (workflow.data.pack.pack_ragged), so short documents at 8,192 tokens cost their tokens, not 8,192 each.
"""
import argparse
import hashlib
import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np
from tqdm import tqdm

from workflow.cli import UserError, run
from workflow.data.hdf5 import CHUNK_ROWS, PACKED_VERSION, pad_attributes, write_shard
from workflow.data.pack import (ALGORITHMS, AUTO, PackSettings, RaggedInstances, check_packed, pack_ragged,
                                packing_stats)
from workflow.data.masking_rule import (MASKING_RULES, MASKINGS, OBJECTIVES, EncodeSettings,  # noqa: F401
                                       GeneratorDraws, Vocab, derived_max_predictions, mask_rows)
from workflow.data.tokenize import load_tokenized

log = logging.getLogger(__name__)

SPLIT_CODES = {"training": 0, "test": 1}  # part of the seed, so each shard has its own random stream
BATCH_CELLS = 1 << 20  # tokens built per batch: bounds memory whatever the sequence length


def shard_rng(seed: int, split: str, shard_index: int) -> tuple[np.random.Generator, np.random.Generator]:
    """Independent (planning, masking) generators of one shard: results never depend on job order."""
    sequence = np.random.SeedSequence([seed, SPLIT_CODES[split], shard_index])
    plan, mask = sequence.spawn(2)
    return np.random.default_rng(plan), np.random.default_rng(mask)


def plan_instances(
    sentence_offsets: np.ndarray, document_offsets: np.ndarray, settings: EncodeSettings, rng: np.random.Generator
) -> np.ndarray:
    """Segment pairs of every instance, shuffled: [N, 5] int64 rows (a_start, a_end, b_start, b_end, is_random_next).

    Segments are token ranges of the shard's flat ids. Each "lane" walks one document (dupe_factor lanes per
    document) and emits one instance per step, exactly as create_instances_from_document does sentence by sentence.
    """
    cum = sentence_offsets
    doc_first = document_offsets[:-1]
    doc_end = document_offsets[1:]
    n_docs = len(doc_first)
    if n_docs == 0:
        return np.zeros((0, 5), np.int64)
    max_num_tokens = settings.max_seq_length - 3
    doc = np.tile(np.arange(n_docs), settings.dupe_factor)
    pos = doc_first[doc].copy()
    end = doc_end[doc]
    # Google draws the target length once per document: usually full, sometimes short.
    target = np.where(
        rng.random(len(doc)) < settings.short_seq_prob, rng.integers(2, max_num_tokens + 1, len(doc)), max_num_tokens
    )
    steps: list[np.ndarray] = []
    while len(doc):
        n = len(doc)
        chunk_end = np.minimum(np.searchsorted(cum, cum[pos] + target, side="left"), end)
        n_chunk = chunk_end - pos
        a_sentences = rng.integers(1, np.maximum(n_chunk, 2))
        is_random = (n_chunk == 1) | (rng.random(n) < 0.5)
        a_start, a_end = cum[pos], cum[pos + a_sentences]
        # B from a random other document: a random first sentence, then sentences until the target is reached.
        other = rng.integers(0, max(n_docs - 1, 1), n)
        other = other + (other >= doc) if n_docs > 1 else doc
        first = doc_first[other] + rng.integers(0, doc_end[other] - doc_first[other])
        wanted = cum[first] + target - (a_end - a_start)
        last = np.clip(np.searchsorted(cum, wanted, side="left"), first + 1, doc_end[other])
        b_start = np.where(is_random, cum[first], a_end)
        b_end = np.where(is_random, cum[last], cum[chunk_end])
        a_start, a_end, b_start, b_end = _truncate_pair(a_start, a_end, b_start, b_end, max_num_tokens, rng)
        steps.append(np.stack([a_start, a_end, b_start, b_end, is_random.astype(np.int64)], axis=1))
        # A random B puts the chunk's unused sentences back for the next instance.
        pos = np.where(is_random, pos + a_sentences, chunk_end)
        alive = pos < end
        doc, pos, end, target = doc[alive], pos[alive], end[alive], target[alive]
    plan = np.concatenate(steps)
    return plan[rng.permutation(len(plan))]


def plan_full_sentences(
    sentence_offsets: np.ndarray, document_offsets: np.ndarray, settings: EncodeSettings, rng: np.random.Generator,
    cross_documents: bool = True,
) -> np.ndarray:
    """RoBERTa's FULL-SENTENCES rows, shuffled, in plan_instances' [N, 5] form (NSP label 0): contiguous sentences
    up to max_seq_length - 3 tokens, A within one document and, when A reaches its document's end, B continuing
    with the next document's first sentences after a [SEP] (one boundary per row: the layout stays
    [CLS] A [SEP] B [SEP]; B is empty within a document). Every token of the shard is in exactly one row: a sentence
    longer than a row continues in the next one. Without `cross_documents`, RoBERTa's DOC-SENTENCES: B is always
    empty, a row ends at its document's end ([CLS] A [SEP], one document)."""
    cum = sentence_offsets
    budget = settings.max_seq_length - 3
    document_ends = cum[document_offsets[1:]]
    rows, start, total = [], 0, int(cum[-1]) if len(cum) else 0

    def last_boundary(low: int, high: int) -> int:
        """The last sentence boundary in (low, high], else high (a cut inside a sentence)."""
        k = int(np.searchsorted(cum, high, side="right")) - 1
        return int(cum[k]) if cum[k] > low else high

    while start < total:
        document_end = int(document_ends[np.searchsorted(document_ends, start, side="right")])
        a_end = last_boundary(start, min(start + budget, document_end))
        b_end = a_end
        if cross_documents and a_end == document_end < total and start + budget > document_end:
            next_end = int(document_ends[np.searchsorted(document_ends, document_end, side="right")])
            b_end = last_boundary(document_end, min(start + budget, next_end))
            if cum[np.searchsorted(cum, b_end)] != b_end:  # B is whole sentences: none fits, no B
                b_end = document_end
        rows.append((start, a_end, a_end, b_end, 0))
        start = b_end
    plan = np.array(rows, np.int64).reshape(-1, 5)
    return plan[rng.permutation(len(plan))]


def _truncate_pair(a_start, a_end, b_start, b_end, max_num_tokens, rng):
    """truncate_seq_pair in closed form: trim the longer segment (B on ties) one token at a time, each from a
    random end, until both fit."""
    len_a, len_b = a_end - a_start, b_end - b_start
    excess = np.maximum(len_a + len_b - max_num_tokens, 0)
    gap = np.abs(len_a - len_b)
    first = np.minimum(excess, gap)  # trims of the longer one until the lengths meet
    rest = excess - first  # then alternately B, A, B, ...
    trim_a = np.where(len_a > len_b, first, 0) + rest // 2
    trim_b = np.where(len_a > len_b, 0, first) + rest - rest // 2
    front_a = rng.binomial(trim_a, 0.5)
    front_b = rng.binomial(trim_b, 0.5)
    return a_start + front_a, a_end - (trim_a - front_a), b_start + front_b, b_end - (trim_b - front_b)


def instance_shapes(n: int, settings: EncodeSettings) -> dict[str, tuple[tuple[int, ...], type]]:
    """{name: (shape, dtype)} of the NVIDIA-schema arrays of `n` instances."""
    length, n_predictions = settings.max_seq_length, settings.max_predictions_per_seq
    return {
        "input_ids": ((n, length), np.int32),
        "input_mask": ((n, length), np.int8),
        "segment_ids": ((n, length), np.int8),
        "masked_lm_positions": ((n, n_predictions), np.int32),
        "masked_lm_ids": ((n, n_predictions), np.int32),
        "next_sentence_labels": ((n,), np.int8),
    }


def instance_lengths(plan: np.ndarray) -> np.ndarray:
    """Tokens of each instance of `plan` rows: [CLS] A [SEP] B [SEP], or [CLS] A [SEP] when B is empty (full
    sentences within a document, documents). The one count of build_batch and the packer: a longer one packs
    padding inside."""
    len_a, len_b = plan[:, 1] - plan[:, 0], plan[:, 3] - plan[:, 2]
    return len_a + len_b + 2 + (len_b > 0)


def build_batch(
    ids: np.ndarray, plan: np.ndarray, settings: EncodeSettings, vocab: Vocab, rng: np.random.Generator,
    out: dict[str, np.ndarray] | None = None, counts: dict | None = None,
) -> dict[str, np.ndarray]:
    """The NVIDIA-schema arrays of the instances in `plan` rows: [CLS] A [SEP] B [SEP], masked, padded;
    written into `out` (arrays of len(plan) rows, e.g. row ranges of a whole shard's) when given; per_token's masks
    lost to the cap are added to `counts`.

    `ids` are the shard's token ids followed by the padding id (vocab.pad), the value padding cells gather.
    """
    length, n_predictions = settings.max_seq_length, settings.max_predictions_per_seq
    if out is None:
        out = {name: np.empty(shape, dtype) for name, (shape, dtype) in instance_shapes(len(plan), settings).items()}
    rows = np.arange(len(plan))
    a_start, a_end, b_start, b_end, is_random = plan.T
    len_a = a_end - a_start
    n_tokens = instance_lengths(plan)
    col = np.arange(length)[None, :]
    # Source of each cell in `ids`: A's tokens, then B's, then the trailing 0; [CLS]/[SEP] are overwritten below.
    source = col + np.where(col <= len_a[:, None], (a_start - 1)[:, None], (b_start - len_a - 2)[:, None])
    source = np.where(col < (n_tokens - 1)[:, None], source, len(ids) - 1)
    input_ids = out["input_ids"]
    input_ids[...] = ids[source]
    flat_ids = input_ids.reshape(-1)
    row_start = rows * length
    flat_ids[row_start] = vocab.cls
    flat_ids[row_start + len_a + 1] = vocab.sep
    flat_ids[row_start + n_tokens - 1] = vocab.sep
    is_real = np.less(col, n_tokens[:, None], out=out["input_mask"].view(bool))
    segment_ids = np.greater_equal(col, (len_a + 2)[:, None], out=out["segment_ids"].view(bool))
    segment_ids &= is_real
    candidate = is_real & (col != (len_a + 1)[:, None]) & (col != (n_tokens - 1)[:, None])
    candidate[:, 0] = False
    out["next_sentence_labels"][...] = is_random
    if settings.objective != "nsp":
        segment_ids[...] = False  # one segment: the [SEP]s only separate documents
    if settings.masking == "dynamic":
        out["masked_lm_positions"][...] = 0
        out["masked_lm_ids"][...] = 0
        return out
    positions, labels = mask_rows(input_ids, candidate, n_tokens, settings, vocab, GeneratorDraws(rng), counts)
    out["masked_lm_ids"][...] = labels
    out["masked_lm_positions"][...] = positions
    return out


def ragged_instances(batches, lengths: np.ndarray, settings: EncodeSettings) -> RaggedInstances:
    """The instances of `batches` (build_batch's, in order) at their real `lengths`: each batch's tokens up to its
    instances' lengths and its leading predictions, so the shard takes memory for its real tokens only."""
    n_tokens = int(lengths.sum())
    input_ids, segment_ids = np.empty(n_tokens, np.int32), np.empty(n_tokens, np.int8)
    positions, labels, n_predictions, next_sentence_labels = [], [], [], []
    row, cell = 0, 0
    for batch in batches:
        real = np.arange(batch["input_ids"].shape[1]) < lengths[row : row + len(batch["input_ids"]), None]
        n = int(real.sum())
        input_ids[cell : cell + n] = batch["input_ids"][real]
        segment_ids[cell : cell + n] = batch["segment_ids"][real]
        valid = batch["masked_lm_positions"] > 0  # predictions lead their row (position 0 is [CLS])
        positions.append(batch["masked_lm_positions"][valid])
        labels.append(batch["masked_lm_ids"][valid])
        n_predictions.append(valid.sum(axis=1))
        next_sentence_labels.append(batch["next_sentence_labels"].copy())
        row, cell = row + len(batch["input_ids"]), cell + n

    def joined(parts, dtype):
        return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)

    return RaggedInstances(settings.max_seq_length, settings.max_predictions_per_seq, lengths, input_ids, segment_ids,
                           joined(positions, np.int32), joined(labels, np.int32), joined(n_predictions, np.int64),
                           joined(next_sentence_labels, np.int8))


def encode_shard(
    tokenized: str | os.PathLike,
    vocab_path: str | os.PathLike,
    output: str | os.PathLike,
    settings: EncodeSettings,
    seed: int,
    split: str,
    shard_index: int,
    compression: str = "gzip",
    packing: PackSettings | None = None,
) -> int:
    """Encode one tokenized shard into the HDF5 file `output`, packed (workflow.data.pack) unless `packing` is
    None; returns the number of instances. Masks drawn beyond a cap (per_token only) are counted in the log."""
    _check(settings, packing)
    if settings.masking == "dynamic" and settings.objective != "nsp" and settings.dupe_factor != 1:
        log.info("dupe_factor %d ignored: with dynamic masking, copies of %s rows would be identical",
                 settings.dupe_factor, settings.objective)
        settings = replace(settings, dupe_factor=1)
    masking = settings.of_split(split)  # the test split's masks at the held-out probability
    vocab = Vocab.read(vocab_path)
    ids, sentence_offsets, document_offsets = load_tokenized(tokenized)
    padded_ids = np.append(ids, vocab.pad).astype(ids.dtype)
    if len(ids) and int(ids.max()) >= vocab.size:
        raise UserError(f"{tokenized}: token id {int(ids.max())} is outside {vocab_path} ({vocab.size} tokens)")
    plan_rng, mask_rng = shard_rng(seed, split, shard_index)
    if settings.objective != "nsp":
        plan = plan_full_sentences(sentence_offsets, document_offsets, settings, plan_rng,
                                   cross_documents=settings.objective == "full_sentences")
        plan = np.tile(plan, (settings.dupe_factor, 1))  # static masks: dupe_factor differently masked copies
    else:
        plan = plan_instances(sentence_offsets, document_offsets, settings, plan_rng)
    n, length = len(plan), settings.max_seq_length
    batch_rows = max(CHUNK_ROWS, BATCH_CELLS // length // CHUNK_ROWS * CHUNK_ROWS)
    attributes = {
        **settings.attributes(),
        "seed": seed,
        "split": split,
        "shard_index": shard_index,
        "n_instances": n,
        "vocab_sha256": hashlib.sha256(Path(vocab_path).read_bytes()).hexdigest(),
        **pad_attributes(vocab.pad),
    }
    if settings.masking == "dynamic":  # what the load-time masker needs (workflow.train.masking)
        attributes.update(cls_id=vocab.cls, sep_id=vocab.sep, mask_id=vocab.mask)
    shapes = instance_shapes(n, settings)
    counts: dict = {}
    starts = tqdm(range(0, n, batch_rows), desc="encode", unit="batch", mininterval=5, disable=None)
    if packing is not None:
        # Packing needs every instance (its length is known from the plan): the shard's instances are kept at their
        # real lengths, each batch built at full length (its masks drawn as ever) and then cut to them.
        lengths = instance_lengths(plan)
        instances = ragged_instances(
            (build_batch(padded_ids, plan[start : start + batch_rows], masking, vocab, mask_rng, counts=counts)
             for start in starts), lengths, settings)
        started = time.process_time()
        packed = pack_ragged(instances, packing.max_sequences_per_pack, masking.masked_lm_prob, packing.algorithm,
                             str(tokenized), masking_rule=settings.masking_rule, counts=counts, pad_id=vocab.pad)
        check_packed(packed, vocab.cls, vocab.sep, (vocab.pad, vocab.mask), str(output))
        stats = packing_stats(lengths, length, len(packed["input_ids"]))
        packing_time = time.process_time() - started
        write_shard(output, {**attributes, **stats, **packing.attributes(length)},
                    {name: (packed[name].shape, packed[name].dtype) for name in sorted(packed)}, [packed],
                    compression, _masker_tables(settings, vocab))
        log.info("%s: %d instances in %d packs of %d, fill %.4f (unpacked %.4f); packing took %.3f CPU s",
                 output, n, stats["n_packs"], length, stats["fill"], stats["fill_unpacked"],
                 packing_time)
        _log_lost_masks(output, settings, counts)
        return n
    batches = (build_batch(padded_ids, plan[start : start + batch_rows], masking, vocab, mask_rng, counts=counts)
               for start in starts)
    write_shard(output, attributes, shapes, batches, compression, _masker_tables(settings, vocab))
    log.info("%s: %d instances of length %d", output, n, length)
    _log_lost_masks(output, settings, counts)
    return n


def _log_lost_masks(output, settings: EncodeSettings, counts: dict) -> None:
    """per_token's static masks drawn but not made, by reason (none where the cap is derived, but ~1e-9 of rows)."""
    if settings.masking_rule == "per_token" and settings.masking == "static":
        log.log(logging.WARNING if any(counts.values()) else logging.INFO,
                "%s: masks drawn but not made: %d over max_predictions_per_seq %d, %d over a packed row's width",
                output, counts.get("masks_over_cap", 0), settings.max_predictions_per_seq,
                counts.get("masks_over_row_width", 0))


def _masker_tables(settings: EncodeSettings, vocab: Vocab) -> dict[str, np.ndarray]:
    """Datasets a dynamic file adds for its masker: the vocab's "##" continuations (whole words)."""
    return {"continues_word": vocab.continues_word.astype(np.uint8)} if settings.masking == "dynamic" else {}


def _check(settings: EncodeSettings, packing: PackSettings | None) -> None:
    if packing is not None:
        packing.slots(settings.max_seq_length)  # refuses a count below 1
    if settings.masking not in MASKINGS:
        raise UserError(f"encode masking {settings.masking!r}: must be one of {', '.join(MASKINGS)}")
    if settings.objective not in OBJECTIVES:
        raise UserError(f"encode objective {settings.objective!r}: must be one of {', '.join(OBJECTIVES)}")
    if settings.masking_rule not in MASKING_RULES:
        raise UserError(f"encode masking_rule {settings.masking_rule!r}: must be one of {', '.join(MASKING_RULES)}")
    if not 0 < settings.held_out_masked_lm_prob <= 1:
        raise UserError(f"encode eval_masked_lm_prob {settings.held_out_masked_lm_prob}: must be in (0, 1]")
    if settings.max_seq_length < 8:
        raise UserError(f"encode max_seq_length {settings.max_seq_length}: must be at least 8")
    if settings.max_predictions_per_seq < 1:
        raise UserError(f"encode max_predictions_per_seq {settings.max_predictions_per_seq}: must be at least 1")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenized", required=True, help="tokenized shard (.npz from workflow.data.tokenize)")
    parser.add_argument("--vocab", required=True, help="the vocab.txt it was tokenized with")
    parser.add_argument("--output", required=True, help="HDF5 file to write")
    parser.add_argument("--max-seq-length", type=int, required=True)
    parser.add_argument("--max-predictions-per-seq", type=int, default=None,
                        help="most masked positions per instance; default: derived from the length and rates")
    parser.add_argument("--dupe-factor", type=int, default=5)
    parser.add_argument("--masked-lm-prob", type=float, default=0.15)
    parser.add_argument("--short-seq-prob", type=float, default=0.1)
    parser.add_argument("--whole-word-masking", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--masking", choices=MASKINGS, default="static")
    parser.add_argument("--objective", choices=OBJECTIVES, default="nsp")
    parser.add_argument("--masking-rule", choices=MASKING_RULES, default="google")
    parser.add_argument("--eval-masked-lm-prob", type=float, default=None,
                        help="the test split's masked_lm_prob; default: 0.15 under per_token, else --masked-lm-prob")
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--split", choices=sorted(SPLIT_CODES), required=True)
    parser.add_argument("--shard-index", type=int, required=True)
    parser.add_argument("--compression", choices=["gzip", "none"], default="gzip")
    parser.add_argument("--packing", action=argparse.BooleanOptionalAction, default=True,
                        help="pack the instances (workflow.data.pack); --no-packing writes NVIDIA's schema")
    parser.add_argument("--max-sequences-per-pack", default=PackSettings.max_sequences_per_pack,
                        help=f"most instances a row, or {AUTO}: as many as fit (workflow.data.pack.sequence_slots)")
    parser.add_argument("--pack-algorithm", choices=ALGORITHMS, default=PackSettings.algorithm)
    parser.add_argument("--packed-version", type=int, default=PACKED_VERSION,
                        help="the packed layout the workflow asks for (rules/functions/encode.smk): this one's only")
    args = parser.parse_args(argv)
    if args.packed_version != PACKED_VERSION:
        raise UserError(f"encode --packed-version {args.packed_version}: this encoder writes version {PACKED_VERSION}; "
                        f"the workflow's rules and workflow/data are of different versions")
    settings = EncodeSettings(
        max_seq_length=args.max_seq_length,
        max_predictions_per_seq=args.max_predictions_per_seq or 0,
        dupe_factor=args.dupe_factor,
        masked_lm_prob=args.masked_lm_prob,
        short_seq_prob=args.short_seq_prob,
        whole_word_masking=args.whole_word_masking,
        masking=args.masking,
        objective=args.objective,
        masking_rule=args.masking_rule,
        eval_masked_lm_prob=args.eval_masked_lm_prob,
    )
    if args.max_predictions_per_seq is None:
        settings = replace(settings, max_predictions_per_seq=derived_max_predictions(
            settings.max_seq_length, settings.masking_rule,
            (settings.masked_lm_prob, settings.held_out_masked_lm_prob)))
    packing = PackSettings(args.max_sequences_per_pack, args.pack_algorithm) if args.packing else None
    encode_shard(args.tokenized, args.vocab, args.output, settings, args.seed, args.split, args.shard_index,
                 args.compression, packing)


if __name__ == "__main__":
    run(main)
