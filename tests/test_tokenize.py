"""Stage 6: each shard tokenized once into flat ids + sentence/document offsets, equal to BERT's reference tokenizer."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import BertTokenizer

from benchmarks import google_reference
from workflow.data.tokenize import load_tokenized, tokenize_shard
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
    assert counts == {"tokens": len(ids), "sentences": 8, "documents": 4}
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
