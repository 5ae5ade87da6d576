"""Stage 6: each shard tokenized once into flat ids + sentence/document offsets, equal to BERT's reference tokenizer."""
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import BertTokenizer

from benchmarks import google_reference
from workflow.data import tokenize
from workflow.data.tokenize import WordCache, bert_tokenizer, load_tokenized, tokenize_shard
from workflow.data.vocab import train_vocab

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [
    ["The Café in München opened in 1871.", "Its owner, Dr. Ångström, sold coffee (and tea)!"],
    ["A one-sentence document with naïve résumé words."],
    ["Rivers cross the northern plains.", "\x00\x01", "Villages grew near 3.14 km of riverbank, e.g. Zürich."],
    ["\u200b"],  # a document whose only line tokenizes to nothing: dropped
    ["中文 characters split one by one.", "UPPER and lower CASE.", "Tabs\tand   spaces."],
]


def shard_text() -> str:
    # Leading/trailing and repeated blank lines must not create empty documents.
    return "\n\n" + "\n\n\n".join("\n".join(document) for document in DOCUMENTS) + "\n\n"


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenize")
    text = directory / "shard_0.txt"
    text.write_text(shard_text(), encoding="utf-8")
    (directory / "train.txt").write_text(shard_text() * 20, encoding="utf-8")
    train_vocab([directory / "train.txt"], directory / "vocab.txt", size=200, lowercase=True)
    counts = tokenize_shard(text, directory / "vocab.txt", directory / "shard_0.npz")
    return directory, counts


def python_wordpiece(vocab: Path):
    """Google's FullTokenizer in Python (transformers 5's BertTokenizer is the Rust one): line -> ids."""
    tokenizer = google_reference.FullTokenizer(str(vocab), do_lower_case=True)
    return lambda line: tokenizer.convert_tokens_to_ids(tokenizer.tokenize(line))


def transformers_bert_tokenizer(vocab: Path):
    tokenizer = BertTokenizer(str(vocab), do_lower_case=True)
    return lambda line: tokenizer.encode(line, add_special_tokens=False)


@pytest.mark.parametrize("reference", [python_wordpiece, transformers_bert_tokenizer])
def test_ids_equal_the_reference_bert_tokenizer_per_sentence(tokenized, reference):
    directory, counts = tokenized
    ids, sentence_offsets, document_offsets = load_tokenized(directory / "shard_0.npz")
    encode = reference(directory / "vocab.txt")
    expected_documents = []
    for document in DOCUMENTS:
        sentences = [encode(line) for line in document]
        sentences = [sentence for sentence in sentences if sentence]
        if sentences:
            expected_documents.append(sentences)
    sentences = [ids[s:e].tolist() for s, e in zip(sentence_offsets[:-1], sentence_offsets[1:])]
    documents = [sentences[s:e] for s, e in zip(document_offsets[:-1], document_offsets[1:])]
    assert documents == expected_documents
    # dropped: the control characters' line and the zero-width space's, and the latter's document
    assert counts == {"tokens": len(ids), "sentences": 8, "documents": 4, "unknown_tokens": int((ids == 1).sum()),
                      "dropped_sentences": 2, "dropped_documents": 1}
    assert ids.dtype == np.uint16 and sentence_offsets.dtype == document_offsets.dtype == np.int64


def test_no_lowercase_keeps_case(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "Hello", "hello", "World", "."]) + "\n")
    text = tmp_path / "shard_0.txt"
    text.write_text("Hello World.\nhello\n")
    tokenize_shard(text, vocab, tmp_path / "cased.npz", lowercase=False)
    tokenize_shard(text, vocab, tmp_path / "uncased.npz", lowercase=True)
    assert load_tokenized(tmp_path / "cased.npz")[0].tolist() == [5, 7, 8, 6]
    assert load_tokenized(tmp_path / "uncased.npz")[0].tolist() == [6, 1, 8, 6]  # "world" is not in the vocab


