"""Google's masked-LM rule (create_pretraining_data.py: the number of predictions, [CLS]/[SEP] never chosen,
80/10/10 [MASK]/random/keep, whole-word option, max_predictions_per_seq) and the settings it reads: the one rule of
the encoder's static masks (workflow.data.encode) and of the loader's dynamic ones (workflow.train.masking). Apart
from encode so that a training job imports it without the data half's text stack (nltk, wikiextractor).

API:
    EncodeSettings       the knobs of create_pretraining_data.py, with NVIDIA's phase-1 defaults
    Vocab.read(path)     the ids the rule needs: size, [CLS], [SEP], [MASK], the continuation table (a vocab.txt's
                         "##" pieces, a byte-level BPE's tokens without the word-start space: workflow.data.tokenizer)
    mask_rows(input_ids, candidate, n_tokens, settings, vocab, draws) -> (masked_lm_positions, masked_lm_ids)
    GeneratorDraws(rng)  mask_rows' random numbers from a numpy Generator, in encode's order
"""
import os
from dataclasses import asdict, dataclass

import numpy as np

from workflow.data.tokenizer import Vocabulary

MASKINGS = ("static", "dynamic")
OBJECTIVES = ("nsp", "full_sentences")
WORD_BLOCK = 96  # whole-word masking: word ranks examined per block (~ the words a full instance needs)


@dataclass(frozen=True)
class EncodeSettings:
    """The knobs of create_pretraining_data.py, with NVIDIA's phase-1 defaults."""

    max_seq_length: int = 128
    max_predictions_per_seq: int = 20
    dupe_factor: int = 5
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    whole_word_masking: bool = False
    masking: str = "static"  # static: masks in the files (NVIDIA); dynamic: drawn by the loader (workflow.train.masking)
    objective: str = "nsp"  # nsp: segment pairs + NSP labels; full_sentences: RoBERTa's contiguous sentences

    def attributes(self) -> dict:
        """The files' root attributes of the settings: masking and objective only when not NVIDIA's recipe, so
        static NSP files keep their bytes."""
        recipe = {"masking": "static", "objective": "nsp"}
        return {key: value for key, value in asdict(self).items() if key not in recipe or recipe[key] != value}


@dataclass(frozen=True)
class Vocab:
    size: int
    cls: int
    sep: int
    mask: int
    continues_word: np.ndarray  # [size] bool: the token continues a word (Vocabulary.continues_word)

    @classmethod
    def read(cls, path: str | os.PathLike) -> "Vocab":
        vocab = Vocabulary.load(path)
        return cls(vocab.size, vocab.cls, vocab.sep, vocab.mask, vocab.continues_word)


