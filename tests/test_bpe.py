"""vocab.type bpe: a byte-level BPE tokenizer.json trained the same in any process (or given), read through the one
Vocabulary of workflow.data.tokenizer by the tokenize stage, the masking rule and the export."""
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from workflow.cli import UserError
from workflow.data.encode import encode_shard
from workflow.data.extract import extract
from workflow.data.format import format_corpus
from workflow.data.masking_rule import EncodeSettings, Vocab
from workflow.data.tokenize import (ByteLevelCache, LineCache, load_tokenized, read_documents, tokenize_lines,
                                    tokenize_shard)
from workflow.data.tokenizer import Vocabulary, save_tokenizer
from workflow.data.vocab import SPECIAL_TOKENS, train_bpe, train_vocab

REPO = Path(__file__).resolve().parents[1]


def run_vocab(*args, **env_extra):
    env = dict(os.environ, PYTHONPATH=str(REPO), **env_extra)
    return subprocess.run([sys.executable, "-m", "workflow.data.vocab", *map(str, args)], capture_output=True,
                          text=True, env=env)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, sample_dir):
    """The sample's Wikipedia articles as formatted text (one sentence a line) and the sample books: two shards."""
    directory = tmp_path_factory.mktemp("bpe")
    extract(sample_dir / "enwiki-sample-pages-articles.xml.bz2", directory / "wikipedia.jsonl", processes=1)
    format_corpus(directory / "wikipedia.jsonl", directory / "shard_0.txt", min_article_chars=100)
    books = sorted((sample_dir / "books").glob("*.txt"))
    (directory / "shard_1.txt").write_bytes(b"".join(book.read_bytes() for book in books))
    return directory


@pytest.fixture(scope="module")
def trained(corpus):
    train_bpe([corpus / "shard_0.txt", corpus / "shard_1.txt"], corpus / "tokenizer.json", size=1500)
    return corpus / "tokenizer.json"


def test_trained_bpe_is_the_same_file_in_two_fresh_processes(corpus, trained):
    digests = set()
    for run, (threads, seed) in enumerate([(1, "0"), (2, "1")]):
        output = corpus / f"tokenizer_{run}.json"
        result = run_vocab("--type", "bpe", "--shard-dir", corpus, "--n-shards", 2, "--size", 1500,
                           "--threads", threads, "--output", output, PYTHONHASHSEED=seed)
        assert result.returncode == 0, result.stderr
        digests.add(hashlib.sha256(output.read_bytes()).hexdigest())
    assert digests == {hashlib.sha256(trained.read_bytes()).hexdigest()}


def test_trained_bpe_has_berts_specials_first_and_a_cls_sep_post_processor(trained):
    vocab = Vocabulary.load(trained, "bpe")
    assert vocab.type == "bpe" and vocab.size == 1500 and vocab.prefix_space
    assert vocab.tokens[:5] == SPECIAL_TOKENS
    assert (vocab.pad, vocab.unk, vocab.cls, vocab.sep, vocab.mask) == (0, 1, 2, 3, 4)
    tokenizer = Tokenizer.from_file(str(trained))
    single = tokenizer.encode("The river.")
    assert single.tokens[0] == "[CLS]" and single.tokens[-1] == "[SEP]" and single.tokens[1] == "\u0120The"
    pair = tokenizer.encode("The river.", "A town.")
    assert pair.tokens.count("[SEP]") == 2 and pair.type_ids[-1] == 1 and pair.type_ids[0] == 0
    assert json.loads(trained.read_text())["normalizer"] is None  # cased: nothing lost


@pytest.mark.parametrize("text", ["The Café in München opened in 1871.", "Tabs\tand   spaces,  e.g.\u00a0this",
                                  "中文 and emoji 😀 — “quotes” [MASK] \x00\x07", " leading space"])
