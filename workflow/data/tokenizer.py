"""The vocabulary as every stage after vocab reads it, whatever its type (config vocab.type): a WordPiece vocab.txt or a
tokenizer.json (a byte-level BPE trained by stage vocab, or given: an existing ModernBERT's or RoBERTa's; or a
SentencePiece model: XLM-R's Unigram).

API:
    Vocabulary.load(path, vocab_type=None)   the file's type found by its content; a given type is checked (error
                                             naming config vocab.file and vocab.type)
    .type .path .size .tokens                "wordpiece" | "bpe" (a tokenizer.json); ids 0 .. size-1; token strings
    .special_ids .cls .sep .mask .pad .unk   the special tokens' ids by role (pad unk cls sep mask: BERT's [PAD] [UNK]
                                             [CLS] [SEP] [MASK], or RoBERTa's and XLM-R's <pad> <unk> <s> </s> <mask>)
    .special_tokens                          role -> the token's string
    .continues_word                          [size] bool: the token continues a word (whole-word masking's table)
    .text_tokenizer(normalization)           the `tokenizers.Tokenizer` stage tokenize encodes with, no specials added
    .prefix_space                            BPE: whether a text's first word gets its space (add_prefix_space;
                                             a SentencePiece model's Metaspace prepend)
    vocab_tokens(path)                       the tokens two vocabs compare by (a vocab.txt unvalidated)
    save_tokenizer(path, out_dir, normalization, model_max_length)   the tokenizer files of an HF export

Words: WordPiece marks a word's later pieces "##"; a byte-level BPE marks a word's first piece instead, with the
space before it (the byte-level alphabet writes it "Ġ"; a SentencePiece model "▁"): a BPE word is what the
pre-tokenizer splits at a space, so punctuation joined to a word ("world,") masks with it.
"""
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from workflow.data.vocab import (ROLES, SPECIAL_TOKENS, VOCAB_FILES, Normalization, check_vocab_type,
                                 pre_tokenizer_steps, read_tokenizer_json, read_vocab, special_token_ids,
                                 special_tokens, tokenizer_config, vocab_file_type, word_start)

CONTINUATION = "##"  # WordPiece: the prefix of a token that continues a word