def test_non_utf8_shard_is_an_error_naming_the_line(tokenized, tmp_path):
    directory, _ = tokenized
    text = tmp_path / "shard_0.txt"
    text.write_bytes(b"fine line\nsecond\n\xff\xfe broken\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    output = tmp_path / "out.npz"
    result = subprocess.run(
        [sys.executable, "-m", "workflow.data.tokenize", "--text", str(text), "--vocab", str(directory / "vocab.txt"),
         "--output", str(output)], capture_output=True, text=True, env=env)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {text}:3: not UTF-8")
    assert not output.exists()


# Pieces of adversarial text: what BERT's normaliser deletes, turns into a space, decomposes or isolates.
ADVERSARIAL = [
    "Café", "cafe\u0301", "a\u0316\u0301\u0308o", "\u0301", "\u0327\u0301", "Ångström", "İstanbul", "STRASSE", "straße",
    "ﬁne", "Ⅻ", "ǅemal", "\u200b", "\u200c", "\u200d", "\ufeff", "\x00", "\x01", "\x7f", "\x0b", "\x0c", "\x1c",
    "\x1d", "\x1e", "\x1f", "\x85", "\ufffd", "\t", "\r", "\xa0", "\u1680", "\u2000", "\u2009", "\u2028", "\u2029",
    "\u202f", "\u205f", "\u3000", "中文", "日本語", "한국어", "カタカナ", "𠀀", "😀", "...", "--", "—", "«»", "(1871).",
    "$5", "^_^", "e.g.", "U.S.", "3.14", "x" * 99, "y" * 100, "z" * 101, "é" * 100, "e\u0301" * 100, "中" * 120,
    "the", "of", "and", "river", "Zürich,", "naïve", "résumé", "",
]


def adversarial_lines(rng: random.Random, n: int) -> list[str]:
    """Random sentences of adversarial pieces, glued together or separated by single, double or no spaces."""
    lines = []
    for _ in range(n):
        parts = rng.choices(ADVERSARIAL, k=rng.randint(0, 12))
        lines.append("".join(part + rng.choice(["", "", " ", "  "]) for part in parts))
    return lines


@pytest.fixture(scope="module")
def adversarial_vocab(tmp_path_factory):
    directory = tmp_path_factory.mktemp("adversarial")
    (directory / "train.txt").write_text("\n".join(adversarial_lines(random.Random(1), 400)), encoding="utf-8")
    train_vocab([directory / "train.txt"], directory / "vocab.txt", size=300, lowercase=True)
    return directory / "vocab.txt"


@pytest.mark.parametrize("lowercase", [True, False])
def test_word_cache_ids_equal_encode_batch_on_adversarial_text(adversarial_vocab, lowercase, monkeypatch):
    monkeypatch.setattr(tokenize, "WORDS_PER_SEQUENCE", 7)  # unseen words span several encode_batch sequences
    tokenizer, _ = bert_tokenizer(adversarial_vocab, lowercase)
    rng = random.Random(0)
    cache = WordCache(tokenizer, np.uint16, max_words=64)  # small: the bound's eviction runs many times
    for _ in range(40):
        lines = adversarial_lines(rng, 100)
        expected = [encoding.ids for encoding in tokenizer.encode_batch(lines, add_special_tokens=False)]
        ids, lengths = cache.encode(lines)
        assert lengths.tolist() == [len(line_ids) for line_ids in expected]
        assert ids.tolist() == [i for line_ids in expected for i in line_ids]
        assert len(cache.index) <= 64 + len(set(" ".join(lines).split(" ")))
    assert 0 < cache.misses < cache.chunks  # both the cache and the tokenizer produced ids
    unknown = tokenizer.token_to_id("[UNK]")
    assert cache.encode(["x" * 101 + " " + "x" * 100])[0].tolist()[0] == unknown  # > 100 characters: [UNK]


def test_word_cache_splits_only_where_bert_sees_a_space(adversarial_vocab):
    """Python's str.split() splits at \\x1c-\\x1f, \\x0b, \\x0c, \\x85; BERT deletes them, joining their neighbours."""
    tokenizer, _ = bert_tokenizer(adversarial_vocab, True)
    joined, apart = "the\x1criver\x0band\x85of", "theriverandof"
    cache = WordCache(tokenizer, np.uint16)
    assert cache.encode([joined])[0].tolist() == tokenizer.encode(apart, add_special_tokens=False).ids
    assert cache.encode([joined])[0].tolist() != tokenizer.encode("the river and of", add_special_tokens=False).ids


@pytest.mark.parametrize("reference", [python_wordpiece, transformers_bert_tokenizer])
def test_shard_of_adversarial_text_equals_the_reference_bert_tokenizer(adversarial_vocab, tmp_path, reference):
    lines = [line for line in adversarial_lines(random.Random(2), 300) if line.strip()]
    text = tmp_path / "shard_0.txt"
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tokenize_shard(text, adversarial_vocab, tmp_path / "shard_0.npz")
    ids, sentence_offsets, _ = load_tokenized(tmp_path / "shard_0.npz")
    sentences = [ids[s:e].tolist() for s, e in zip(sentence_offsets[:-1], sentence_offsets[1:])]
    encode = reference(adversarial_vocab)
    with open(text, encoding="utf-8") as handle:  # as Google's reader: universal newlines (\r ends a line too)
        expected = [ids for ids in (encode(line.strip()) for line in handle) if ids]
    assert sentences == expected


def test_text_the_vocab_cannot_spell_is_counted_per_corpus_and_warned_of(tmp_path, caplog):
    """Each corpus's unknown tokens, as BERT's own tokenizer makes them; a shard past 0.5% of them warns."""
    import json

    english = [["Rivers cross the northern plains.", "Villages grew near the river."], ["The café opened in 1871."]]
    greek = [["Τα ποτάμια διασχίζουν τις πεδιάδες.", "Rivers and villages."]]
    (tmp_path / "train.txt").write_text("\n\n".join("\n".join(d) for d in english * 20), encoding="utf-8")
    train_vocab([tmp_path / "train.txt"], tmp_path / "vocab.txt", size=120, lowercase=True)
    (tmp_path / "training").mkdir()
    (tmp_path / "corpora.json").write_text(json.dumps({"corpora": ["en", "el"], "training": [[2, 1]], "test": []}))
    text = tmp_path / "training" / "shard_0.txt"
    text.write_text("\n\n".join("\n".join(d) for d in english + greek) + "\n", encoding="utf-8")
    reference = BertTokenizer(str(tmp_path / "vocab.txt"), do_lower_case=True)
    unknown = [sum(reference.encode(s, add_special_tokens=False).count(reference.unk_token_id) for d in docs for s in d)
               for docs in (english, greek)]
    assert unknown[0] == 0 and unknown[1] >= 5  # the Greek words, each one [UNK]

    with caplog.at_level("INFO", logger="workflow.data.tokenize"):
        counts = tokenize_shard(text, tmp_path / "vocab.txt", tmp_path / "shard_0.npz")
    with np.load(tmp_path / "shard_0.npz") as shard:
        assert shard["corpus_unknown_tokens"].tolist() == unknown
        ids = shard["ids"]
    assert counts["unknown_tokens"] == unknown[1] == int((ids == reference.unk_token_id).sum())
    share = 100 * unknown[1] / len(ids)
    assert f"{share:.2f}% of the tokens are the unknown token [UNK]" in caplog.text

    caplog.clear()  # English alone: none, and no warning
    text.write_text("\n\n".join("\n".join(d) for d in english) + "\n", encoding="utf-8")
    (tmp_path / "corpora.json").write_text(json.dumps({"corpora": ["en"], "training": [[2]], "test": []}))
    with caplog.at_level("INFO", logger="workflow.data.tokenize"):
        assert tokenize_shard(text, tmp_path / "vocab.txt", tmp_path / "shard_0.npz")["unknown_tokens"] == 0
    assert "(0 unknown)" in caplog.text and "unknown token" not in caplog.text
