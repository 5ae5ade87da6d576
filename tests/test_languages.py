"""Another language's Wikipedia: the dump URL and md5 list from wikipedia.language, sentences split by Punkt with the
language's curated lists (German) or at CJK marks (Chinese), and the vocab, the tokenized shards and the exported
tokenizer config normalising alike (lowercasing, accents, CJK characters)."""
import json

import numpy as np
import pytest

from tests.fixtures.wikipedia_languages import CHINESE, GERMAN, expected_documents, plain, write_dump
from workflow.data.download import checksum_list_beside, wikipedia_dump_url
from workflow.data.extract import extract
from workflow.data.format import format_corpus, split_cjk
from workflow.data.tokenize import load_tokenized, tokenize_shard
from workflow.data.vocab import Normalization, tokenizer_config, train_vocab


def documents_of(path):
    return [block.split("\n") for block in path.read_text(encoding="utf-8").split("\n\n") if block.strip()]


@pytest.mark.parametrize(("language", "wiki"), [("de", "dewiki"), ("zh", "zhwiki"), ("zh-yue", "zh_yuewiki")])
def test_language_names_its_latest_dump_and_the_md5_list_beside_it(language, wiki):
    url = wikipedia_dump_url(language)
    assert url == f"https://dumps.wikimedia.org/{wiki}/latest/{wiki}-latest-pages-articles.xml.bz2"
    assert checksum_list_beside(url) == f"https://dumps.wikimedia.org/{wiki}/latest/{wiki}-latest-md5sums.txt"


@pytest.fixture(scope="module")
def formatted(tmp_path_factory):
    """The generated German and Chinese dumps through extract and format, each with its language."""
    root = tmp_path_factory.mktemp("languages")
    outputs = {}
    for language, articles in (("de", GERMAN), ("zh", CHINESE)):
        dump = write_dump(articles, language, root / f"{language}wiki-test-pages-articles.xml.bz2")
        extract(dump, root / f"{language}.jsonl", processes=1)
        format_corpus(root / f"{language}.jsonl", root / f"{language}.txt", min_article_chars=100, language=language)
        outputs[language] = root / f"{language}.txt"
    return outputs


def test_german_articles_split_into_their_sentences_past_abbreviations_and_ordinal_dates(formatted):
    assert documents_of(formatted["de"]) == expected_documents(GERMAN)


def test_without_the_german_lists_punkt_splits_after_nr_ordinals_and_bzw(formatted, tmp_path):
    format_corpus(formatted["de"].with_suffix(".jsonl"), tmp_path / "en.txt", min_article_chars=100)
    sentences = [sentence for document in documents_of(tmp_path / "en.txt") for sentence in document]
    assert {"Sie wurde am 3.", "Am 1.", "Ihr Bericht erschien als Band Nr."} <= set(sentences)


def test_chinese_articles_split_at_full_width_marks_with_closing_quotes_kept(formatted):
    assert documents_of(formatted["zh"]) == expected_documents(CHINESE)


@pytest.mark.parametrize(("text", "sentences"), [
    ("他说：「你好。我很好。」然后走了。", ["他说：「你好。我很好。」", "然后走了。"]),
    ("真的吗？！是的。（注：见下文。）最后", ["真的吗？！", "是的。", "（注：见下文。）", "最后"]),
    ("首都。（它有很多人。没有闭合", ["首都。", "（它有很多人。", "没有闭合"]),  # an opener never closed holds nothing
    ("No CJK marks. Left alone.", ["No CJK marks. Left alone."]),
])
def test_cjk_text_splits_after_its_marks_and_closers_but_not_inside_a_quote(text, sentences):
    assert split_cjk(text) == sentences


NORMALIZATIONS = [Normalization(), Normalization(True, False), Normalization(False), Normalization(False, True, False)]


@pytest.mark.parametrize("normalization", NORMALIZATIONS, ids=["uncased", "uncased-accents", "cased", "cased-no-cjk"])
def test_hf_tokenizer_from_the_exported_config_gives_the_ids_of_the_tokenized_shard(formatted, tmp_path,
                                                                                      normalization):
    from transformers import AutoTokenizer

    shard = tmp_path / "shard_0.txt"
    shard.write_text(formatted["de"].read_text(encoding="utf-8") + formatted["zh"].read_text(encoding="utf-8"),
                     encoding="utf-8")
    export = tmp_path / "model"
    export.mkdir()
    train_vocab([shard], export / "vocab.txt", size=400, normalization=normalization)
    (export / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(normalization, 128)))
    tokenize_shard(shard, export / "vocab.txt", tmp_path / "shard.npz", normalization=normalization)
    ids, sentence_offsets, _ = load_tokenized(tmp_path / "shard.npz")
    sentences = [line for line in shard.read_text(encoding="utf-8").split("\n") if line]
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert tokenizer.is_fast
    expected = tokenizer(sentences, add_special_tokens=False)["input_ids"]
    assert [ids[a:b].tolist() for a, b in zip(sentence_offsets, sentence_offsets[1:])] == expected
    vocab = (export / "vocab.txt").read_text(encoding="utf-8").split("\n")
    strips_accents = normalization.lowercase if normalization.strip_accents is None else normalization.strip_accents
    assert ("ä" in vocab) != strips_accents
    continued = {vocab[i] for i in ids if vocab[i].startswith("##") and "\u4e00" <= vocab[i][2] <= "\u9fff"}
    assert bool(continued) != normalization.tokenize_chinese_chars  # apart, no ideograph continues a word


def test_a_chinese_text_corpus_drops_its_chapter_titles_and_keeps_paragraphs_without_a_final_mark(tmp_path):
    from workflow.data.corpora import Corpus

    (tmp_path / "books").mkdir()
    paragraphs = [plain("".join(paragraph)) for paragraphs in CHINESE.values() for paragraph in paragraphs]
    (tmp_path / "books" / "a.txt").write_text("第一章 青石镇\n\n" + "\n\n".join(paragraphs) + "\n\n最后一段没有句号但是很长很长很长很长\n")
    report = format_corpus(Corpus("books", "text", str(tmp_path / "books")), tmp_path / "out.txt", min_article_chars=100)
    sentences = [sentence for document in expected_documents(CHINESE) for sentence in document]
    assert documents_of(tmp_path / "out.txt") == [[*sentences, "最后一段没有句号但是很长很长很长很长"]]
    assert report["paragraphs"]["dropped"]["heading"] == 1
