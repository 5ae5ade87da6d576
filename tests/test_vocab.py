"""Stage 5: a given vocab is validated (special tokens by name) and copied as is; otherwise one is trained, the same
file for the same corpus."""
import collections
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import BertWordPieceTokenizer

from workflow.cli import UserError
from workflow.data.vocab import (SPECIAL_TOKENS, character_counts, choose_alphabet, copy_vocab, read_vocab,
                                 special_token_ids, train_vocab)

REPO = Path(__file__).resolve().parents[1]
TEXT = (
    "Ångström measured the Café's light in München.\nThe ÉCOLE opened in 1871.\n\n"
    "Rivers cross the northern plains.\nThe riverbank villages flourished during the nineteenth century.\n"
) * 40


def run_vocab(*args, **env_extra):
    env = dict(os.environ, PYTHONPATH=str(REPO), **env_extra)
    return subprocess.run([sys.executable, "-m", "workflow.data.vocab", *map(str, args)], capture_output=True, text=True, env=env)


def test_given_vocab_is_copied_byte_for_byte_with_specials_found_by_name(tmp_path):
    # Google's layout: [PAD] first, [unused*], then [UNK] [CLS] [SEP] [MASK] at 100-103.
    tokens = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "##s"]
    source = tmp_path / "google_vocab.txt"
    source.write_bytes(("\n".join(tokens) + "\n").encode())
    output = tmp_path / "data" / "vocab.txt"
    assert copy_vocab(source, output) == len(tokens)
    assert output.read_bytes() == source.read_bytes()
    assert special_token_ids(read_vocab(output)) == {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}


def test_vocab_without_mask_is_a_one_line_error_and_nothing_is_written(tmp_path):
    source = tmp_path / "vocab.txt"
    source.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nthe\n")
    output = tmp_path / "out" / "vocab.txt"
    result = run_vocab("--vocab-file", source, "--output", output)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == f"error: {source}: vocab lacks the special token(s) [MASK]"
    assert not output.exists()


@pytest.mark.parametrize(
    "content,message",
    [("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\nthe\n", ":7: duplicate token 'the' (first on line 6)"),
     ("[PAD]\n[UNK]\n\n[CLS]\n[SEP]\n[MASK]\n", ":3: empty token in vocab")],
)
def test_malformed_vocab_names_the_line(tmp_path, content, message):
    source = tmp_path / "vocab.txt"
    source.write_text(content)
    with pytest.raises(UserError, match=f"^{re.escape(str(source) + message)}$"):
        read_vocab(source)


def test_trained_vocab_is_lowercased_accent_stripped_wordpiece(tmp_path):
    shards = []
    for index in range(2):
        shards.append(tmp_path / f"shard_{index}.txt")
        shards[-1].write_text(TEXT)
    output = tmp_path / "vocab.txt"
    n_tokens = train_vocab(shards, output, size=120, lowercase=True)
    tokens = read_vocab(output)
    assert n_tokens == len(tokens) <= 120
    assert tokens[: len(SPECIAL_TOKENS)] == list(SPECIAL_TOKENS)
    assert any(token.startswith("##") for token in tokens)
    words = [token for token in tokens if token not in SPECIAL_TOKENS]
    assert all(token == token.lower() for token in words)
    assert not any(set(token) & set("ÅöéÉü") for token in tokens)  # accents stripped
    encoded = BertWordPieceTokenizer(str(output), lowercase=True).encode("Ångström rivers", add_special_tokens=False)
    assert "[UNK]" not in encoded.tokens


def test_training_on_empty_shards_is_a_clear_error(tmp_path):
    (tmp_path / "shard_0.txt").write_text("")
    result = run_vocab("--shard-dir", tmp_path, "--n-shards", 1, "--output", tmp_path / "vocab.txt")
    assert result.returncode == 1
    assert "shard_0.txt: training shards are empty" in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "vocab.txt").exists()


def test_unwritable_output_is_a_clear_error(tmp_path):
    source = tmp_path / "vocab.txt"
    source.write_text("\n".join(SPECIAL_TOKENS) + "\n")
    (tmp_path / "file").write_text("")
    output = tmp_path / "file" / "vocab.txt"  # parent is a file: fails even for root
    result = run_vocab("--vocab-file", source, "--output", output)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {output}: cannot write")


def test_trained_vocab_is_the_same_file_in_fresh_processes_whatever_the_threads(tmp_path, sample_dir):
    # Real prose (the sample books) as two shards; the plain trainer gives a different file in each process.
    for index, book in enumerate(sorted((sample_dir / "books").glob("*.txt"))):
        (tmp_path / f"shard_{index}.txt").write_bytes(book.read_bytes())
    digests = set()
    for run, (threads, seed) in enumerate([(1, "0"), (2, "1"), (4, "2"), (3, "3")]):
        output = tmp_path / f"vocab_{run}.txt"
        result = run_vocab("--shard-dir", tmp_path, "--n-shards", 2, "--size", 1000, "--threads", threads,
                           "--output", output, PYTHONHASHSEED=seed)
        assert result.returncode == 0, result.stderr
        digests.add(hashlib.sha256(output.read_bytes()).hexdigest())
    assert len(digests) == 1
    tokens = read_vocab(tmp_path / "vocab_0.txt")
    assert len(tokens) == 1000 and tokens[: len(SPECIAL_TOKENS)] == list(SPECIAL_TOKENS)


def test_alphabet_is_the_most_frequent_characters_ties_broken_by_character():
    counts = collections.Counter({"e": 9, "z": 4, "b": 4, "a": 4, "q": 1})
    assert choose_alphabet(counts, 3) == ["a", "b", "e"]  # of the three tied at 4, a and b (by character)
    assert choose_alphabet(collections.Counter(dict(reversed(counts.items()))), 3) == ["a", "b", "e"]
    assert choose_alphabet(counts, 10) == ["a", "b", "e", "q", "z"]


def test_character_counts_equal_counting_the_normalized_text(tmp_path):
    from tokenizers.normalizers import BertNormalizer

    text = TEXT + "ΟΔΟΣ İstanbul ﬁne cafe\u0301 東京 Straße\x07 tab\there\n"
    (tmp_path / "shard_0.txt").write_text(text, encoding="utf-8")
    (tmp_path / "shard_1.txt").write_text(text[::-1], encoding="utf-8")
    normalizer = BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=True, lowercase=True)
    expected = collections.Counter(char for part in (text, text[::-1]) for char in normalizer.normalize_str(part)
                                   if not char.isspace())
    counts = character_counts([tmp_path / "shard_0.txt", tmp_path / "shard_1.txt"], normalizer)
    assert counts == expected
    assert character_counts([tmp_path / "shard_0.txt", tmp_path / "shard_1.txt"], normalizer, processes=2) == expected
    assert counts["σ"] == 2 and "Σ" not in counts and "é" not in counts