def test_trained_bpe_round_trips_text(trained, text):
    tokenizer = Vocabulary.load(trained).text_tokenizer()
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text
    assert 4 not in ids  # "[MASK]" in the text is text, not the special token


def test_continues_word_marks_the_pieces_after_a_word_start(trained, tmp_path):
    vocab = Vocabulary.load(trained)
    index = {token: i for i, token in enumerate(vocab.tokens)}
    continues = vocab.continues_word
    assert not continues[[index[token] for token in SPECIAL_TOKENS]].any()
    assert not continues[index["\u0120the"]] and not continues[index["\u0120"]]
    assert continues[index["e"]] and continues[index[","]]
    pieces = vocab.text_tokenizer().encode(" lighthouse keepers").tokens
    assert len(pieces) > 2 and [continues[index[piece]] for piece in pieces].count(False) == 2
    (tmp_path / "vocab.txt").write_text("\n".join([*SPECIAL_TOKENS, "the", "##s", "#"]) + "\n")
    wordpiece = Vocabulary.load(tmp_path / "vocab.txt", "wordpiece")
    assert wordpiece.continues_word.tolist() == [False] * 6 + [True, False]
    masking = Vocab.read(trained)
    assert (masking.size, masking.cls, masking.sep, masking.mask) == (1500, 2, 3, 4)
    assert np.array_equal(masking.continues_word, continues)


def test_tokenized_shard_is_each_document_tokenized_whole(corpus, trained):
    """Sentence by sentence (a space before each) equals tokenizing the document, on the sample's Wikipedia text."""
    counts = tokenize_shard(corpus / "shard_0.txt", trained, corpus / "shard_0.npz")
    ids, sentence_offsets, document_offsets = load_tokenized(corpus / "shard_0.npz")
    assert ids.dtype == np.uint16 and counts["tokens"] == len(ids) > 10000
    reference = Tokenizer.from_file(str(trained))
    lines, documents = read_documents(corpus / "shard_0.txt")
    for document in range(counts["documents"]):
        text = " ".join(line for line, index in zip(lines, documents) if index == document)
        start, end = sentence_offsets[document_offsets[document]], sentence_offsets[document_offsets[document + 1]]
        assert ids[start:end].tolist() == reference.encode(text, add_special_tokens=False).ids
    first = sentence_offsets[: -1]
    assert all(Vocabulary.load(trained).tokens[token].startswith("\u0120") for token in ids[first])