@dataclass(frozen=True, eq=False)
class Vocabulary:
    """A vocab.txt or a tokenizer.json, read and validated."""

    path: Path
    type: str  # "wordpiece" | "bpe" (a tokenizer.json)
    tokens: tuple  # token string of each id (None for an id a tokenizer.json leaves unused)
    special_tokens: dict  # role (pad unk cls sep mask) -> the token
    special_ids: dict  # role -> the token's id
    added: frozenset = frozenset()  # BPE: ids of the file's added tokens (matched whole, each a word of its own)
    prefix_space: bool = False  # BPE: the pre-tokenizer's add_prefix_space (Metaspace: its prepend)
    word_start: str = "\u0120"  # BPE: the mark of a word's first piece ("Ġ"; SentencePiece: "▁")

    @classmethod
    def load(cls, path: str | os.PathLike, vocab_type: str | None = None) -> "Vocabulary":
        """Read `path` (type by its content); with `vocab_type`, a file of the other type is a UserError."""
        path = Path(path)
        if vocab_type is not None:
            check_vocab_type(path, vocab_type)
        if vocab_file_type(path) == "wordpiece":
            tokens = read_vocab(path)
            ids = special_token_ids(tokens)
            return cls(path, "wordpiece", tuple(tokens), dict(zip(ROLES, SPECIAL_TOKENS)),
                       {role: ids[token] for role, token in zip(ROLES, SPECIAL_TOKENS)})
        tokenizer = read_tokenizer_json(path)
        ids = tokenizer.get_vocab(with_added_tokens=True)
        tokens = [None] * (max(ids.values()) + 1)
        for token, index in ids.items():
            tokens[index] = token
        data = json.loads(path.read_text(encoding="utf-8"))
        added = frozenset(token["id"] for token in data.get("added_tokens", []))
        mark, prefix_space = word_start(data)
        named = special_tokens(tokenizer.token_to_id)
        return cls(path, "bpe", tuple(tokens), named, {role: ids[token] for role, token in named.items()}, added,
                   prefix_space, mark)

    @property
    def size(self) -> int:
        return len(self.tokens)

    cls = property(lambda self: self.special_ids["cls"])
    sep = property(lambda self: self.special_ids["sep"])
    mask = property(lambda self: self.special_ids["mask"])
    pad = property(lambda self: self.special_ids["pad"])
    unk = property(lambda self: self.special_ids["unk"])

    @property
    def continues_word(self) -> np.ndarray:
        """[size] bool: WordPiece: a "##" piece; BPE: a token that neither starts with the word-start mark ("Ġ",
        "▁") nor is an added token (the specials among them)."""
        if self.type == "wordpiece":
            return np.fromiter((token.startswith(CONTINUATION) for token in self.tokens), bool, self.size)
        return np.fromiter((token is not None and index not in self.added and not token.startswith(self.word_start)
                            for index, token in enumerate(self.tokens)), bool, self.size)

    def text_tokenizer(self, normalization: Normalization | None = None):
        """The `tokenizers.Tokenizer` that gives a text's ids, special tokens not added. WordPiece: BERT's normaliser
        (as `normalization` says; default lower-casing) and pre-tokeniser. BPE: the file's pipeline without its
        special tokens (a "[MASK]" in the text is text) and with a byte-level add_prefix_space off, so that the caller
        puts the space where it belongs (`prefix_space`; a SentencePiece model's "▁" is one mark for both)."""
        from tokenizers import Tokenizer, models, pre_tokenizers

        if self.type == "wordpiece":
            model = models.WordPiece({token: i for i, token in enumerate(self.tokens)}, unk_token="[UNK]",
                                     max_input_chars_per_word=100)
            tokenizer = Tokenizer(model)
            tokenizer.normalizer = (normalization or Normalization()).bert_normalizer()
            tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
            return tokenizer
        data = json.loads(self.path.read_text(encoding="utf-8"))
        # a "[MASK]" in the text is text, not the special token (as for WordPiece, whose pipeline has no added tokens)
        data["added_tokens"] = [token for token in data.get("added_tokens", []) if not token.get("special")]
        data.update(post_processor=None, truncation=None, padding=None)
        for step in pre_tokenizer_steps(data):
            if step.get("type") == "ByteLevel":
                step["add_prefix_space"] = False
        return Tokenizer.from_str(json.dumps(data))


def vocab_tokens(path: str | os.PathLike) -> list:
    """The tokens of a vocab.txt (its whitespace-separated words, not validated: a model's own vocab may lack the
    specials) or of a tokenizer.json (validated), by id: what two vocabs compare by."""
    if vocab_file_type(path) == "wordpiece":
        return Path(path).read_text(encoding="utf-8").split()
    return list(Vocabulary.load(path).tokens)


def save_tokenizer(vocab_path: str | os.PathLike, out_dir: str | os.PathLike,
                   normalization: Normalization | None = None, model_max_length: int = 512) -> list[str]:
    """Write the tokenizer files of an HF model directory for the vocab `vocab_path` into `out_dir`; returns their
    names. WordPiece: vocab.txt (a copy), and with `normalization` tokenizer_config.json (BertTokenizer and its
    casing). BPE: tokenizer.json (a copy) and tokenizer_config.json (PreTrainedTokenizerFast, its special tokens
    named by role), which AutoTokenizer loads."""
    out_dir = Path(out_dir)
    vocab_type = vocab_file_type(vocab_path)
    shutil.copyfile(vocab_path, out_dir / VOCAB_FILES[vocab_type])
    if vocab_type == "wordpiece":
        if normalization is None:
            return [VOCAB_FILES[vocab_type]]
        config = tokenizer_config(normalization, model_max_length)
    else:
        named = Vocabulary.load(vocab_path).special_tokens
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
                  "clean_up_tokenization_spaces": False,
                  **{f"{role}_token": named[role] for role in ("unk", "sep", "pad", "cls", "mask")},
                  "model_input_names": ["input_ids", "attention_mask"]}  # as ModernBERT's: no segment embeddings
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return [VOCAB_FILES[vocab_type], "tokenizer_config.json"]