class GeneratorDraws:
    """mask_rows' random numbers from one numpy Generator, in the order encode has always drawn them."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def keys(self, shape) -> np.ndarray:
        return self.rng.random(shape, dtype=np.float32)

    fractions = keys

    def tokens(self, where: np.ndarray, vocab_size: int) -> np.ndarray:
        return self.rng.integers(0, vocab_size, int(where.sum()))


def mask_rows(input_ids: np.ndarray, candidate: np.ndarray, n_tokens: np.ndarray, settings: EncodeSettings,
              vocab: Vocab, draws) -> tuple[np.ndarray, np.ndarray]:
    """Google's masking of the rows `input_ids` [B, L] in place: (masked_lm_positions, masked_lm_ids) [B, P],
    ascending, zero-padded. Predictions: min(max_predictions_per_seq, max(1, rint(n_tokens * masked_lm_prob))) of
    the `candidate` cells (real tokens but [CLS]/[SEP]), whole words with whole_word_masking; 80% become [MASK], 10%
    a random vocab token, 10% stay. `draws` gives the random numbers (keys, fractions, tokens)."""
    length, n_predictions = input_ids.shape[1], settings.max_predictions_per_seq
    row_start = np.arange(len(input_ids)) * length
    flat_ids = input_ids.reshape(-1)
    n_to_predict = np.minimum(n_predictions, np.maximum(1, np.rint(n_tokens * settings.masked_lm_prob))).astype(np.int64)
    if settings.whole_word_masking:
        picked = _choose_whole_words(input_ids, candidate, n_to_predict, vocab, draws.keys(candidate.shape))
    else:
        picked = _choose_tokens(candidate, n_to_predict, draws.keys(candidate.shape))
    # Positions in ascending order, zero-padded to max_predictions_per_seq (position 0 is [CLS], never masked).
    picked = np.sort(picked, axis=1)[:, :n_predictions]
    if picked.shape[1] < n_predictions:
        picked = np.pad(picked, ((0, 0), (0, n_predictions - picked.shape[1])), constant_values=length)
    valid = picked < length
    positions = np.where(valid, picked, 0)
    cell = row_start[:, None] + positions
    labels = np.where(valid, flat_ids[cell], 0)
    # 80% [MASK], 10% a random vocab token, 10% unchanged.
    draw = draws.fractions(positions.shape)
    flat_ids[cell[valid & (draw < 0.8)]] = vocab.mask
    to_random = valid & (draw >= 0.9)
    flat_ids[cell[to_random]] = draws.tokens(to_random, vocab.size)
    return positions, labels


def _choose_tokens(candidate: np.ndarray, n_to_predict: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """[B, k] columns of a uniform random subset of n_to_predict candidate positions per row (all of them if
    fewer); unused slots hold L. The subset is the n_to_predict smallest of the random `keys` [B, L]."""
    batch, length = candidate.shape
    np.copyto(keys, 2.0, where=~candidate)
    k = min(int(n_to_predict.max()), length)
    smallest = np.argpartition(keys, k - 1, axis=1)[:, :k]
    smallest_keys = keys.reshape(-1)[np.arange(batch)[:, None] * length + smallest]
    threshold = np.sort(smallest_keys, axis=1)[np.arange(batch), np.minimum(n_to_predict, k) - 1]
    keep = (smallest_keys <= threshold[:, None]) & (smallest_keys < 2.0)
    tied = np.flatnonzero(keep.sum(axis=1) > n_to_predict)  # equal float32 keys: rare, settle by rank
    if len(tied):
        rank = np.argsort(np.argsort(smallest_keys[tied], axis=1, kind="stable"), axis=1)
        keep[tied] &= rank < n_to_predict[tied, None]
    return np.where(keep, smallest, length)


def _choose_whole_words(
    input_ids: np.ndarray, candidate: np.ndarray, n_to_predict: np.ndarray, vocab: Vocab, keys: np.ndarray
) -> np.ndarray:
    """[B, L] columns of whole words in random order, each taken if it still fits in n_to_predict (Google's
    greedy); unused slots hold L."""
    batch, length = candidate.shape
    previous = np.zeros_like(candidate)
    previous[:, 1:] = candidate[:, :-1]
    starts = candidate & ~(vocab.continues_word[input_ids] & previous)
    word = np.cumsum(starts, axis=1, dtype=np.int32) - 1  # word index of each position (valid where candidate)
    row_start = np.arange(batch)[:, None] * length
    flat_word = np.where(candidate, row_start + word, batch * length)
    word_length = np.bincount(flat_word.ravel(), minlength=batch * length + 1)[:-1]
    keys = keys.copy()
    keys[word_length.reshape(batch, length) == 0] = 2.0
    order = row_start + np.argsort(keys, axis=1)  # flat index of each row's words, in random order
    word_taken = np.zeros(batch * length, bool)
    count = np.zeros(batch, np.int64)
    n_words = int((word_length > 0).reshape(batch, length).sum(axis=1).max(initial=0))
    # Greedy over ranks, in blocks: rank-major blocks keep the loop on contiguous memory, and a batch is
    # usually full after the first block.
    for block in range(0, n_words, WORD_BLOCK):
        ranks = order[:, block : min(block + WORD_BLOCK, n_words)]
        length_by_rank = np.ascontiguousarray(word_length[ranks].T)
        taken_by_rank = np.zeros(length_by_rank.shape, bool)
        for k, pieces in enumerate(length_by_rank):
            fits = (pieces > 0) & (count + pieces <= n_to_predict)
            count += pieces * fits
            taken_by_rank[k] = fits
            if (count >= n_to_predict).all():
                break
        word_taken[ranks] = taken_by_rank.T
        if (count >= n_to_predict).all():
            break
    chosen = candidate & word_taken[row_start + np.maximum(word, 0)]
    return np.where(chosen, np.arange(length)[None, :], length)