def test_byte_level_cache_equals_encoding_each_line_on_adversarial_text(trained):
    tokenizer = Vocabulary.load(trained).text_tokenizer()
    rng = random.Random(0)
    pieces = ["a", "the", "world", ",", ".", "'s", " ", "  ", "\t", "\u00a0", "\u3000", "12", "3.5", "é", "東京", "\x1c",
              "\x85", "\u200b", "[MASK]", "e\u0301", "😀", "--", "'", "’s", "  \t ", "\r"]
    lines = [" " + "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))) for _ in range(2000)]
    expected = [tokenizer.encode(line).ids for line in lines]
    for cache_class in (ByteLevelCache, LineCache):
        ids, lengths = tokenize_lines(tokenizer, lines, np.uint16, max_words=100, cache_class=cache_class)
        assert ids.tolist() == [i for line in expected for i in line]
        assert lengths.tolist() == list(map(len, expected))


def modernbert_shaped(trained: Path, output: Path) -> Path:
    """A tokenizer.json laid out as ModernBERT's: no prefix space, the specials added after the merges, in its order."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = [line for line in trained.parent.joinpath("shard_1.txt").read_text().splitlines() if line]
    tokenizer.train_from_iterator(text, trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.add_special_tokens(["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"])
    tokenizer.save(str(output))
    return output


def test_a_given_tokenizer_json_is_copied_and_its_own_prefix_rule_kept(corpus, trained, tmp_path):
    given = modernbert_shaped(trained, tmp_path / "modernbert.json")
    output = tmp_path / "data" / "tokenizer.json"
    result = run_vocab("--type", "bpe", "--vocab-file", given, "--output", output)
    assert result.returncode == 0, result.stderr
    assert output.read_bytes() == given.read_bytes()
    vocab = Vocabulary.load(output, "bpe")
    first_special = vocab.size - 5
    assert not vocab.prefix_space and (vocab.unk, vocab.cls, vocab.sep, vocab.pad, vocab.mask) == tuple(
        range(first_special, first_special + 5))
    text = tmp_path / "shard.txt"
    text.write_text("Rivers cross the plains.\nThe town grew.\n\nA keeper lit the lamp.\n", encoding="utf-8")
    tokenize_shard(text, output, tmp_path / "shard.npz")
    ids, sentence_offsets, _ = load_tokenized(tmp_path / "shard.npz")
    reference = Tokenizer.from_file(str(given))
    documents = ["Rivers cross the plains. The town grew.", "A keeper lit the lamp."]
    assert ids.tolist() == [i for document in documents for i in reference.encode(document).ids]
    starts = [vocab.tokens[ids[offset]] for offset in sentence_offsets[:-1]]
    assert [start.startswith("\u0120") for start in starts] == [False, True, False]  # as inside the document


@pytest.mark.parametrize("kind", ["vocab.txt with bpe", "tokenizer.json with wordpiece"])
def test_a_vocab_file_of_the_other_type_is_one_error_line_naming_the_key(trained, tmp_path, kind):
    output = tmp_path / "out" / "vocab"
    if kind == "vocab.txt with bpe":
        given = tmp_path / "vocab.txt"
        given.write_text("\n".join([*SPECIAL_TOKENS, "the"]) + "\n")
        result = run_vocab("--type", "bpe", "--vocab-file", given, "--output", output)
        expected = (f"error: config key 'vocab.file': {given} is a WordPiece vocab.txt, but vocab.type bpe takes a "
                    "tokenizer.json (set vocab.type: wordpiece, or give a tokenizer.json)")
    else:
        given = trained
        result = run_vocab("--vocab-file", given, "--output", output)
        expected = (f"error: config key 'vocab.file': {given} is a tokenizer.json, but vocab.type wordpiece takes a "
                    "WordPiece vocab.txt (set vocab.type: bpe, or give a WordPiece vocab.txt)")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [expected]
    assert not output.exists()


def test_a_tokenizer_json_that_is_not_byte_level_bpe_is_refused(tmp_path, corpus):
    train_vocab([corpus / "shard_1.txt"], tmp_path / "vocab.txt", size=300)
    from tokenizers import BertWordPieceTokenizer

    BertWordPieceTokenizer(str(tmp_path / "vocab.txt")).save(str(tmp_path / "wordpiece.json"))
    with pytest.raises(UserError, match=r"a WordPiece tokenizer with pre-tokenizer BertPreTokenizer, not a byte-level"):
        Vocabulary.load(tmp_path / "wordpiece.json", "bpe")


def test_hf_export_loads_with_autotokenizer_and_gives_the_same_ids(corpus, trained, tmp_path):
    from transformers import AutoTokenizer

    assert save_tokenizer(trained, tmp_path, model_max_length=128) == ["tokenizer.json", "tokenizer_config.json"]
    hf = AutoTokenizer.from_pretrained(tmp_path)
    ours = Tokenizer.from_file(str(trained))
    lines, _ = read_documents(corpus / "shard_0.txt")
    for line in lines[:50]:
        assert hf(line)["input_ids"] == ours.encode(line).ids
    assert hf("A town.", "The river.")["input_ids"] == ours.encode("A town.", "The river.").ids
    assert (hf.cls_token_id, hf.sep_token_id, hf.mask_token_id, hf.pad_token_id, hf.unk_token_id) == (2, 3, 4, 0, 1)
    assert hf.model_max_length == 128


def test_whole_word_masking_with_bpe_masks_every_piece_of_a_word(corpus, trained, tmp_path):
    tokenize_shard(corpus / "shard_1.txt", trained, tmp_path / "books.npz")
    settings = EncodeSettings(max_seq_length=64, max_predictions_per_seq=10, whole_word_masking=True)
    encode_shard(tmp_path / "books.npz", trained, tmp_path / "books.hdf5", settings, seed=1, split="training",
                 shard_index=0)
    with h5py.File(tmp_path / "books.hdf5") as handle:
        input_ids, input_mask = handle["input_ids"][:], handle["input_mask"][:]
        positions, masked_ids = handle["masked_lm_positions"][:], handle["masked_lm_ids"][:]
    rows, slots = np.nonzero(positions)
    restored = input_ids.copy()
    restored[rows, positions[rows, slots]] = masked_ids[rows, slots]
    masked = np.zeros_like(restored, dtype=bool)
    masked[rows, positions[rows, slots]] = True
    vocab = Vocabulary.load(trained)
    continues = vocab.continues_word[restored] & (input_mask == 1)
    assert continues.sum() > 1000
    special = np.isin(restored, [vocab.cls, vocab.sep])
    inner = continues[:, 1:] & ~special[:, :-1]
    assert np.array_equal(masked[:, 1:][inner], masked[:, :-1][inner])


def test_a_model_export_carries_the_tokenizer_json(trained, tmp_path):
    from transformers import AutoTokenizer

    from workflow.train.models.bert import BertConfig, BertForPreTraining, save_pretrained

    config = BertConfig(vocab_size=1500, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=64)
    save_pretrained(BertForPreTraining(config), config, trained, tmp_path / "model")
    assert (tmp_path / "model" / "tokenizer.json").read_bytes() == trained.read_bytes()
    hf = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert hf("A town.")["input_ids"][0] == 2 and hf.model_max_length == 64


def test_the_config_check_names_a_vocab_file_of_the_other_type(trained):
    from workflow.data.vocab import vocab_config_error

    assert vocab_config_error({"vocab": {"file": str(trained), "type": "bpe"}}) is None
    assert vocab_config_error({"vocab": {"file": None, "type": "bpe"}}) is None
    assert vocab_config_error({"vocab": {"file": str(trained), "type": "wordpiece"}}).startswith(
        f"config key 'vocab.file': {trained} is a tokenizer.json, but vocab.type wordpiece")


def test_fine_tuning_features_with_bpe_equal_the_exports_autotokenizer(corpus, trained, tmp_path, sample_dir):
    from transformers import AutoTokenizer

    from workflow.classify.features import featurize as classify_features
    from workflow.data.features import load_tokenizer
    from workflow.squad.data import featurize as squad_features
    from workflow.squad.data import load_squad
    from workflow.tasks.readers import Example
    from workflow.tasks.tokens import IGNORE, featurize_tokens

    tokenizer = load_tokenizer(trained, lowercase=True)  # the casing arguments do not apply to a tokenizer.json
    save_tokenizer(trained, tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    pairs = [("The town grew.", "Rivers cross the plains."), ("A keeper lit the lamp, e.g. at 9.", "Yes!")]
    features = classify_features(pairs, np.zeros(2, np.int64), tokenizer, max_seq_length=32)
    for row, (a, b) in enumerate(pairs):
        ids = hf(a, b)["input_ids"]
        assert features["input_ids"][row, : len(ids)].tolist() == ids
        assert features["attention_mask"][row].sum() == len(ids)
    # SQuAD: each answer's tokens cover exactly its text (a byte-level token's span includes its leading space)
    examples = load_squad(sample_dir / "squad" / "train-sample.json", "1.1")[:40]
    squad = squad_features(examples, tokenizer, max_seq_length=128, doc_stride=64, max_query_length=32, training=False)
    checked = 0
    for row in np.flatnonzero(squad["start_positions"]):
        example = examples[squad["example_index"][row]]
        start = squad["offsets"][row, squad["start_positions"][row]][0]
        end = squad["offsets"][row, squad["end_positions"][row]][1]
        assert example.context[start:end].strip() == example.answers[0]["text"].strip()
        checked += 1
    assert checked > 10
    # token classification: the first piece of each word carries its tag
    words = ["Alderbrook", "is", "a", "market", "town", "."]
    tags = ["B-LOC", "O", "O", "O", "O", "O"]
    tokens = featurize_tokens([Example(1, (words,), tags)], {"O": 0, "B-LOC": 1}, tokenizer, 32, "x.jsonl", "tasks.x")
    labels = tokens["labels"][0]
    assert [label for label in labels.tolist() if label != IGNORE] == [1, 0, 0, 0, 0, 0]
    first_pieces = tokens["input_ids"][0][labels != IGNORE]
    assert all(Vocabulary.load(trained).tokens[i].startswith("\u0120") for i in first_pieces)


def test_snakemake_trains_a_bpe_and_encodes_with_it(corpus, tmp_path):
    """The rules with vocab.type bpe: data/tokenizer.json, then the tokenized shards and HDF5 built from it."""
    import shutil

    for split, sources in (("training", ["shard_0.txt", "shard_1.txt"]), ("test", ["shard_1.txt"])):
        (tmp_path / "data" / "shards" / split).mkdir(parents=True)
        for index, source in enumerate(sources):
            shutil.copyfile(corpus / source, tmp_path / "data" / "shards" / split / f"shard_{index}.txt")
    shutil.copyfile(REPO / "config.yaml", tmp_path / "config.yaml")
    (tmp_path / "test-config.yaml").write_text(
        "shard: {n_training_shards: 2, n_test_shards: 1}\nvocab: {type: bpe, size: 800}\n"
        "encode: {dupe_factor: 1, whole_word_masking: true,"
        " phase1: {max_seq_length: 64, max_predictions_per_seq: 10}}\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(tmp_path),
         "--configfile", str(tmp_path / "test-config.yaml"), "--allowed-rules", "vocab", "tokenize", "encode",
         "hdf5_dir", "--quiet", "rules", "--cores", "1", "data/hdf5_seq64"], capture_output=True, text=True, env=env,
        cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (tmp_path / "data" / "vocab.txt").exists()
    vocab = Vocabulary.load(tmp_path / "data" / "tokenizer.json", "bpe")
    assert vocab.size == 800
    ids, _, _ = load_tokenized(tmp_path / "data" / "tokenized" / "training" / "shard_0.npz")
    assert ids.max() < 800 and not np.isin(ids, list(vocab.special_ids.values())).any()
    files = sorted((tmp_path / "data" / "hdf5_seq64").rglob("*.hdf5"))
    assert files
    with h5py.File(files[0]) as handle:
        assert handle["input_ids"][:].max() < 800


def test_the_word_cache_falls_back_to_whole_lines_where_its_split_is_not_exact(trained, tmp_path):
    from tokenizers import AddedToken, normalizers

    from workflow.data.tokenize import byte_level_cache

    assert byte_level_cache(Vocabulary.load(trained).text_tokenizer()) is ByteLevelCache
    for change in ("normalizer", "rstrip", "space"):
        tokenizer = Vocabulary.load(trained).text_tokenizer()
        if change == "normalizer":
            tokenizer.normalizer = normalizers.NFC()
        else:
            tokenizer.add_tokens([AddedToken("|||X|||", rstrip=True) if change == "rstrip" else AddedToken("New York")])
        assert byte_level_cache(tokenizer) is LineCache
        lines = [" a |||X||| b New York c", " |||X|||  d"]
        ids, _ = tokenize_lines(tokenizer, lines, np.uint16, cache_class=byte_level_cache(tokenizer))
        assert ids.tolist() == [i for line in lines for i in tokenizer.encode(line).ids]
