"""Stage tokenize: tokenize one text shard once (WordPiece or byte-level BPE), for both pretraining phases to reuse.

Input: one sentence per line, a blank line between documents (UTF-8). Output: an .npz with
  ids               [T]        uint16 (int32 for vocabs over 65,536 tokens): every token of the shard, in order
  sentence_offsets  [S+1]      int64: sentence s is ids[sentence_offsets[s]:sentence_offsets[s+1]]
  document_offsets  [D+1]      int64: document d is sentences document_offsets[d] to document_offsets[d+1]
  corpus_tokens     [C]        int64: the tokens of each corpus, in the order of shard's corpora.json beside the splits
                               (absent without one)
  corpus_unknown_tokens [C]    int64: of those, the vocab's unknown token ([UNK]: text the vocab cannot spell; absent
                               without corpora.json)
Sentences that tokenize to nothing and documents without sentences are dropped (as Google's script does), counted in
the log. Text that becomes the unknown token is counted and logged, and a shard where it passes UNKNOWN_WARNING_SHARE
of the tokens warns: a vocab that does not fit the text (another script or language, or other normalisation).
Ids are those of `tokenizers`' BERT pipeline, token for token; each distinct word is tokenized once (WordCache).
With a byte-level BPE, those of its tokenizer.json on each sentence, a space before each (before a document's first
only where the file adds a prefix space): the ids of the whole document, cut at its sentences (ByteLevelCache).
"""
import argparse
import json
import logging
import os
import re
from itertools import islice
from pathlib import Path
from typing import Sequence

import numpy as np
from tqdm import tqdm

from workflow.atomic import atomic_path
from workflow.cli import UserError, run
from workflow.data.shard import MANIFEST
from workflow.data.tokenizer import Vocabulary
from workflow.data.vocab import Normalization

log = logging.getLogger(__name__)

BATCH_LINES = 8192  # sentences per batch: bounds memory, amortises the per-batch numpy work
UNKNOWN_WARNING_SHARE = 0.005  # Google's uncased vocab on English Wikipedia: well under 0.1% of the tokens
WORDS_PER_SEQUENCE = 1024  # unseen chunks per encode_batch sequence
CACHE_WORDS = 1 << 19  # distinct chunks cached (~70 MB); a full-size shard may hold ~1 M, the frequent ones first


def bert_tokenizer(vocab_path: str | os.PathLike, lowercase: bool = True, normalization: Normalization | None = None):
    """A `tokenizers` BERT WordPiece tokenizer (BERT normaliser and pre-tokeniser), no special tokens added;
    normalising as `normalization` (default: `lowercase`, accents as lowercase, CJK characters apart)."""
    vocab = Vocabulary.load(vocab_path, "wordpiece")
    return vocab.text_tokenizer(normalization or Normalization(lowercase)), vocab.size


