"""The masked-LM rules and the settings they read: the one rule of the encoder's static masks
(workflow.data.encode) and of the loader's dynamic ones (workflow.train.masking). Apart from encode so that a
training job imports it without the data half's text stack (nltk, wikiextractor).

Rules (`masking_rule`), 80/10/10 [MASK]/random/keep either way, [CLS]/[SEP] never chosen:
- google: Google's create_pretraining_data.py: min(max_predictions_per_seq, max(1, rint(n * masked_lm_prob)))
  predictions of a sequence of n tokens, chosen at random (whole words with whole_word_masking).
- per_token: each candidate token is masked on its own with probability masked_lm_prob (ModernBERT's, Hugging
  Face's DataCollatorForLanguageModeling); with whole_word_masking each word is (all its pieces or none). A draw
  above max_predictions_per_seq keeps the cap's worth of a random subset of the chosen tokens (whole words that
  fit); the rest stay unmasked and are counted (`masks_over_cap`). The derived cap (derived_max_predictions)
  makes that a ~1e-9 event per sequence.

API:
    EncodeSettings       the knobs of create_pretraining_data.py, with NVIDIA's phase-1 defaults
    Vocab.read(path)     the ids the rule needs: size, [CLS], [SEP], [MASK], the continuation table (a vocab.txt's
                         "##" pieces, a byte-level BPE's tokens without the word-start space: workflow.data.tokenizer)
    mask_rows(input_ids, candidate, n_tokens, settings, vocab, draws, counts=None)
                         -> (masked_lm_positions, masked_lm_ids); `counts["masks_over_cap"]` adds the lost draws
    GeneratorDraws(rng)  mask_rows' random numbers from a numpy Generator, in encode's order
    word_index(input_ids, candidate, vocab) -> [B, L] the word of each candidate cell (whole-word masking's words)
    derived_max_predictions(length, masking_rule, probabilities) -> int   max_predictions_per_seq where not given
    phase_max_predictions(encode, phase) -> int     the config's encode.<phase>.max_predictions_per_seq, or derived
    encode_config_error(config) -> one line or None  the encode section's relations (the Snakefile, at parse time)
"""
import math
import os
from dataclasses import asdict, dataclass, replace

import numpy as np

from workflow.phases import PHASES
from workflow.data.tokenizer import Vocabulary

MASKINGS = ("static", "dynamic")
MASKING_RULES = ("google", "per_token")
OBJECTIVES = ("nsp", "full_sentences", "documents")
EVAL_MASKED_LM_PROB = 0.15  # per_token's held-out masks by default: accuracies comparable with BERT's 15%
CAP_SIGMAS = 6  # per_token's derived cap: mean + 6 sd of the binomial count (exceeded ~1e-9 per sequence)
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
    objective: str = "nsp"  # nsp: segment pairs + NSP labels; full_sentences/documents: RoBERTa's sentences
    masking_rule: str = "google"  # google: Google's count per sequence; per_token: each token on its own
    eval_masked_lm_prob: float | None = None  # the test split's; None: 0.15 under per_token, else masked_lm_prob

    @property
    def held_out_masked_lm_prob(self) -> float:
        """The masked_lm_prob of the test split (eval_masked_lm_prob resolved)."""
        if self.eval_masked_lm_prob is not None:
            return self.eval_masked_lm_prob
        return EVAL_MASKED_LM_PROB if self.masking_rule == "per_token" else self.masked_lm_prob

    def of_split(self, split: str) -> "EncodeSettings":
        """The settings that mask `split`: the test split at the held-out probability."""
        return replace(self, masked_lm_prob=self.held_out_masked_lm_prob) if split == "test" else self

    def attributes(self) -> dict:
        """The files' root attributes of the settings: masking, objective and masking_rule only when not NVIDIA's
        recipe, eval_masked_lm_prob only when it differs from masked_lm_prob, so NVIDIA's files keep their bytes."""
        recipe = {"masking": "static", "objective": "nsp", "masking_rule": "google"}
        attributes = {key: value for key, value in asdict(self).items() if key not in recipe or recipe[key] != value}
        del attributes["eval_masked_lm_prob"]
        if self.held_out_masked_lm_prob != self.masked_lm_prob:
            attributes["eval_masked_lm_prob"] = self.held_out_masked_lm_prob
        return attributes