def read_documents(text_path: str | os.PathLike) -> tuple[list[str], list[int]]:
    """Non-blank lines of a shard and, per line, the index of the document it belongs to."""
    try:
        text = Path(text_path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{text_path}: text shard not found") from None
    except UnicodeDecodeError as error:
        line = text_line_of(text_path, error.start)
        raise UserError(f"{text_path}:{line}: not UTF-8 ({error.reason})") from None
    lines: list[str] = []
    documents: list[int] = []
    document = 0
    for line in text.split("\n"):
        if line.strip():
            lines.append(line)
            documents.append(document)
        elif lines and documents[-1] == document:
            document += 1
    return lines, documents


def text_line_of(path: str | os.PathLike, byte: int) -> int:
    with open(path, "rb") as handle:
        return handle.read(byte).count(b"\n") + 1


class WordCache:
    """Token ids of space-delimited chunks, each distinct chunk run through the real tokenizer once.

    Exact because BERT's normaliser (clean_text, CJK spacing, NFD accent stripping, lowercase) maps characters one
    by one and keeps an ASCII space a space (a combining mark cannot reorder across it), and the pre-tokeniser
    splits at every space: a sentence's ids are the concatenation of its space-separated chunks' ids. Only U+0020
    separates chunks: Python's str.split() also splits at \\x0b \\x0c \\x1c-\\x1f \\x85, which BERT deletes as
    control characters, joining their neighbours. Bounded: past `max_words` chunks it keeps the first `max_words // 2`
    (the frequent ones arrive first in Zipfian text).
    """

    def __init__(self, tokenizer, dtype, max_words: int = CACHE_WORDS):
        self.tokenizer, self.dtype, self.max_words = tokenizer, dtype, max_words
        self.index: dict[str, int] = {}  # chunk -> its row in starts/lengths
        self.ids = np.zeros(0, dtype)  # every cached chunk's ids, back to back
        self.starts = np.zeros(0, np.int64)
        self.lengths = np.zeros(0, np.int64)
        self.chunks = self.misses = 0

    def encode(self, lines: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of `lines`, flat, and the per-line token counts: equal to encode_batch's, token for token."""
        chunks, chunks_per_line = self._split(lines)
        new = set(chunks).difference(self.index)
        if len(self.index) + len(new) > self.max_words:
            self._shrink()
            new = set(chunks).difference(self.index)
        self._add(list(new))
        rows = np.fromiter(map(self.index.__getitem__, chunks), np.int64, len(chunks))
        lengths, starts = self.lengths[rows], self.starts[rows]
        ends = np.cumsum(lengths)
        # Position t of the output is ids[starts[chunk] + (t - first output position of chunk)].
        gather = np.repeat(starts - (ends - lengths), lengths) + np.arange(ends[-1] if len(ends) else 0)
        first_chunks = np.zeros(len(lines), np.int64)  # every line has count(" ") + 1 chunks
        np.cumsum(chunks_per_line[:-1], out=first_chunks[1:])
        self.chunks += len(chunks)
        self.misses += len(new)
        return self.ids[gather], np.add.reduceat(lengths, first_chunks) if len(lines) else np.zeros(0, np.int64)

    @staticmethod
    def _split(lines: Sequence[str]) -> tuple[list[str], np.ndarray]:
        """The chunks of `lines`, back to back, and how many each line has (every line count(" ") + 1)."""
        chunks_per_line = np.fromiter((line.count(" ") + 1 for line in lines), np.int64, len(lines))
        return " ".join(lines).split(" "), chunks_per_line

    def _add(self, words: list[str]) -> None:
        # Many words per Encoding (one per word costs ~6 µs more), joined by the spaces they were split at; a
        # token belongs to the word its first character's offset falls in.
        groups = [words[i : i + WORDS_PER_SEQUENCE] for i in range(0, len(words), WORDS_PER_SEQUENCE)]
        encodings = self.tokenizer.encode_batch([" ".join(group) for group in groups], add_special_tokens=False)
        ids, lengths = [], []
        for group, encoding in zip(groups, encodings):
            word_starts = np.cumsum([0] + [len(word) + 1 for word in group[:-1]])
            token_starts = np.fromiter((start for start, _ in encoding.offsets), np.int64, len(encoding))
            token_words = np.searchsorted(word_starts, token_starts, side="right") - 1
            lengths.append(np.bincount(token_words, minlength=len(group)))
            ids.append(np.asarray(encoding.ids, self.dtype))
        lengths = np.concatenate(lengths) if words else np.zeros(0, np.int64)
        self.index.update(zip(words, range(len(self.index), len(self.index) + len(words))))
        self.starts = np.concatenate([self.starts, len(self.ids) + np.cumsum(lengths) - lengths])
        self.lengths = np.concatenate([self.lengths, lengths])
        self.ids = np.concatenate([self.ids, *ids])

    def _shrink(self) -> None:
        self.index = dict(islice(self.index.items(), self.max_words // 2))
        keep = len(self.index)
        self.lengths, self.starts = self.lengths[:keep], self.starts[:keep]
        self.ids = self.ids[: int(self.starts[-1] + self.lengths[-1]) if keep else 0]


class ByteLevelCache(WordCache):
    r"""WordCache for a byte-level BPE: a chunk begins at a space between two non-spaces and keeps that space.

    Exact because the GPT-2 pre-tokenizer regex (`'s| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`)
    ends every piece before such a space and starts the next with it, looking ahead only within runs of whitespace;
    so a text's ids are its chunks' ids back to back (with no normaliser; Python's \s is a superset of the regex's,
    so a split here is a split there). Every chunk is encoded as its own sequence: byte-level pieces carry their
    space.
    """

    BOUNDARY = re.compile(r"(?<=\S)(?= \S)")

    @classmethod
    def _split(cls, lines: Sequence[str]) -> tuple[list[str], np.ndarray]:
        per_line = [cls.BOUNDARY.split(line) for line in lines]
        return [chunk for chunks in per_line for chunk in chunks], np.fromiter(map(len, per_line), np.int64, len(lines))

    def _add(self, words: list[str]) -> None:
        encodings = self.tokenizer.encode_batch(words, add_special_tokens=False) if words else []
        lengths = np.fromiter(map(len, encodings), np.int64, len(encodings))
        ids = [np.asarray(encoding.ids, self.dtype) for encoding in encodings]
        self.index.update(zip(words, range(len(self.index), len(self.index) + len(words))))
        self.starts = np.concatenate([self.starts, len(self.ids) + np.cumsum(lengths) - lengths])
        self.lengths = np.concatenate([self.lengths, lengths])
        self.ids = np.concatenate([self.ids, *ids])


class LineCache(ByteLevelCache):
    """Whole lines as chunks: for a tokenizer.json whose normaliser or added tokens may join text across a space."""

    @staticmethod
    def _split(lines: Sequence[str]) -> tuple[list[str], np.ndarray]:
        return list(lines), np.ones(len(lines), np.int64)


def byte_level_cache(tokenizer) -> type:
    """ByteLevelCache where its split is exact for `tokenizer` (no normaliser; no added token that spans a space
    between non-spaces or strips the spaces beside it), else LineCache."""
    crossing = any(re.search(r"\S \S", token.content) or token.lstrip or token.rstrip
                   for token in tokenizer.get_added_tokens_decoder().values())
    return ByteLevelCache if tokenizer.normalizer is None and not crossing else LineCache


def prefixed_lines(lines: Sequence[str], line_documents: Sequence[int], prefix_space: bool) -> list[str]:
    """Each line with the space a byte-level BPE sees before it inside its document: every line but a document's
    first, and that one too with `prefix_space` (the tokenizer's add_prefix_space); none before a leading space."""
    first = np.diff(np.asarray(line_documents, np.int64), prepend=-1) != 0
    return [line if line.startswith(" ") or (is_first and not prefix_space) else " " + line
            for line, is_first in zip(lines, first.tolist())]


def tokenize_lines(tokenizer, lines: Sequence[str], dtype, max_words: int = CACHE_WORDS,
                   cache_class: type = WordCache) -> tuple[np.ndarray, ...]:
    """Token ids of every line, flat, and the per-line token counts."""
    cache = cache_class(tokenizer, dtype, max_words)
    pieces: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    for start in tqdm(range(0, len(lines), BATCH_LINES), desc="tokenize", unit="batch", mininterval=5, disable=None):
        ids, batch_lengths = cache.encode(lines[start : start + BATCH_LINES])
        pieces.append(ids)
        lengths.append(batch_lengths)
    if cache.chunks:
        log.info("word cache: %d chunks, %d tokenized (%.1f%%)", cache.chunks, cache.misses,
                 100 * cache.misses / cache.chunks)
    if not pieces:
        return np.zeros(0, dtype), np.zeros(0, np.int64)
    return np.concatenate(pieces), np.concatenate(lengths)


def tokenize_shard(
    text_path: str | os.PathLike, vocab_path: str | os.PathLike, output: str | os.PathLike, lowercase: bool = True,
    normalization: Normalization | None = None,
) -> dict[str, int]:
    """Tokenize one shard into `output` (.npz, see the module doc); returns token/sentence/document counts."""
    vocab = Vocabulary.load(vocab_path)
    tokenizer = vocab.text_tokenizer(normalization or Normalization(lowercase))
    dtype = np.uint16 if vocab.size <= 1 << 16 else np.int32
    lines, line_documents = read_documents(text_path)
    if vocab.type == "bpe":
        ids, lengths = tokenize_lines(tokenizer, prefixed_lines(lines, line_documents, vocab.prefix_space), dtype,
                                      cache_class=byte_level_cache(tokenizer))
    else:
        ids, lengths = tokenize_lines(tokenizer, lines, dtype)
    line_unknown = unknown_per_line(ids, lengths, vocab.special_ids.get("unk"))
    corpus_sums = per_corpus(text_path, line_documents, lengths, line_unknown)
    # Drop sentences with no tokens, then documents left with no sentences.
    documents_read = line_documents[-1] + 1 if line_documents else 0  # numbered from 0, each with a line
    kept = lengths > 0
    lengths = lengths[kept]
    line_documents = np.asarray(line_documents, dtype=np.int64)[kept]
    sentence_offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=sentence_offsets[1:])
    starts = np.flatnonzero(np.diff(line_documents, prepend=-1)) if len(line_documents) else np.zeros(0, np.int64)
    document_offsets = np.append(starts, len(lengths)).astype(np.int64)
    counts = {"tokens": int(len(ids)), "sentences": int(len(lengths)), "documents": int(len(starts)),
              "unknown_tokens": int(line_unknown.sum()), "dropped_sentences": int(len(kept) - kept.sum()),
              "dropped_documents": documents_read - int(len(starts))}
    try:
        with atomic_path(output) as temporary, open(temporary, "wb") as handle:
            extra = {} if corpus_sums is None else dict(zip(("corpus_tokens", "corpus_unknown_tokens"), corpus_sums))
            np.savez(handle, ids=ids, sentence_offsets=sentence_offsets, document_offsets=document_offsets, **extra)
    except OSError as error:
        raise UserError(f"{output}: cannot write ({error.strerror})") from None
    log.info("%s: %d tokens (%d unknown), %d sentences, %d documents; dropped: %d sentences and %d documents that "
             "tokenize to nothing", text_path, counts["tokens"], counts["unknown_tokens"], counts["sentences"],
             counts["documents"], counts["dropped_sentences"], counts["dropped_documents"])
    share = counts["unknown_tokens"] / max(counts["tokens"], 1)
    if share > UNKNOWN_WARNING_SHARE:
        log.warning("%s: %.2f%% of the tokens are the unknown token %s: %s does not spell this text (another script "
                    "or language, or the vocab.lowercase / vocab.strip_accents it was made with?)", text_path,
                    100 * share, vocab.special_tokens["unk"], vocab_path)
    return counts


def unknown_per_line(ids: np.ndarray, lengths: np.ndarray, unknown_id: int | None) -> np.ndarray:
    """How many of each line's tokens are the unknown token (none where the vocab has no such token). Memory: a bool
    per token and an int per unknown token, not an int64 per token."""
    if unknown_id is None:
        return np.zeros(len(lengths), np.int64)
    positions = np.flatnonzero(ids == unknown_id)
    lines = np.searchsorted(np.cumsum(lengths, dtype=np.int64), positions, side="right")
    return np.bincount(lines, minlength=len(lengths)).astype(np.int64)


def per_corpus(text_path: str | os.PathLike, line_documents: list[int], *line_counts: np.ndarray) -> list | None:
    """Each of `line_counts` (a number per line: tokens, unknown tokens) summed per corpus of the shard: its
    documents are the corpora's in order, as many of each as shard's corpora.json beside the splits says (None
    without one: a shard cut outside the workflow)."""
    text_path = Path(text_path)
    manifest = text_path.parent.parent / MANIFEST
    if not manifest.is_file():
        return None
    counts = json.loads(manifest.read_text(encoding="utf-8"))[text_path.parent.name][int(text_path.stem.split("_")[-1])]
    documents = np.asarray(line_documents, np.int64)
    ends = np.cumsum(counts, dtype=np.int64)
    sums = []
    for values in line_counts:
        per_document = np.bincount(documents, weights=values, minlength=sum(counts))
        if len(per_document) != sum(counts):
            raise UserError(f"{text_path}: {len(per_document)} documents, but {manifest} lists {sum(counts)}")
        cumulative = np.concatenate([[0], np.cumsum(per_document, dtype=np.int64)])
        sums.append(cumulative[ends] - cumulative[ends - np.asarray(counts, np.int64)])
    return sums


def load_tokenized(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, sentence_offsets, document_offsets) of a tokenized shard."""
    try:
        with np.load(path) as data:
            return data["ids"], data["sentence_offsets"], data["document_offsets"]
    except FileNotFoundError:
        raise UserError(f"{path}: tokenized shard not found") from None
    except (OSError, ValueError, KeyError) as error:
        raise UserError(f"{path}: not a tokenized shard ({error})") from None


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", required=True, help="text shard: one sentence per line, blank line between documents")
    parser.add_argument("--vocab", required=True, help="WordPiece vocab.txt or byte-level BPE tokenizer.json")
    parser.add_argument("--output", required=True, help=".npz to write")
    Normalization.add_arguments(parser)
    parser.add_argument("--threads", type=int, default=1, help="tokenizer threads")
    args = parser.parse_args(argv)
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # read by tokenizers' thread pool on first use
    tokenize_shard(args.text, args.vocab, args.output, normalization=Normalization.from_args(args))


if __name__ == "__main__":
    run(main)