def derived_max_predictions(length: int, masking_rule: str, probabilities) -> int:
    """max_predictions_per_seq for sequences of `length` tokens masked at the largest of `probabilities` (the
    training and held-out ones): google's largest count, max(1, rint(length * p)), never cut; per_token's binomial
    count's mean + 6 sd rounded up to a multiple of 8 (at most `length`), exceeded ~1e-9 per sequence."""
    p = max(probabilities)
    if masking_rule == "google":
        return max(1, int(round(length * p)))
    bound = length * p + CAP_SIGMAS * math.sqrt(length * p * (1 - p))
    return min(length, -(-math.ceil(bound) // 8) * 8)


def phase_max_predictions(encode: dict, phase: str) -> int:
    """encode.<phase>.max_predictions_per_seq of the workflow config, derived where null or absent."""
    given = encode[phase].get("max_predictions_per_seq")
    if given is not None:
        return int(given)
    settings = settings_of_config(encode, phase)
    return derived_max_predictions(settings.max_seq_length, settings.masking_rule,
                                   (settings.masked_lm_prob, settings.held_out_masked_lm_prob))


ENCODE_KEYS = ("dupe_factor", "masked_lm_prob", "short_seq_prob", "whole_word_masking", "masking", "objective",
               "masking_rule", "eval_masked_lm_prob")  # EncodeSettings' keys of the encode section itself


def settings_of_config(encode: dict, phase: str, max_predictions_per_seq: int = 0) -> EncodeSettings:
    """The EncodeSettings of the workflow config's encode section for `phase` (max_predictions_per_seq as given), the
    section as validated: the schema's defaults filled in, none repeated here."""
    return EncodeSettings(max_seq_length=encode[phase]["max_seq_length"],
                          max_predictions_per_seq=max_predictions_per_seq, **{key: encode[key] for key in ENCODE_KEYS})


def encode_config_error(config: dict) -> str | None:
    """What the schema cannot say of the encode section, as one line naming the key; None when it fits."""
    encode = config["encode"]
    for phase in PHASES:
        key = f"encode.{phase}.max_predictions_per_seq"
        given = encode[phase].get("max_predictions_per_seq")
        length = encode[phase]["max_seq_length"]
        if given is not None and given > length:
            return f"config key '{key}': {given} exceeds encode.{phase}.max_seq_length ({length})"
        settings = settings_of_config(encode, phase)
        if given is None or settings.masking_rule != "per_token":
            continue
        probabilities = (settings.masked_lm_prob, settings.held_out_masked_lm_prob)
        needed = derived_max_predictions(length, "per_token", probabilities)
        if given < needed:
            return (f"config key '{key}': {given} would cut per_token masks (about {max(probabilities) * length:.0f} "
                    f"of {length} tokens at masked_lm_prob {max(probabilities):g}); at least {needed}, or null to "
                    f"derive it")
    return None


@dataclass(frozen=True)
class Vocab:
    size: int
    cls: int
    sep: int
    mask: int
    continues_word: np.ndarray  # [size] bool: the token continues a word (Vocabulary.continues_word)
    pad: int = 0  # the padding id (the tokenizer's pad role; BERT's [PAD] is 0, a GPT-2-style BPE's 0 is text)

    @classmethod
    def read(cls, path: str | os.PathLike) -> "Vocab":
        vocab = Vocabulary.load(path)
        return cls(vocab.size, vocab.cls, vocab.sep, vocab.mask, vocab.continues_word, vocab.pad)

    @property
    def never_masked(self) -> np.ndarray:
        """Ids never a masking candidate, whatever a file holds: the padding, [CLS], [SEP], [MASK] ([UNK] is text)."""
        return np.array([self.pad, self.cls, self.sep, self.mask])


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
              vocab: Vocab, draws, counts: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The masking of the rows `input_ids` [B, L] in place by settings.masking_rule (module docstring):
    (masked_lm_positions, masked_lm_ids) [B, P], ascending, zero-padded, P = max_predictions_per_seq. Candidates are
    the `candidate` cells (real tokens but [CLS]/[SEP]); google predicts min(P, max(1, rint(n_tokens *
    masked_lm_prob))) of them. 80% become [MASK], 10% a random vocab token, 10% stay. `draws` gives the random
    numbers (keys, fractions, tokens); `counts`, when given, gets per_token's draws beyond P ("masks_over_cap")."""
    length, n_predictions = input_ids.shape[1], settings.max_predictions_per_seq
    row_start = np.arange(len(input_ids)) * length
    flat_ids = input_ids.reshape(-1)
    keys = draws.keys(candidate.shape)
    if settings.masking_rule == "per_token":
        picked, over_cap = _choose_per_token(input_ids, candidate, n_predictions, settings, vocab, keys)
        if counts is not None:
            counts["masks_over_cap"] = counts.get("masks_over_cap", 0) + over_cap
    else:
        n_to_predict = np.minimum(n_predictions, np.maximum(1, np.rint(n_tokens * settings.masked_lm_prob))).astype(
            np.int64)
        if settings.whole_word_masking:
            picked = _choose_whole_words(input_ids, candidate, n_to_predict, vocab, keys)
        else:
            picked = _choose_tokens(candidate, n_to_predict, keys)
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


def _choose_per_token(input_ids: np.ndarray, candidate: np.ndarray, n_predictions: int, settings: EncodeSettings,
                      vocab: Vocab, keys: np.ndarray) -> tuple[np.ndarray, int]:
    """([B, L] columns of the chosen cells, unused slots L; the draws lost to the cap). A token (with
    whole_word_masking a word: column k of `keys` is the row's k-th word's) is drawn when its key < masked_lm_prob;
    a row drawing more than `n_predictions` keeps a random subset of them (the smallest keys) up to the cap."""
    batch, length = candidate.shape
    if settings.whole_word_masking:
        picked, drawn = _choose_whole_words(input_ids, candidate, np.full(batch, n_predictions), vocab, keys,
                                            settings.masked_lm_prob)
        chosen = picked < length
        return _leading_columns(chosen, n_predictions), int(drawn - chosen.sum())
    drawn = candidate & (keys < settings.masked_lm_prob)
    n_drawn = drawn.sum(axis=1)
    picked = _leading_columns(drawn, n_predictions)
    over = np.flatnonzero(n_drawn > n_predictions)
    if len(over):  # rare where the cap is derived: the cap's worth of the row's smallest keys, drawn ones all
        kept = np.sort(_choose_tokens(drawn[over], np.full(len(over), n_predictions), keys[over].copy()), axis=1)
        picked[over] = length
        picked[over, :kept.shape[1]] = kept
    return picked, int((n_drawn - np.minimum(n_drawn, n_predictions)).sum())


def _leading_columns(chosen: np.ndarray, width: int) -> np.ndarray:
    """[B, width]: the first `width` columns where `chosen` [B, L] holds, ascending, padded with L (no sort)."""
    batch, length = chosen.shape
    rows, columns = np.nonzero(chosen)  # row-major: each row's columns ascending
    rank = np.arange(len(rows)) - np.searchsorted(rows, rows)
    keep = rank < width
    out = np.full((batch, width), length, np.int64)
    out[rows[keep], rank[keep]] = columns[keep]
    return out


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


def word_index(input_ids: np.ndarray, candidate: np.ndarray, vocab: Vocab) -> np.ndarray:
    """[B, L] int32: the index in its row of the word each candidate cell belongs to (-1 before the first word;
    meaningless elsewhere): a word starts at a candidate that does not continue the candidate before it."""
    previous = np.zeros_like(candidate)
    previous[:, 1:] = candidate[:, :-1]
    starts = candidate & ~(vocab.continues_word[input_ids] & previous)
    return np.cumsum(starts, axis=1, dtype=np.int32) - 1


def _choose_whole_words(
    input_ids: np.ndarray, candidate: np.ndarray, n_to_predict: np.ndarray, vocab: Vocab, keys: np.ndarray,
    per_token_prob: float | None = None,
):
    """[B, L] columns of whole words in random order, each taken if it still fits in n_to_predict (Google's
    greedy); unused slots hold L. With `per_token_prob` only the words whose key is below it are drawn:
    (columns, pieces of the drawn words), the greedy then keeping those that fit the cap."""
    batch, length = candidate.shape
    word = word_index(input_ids, candidate, vocab)
    row_start = np.arange(batch)[:, None] * length
    flat_word = np.where(candidate, row_start + word, batch * length)
    word_length = np.bincount(flat_word.ravel(), minlength=batch * length + 1)[:-1]
    keys = keys.copy()
    keys[word_length.reshape(batch, length) == 0] = 2.0
    if per_token_prob is not None:  # the words not drawn leave the greedy: no key, no pieces
        keys[keys >= per_token_prob] = 2.0
        word_length = np.where(keys.reshape(-1) < 2.0, word_length, 0)
        drawn = int(word_length.sum())
        n_to_predict = np.minimum(n_to_predict, word_length.reshape(batch, length).sum(axis=1))  # rows end early
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
    columns = np.where(chosen, np.arange(length)[None, :], length)
    return (columns, drawn) if per_token_prob is not None else columns
