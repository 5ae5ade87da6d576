"""Your own corpora (config `corpora`): text and JSONL read as documents, formatted as Wikipedia is, mixed into the
shards with per-corpus counts, and every error one line naming the corpus, the file and the line."""
import bz2
import gzip
import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

from workflow.cli import UserError
from workflow.data.corpora import Corpus, corpora_error, corpus_documents
from workflow.data.format import format_corpus
from workflow.data.shard import shard_corpus
from workflow.data.tokenize import bert_tokenizer, tokenize_shard
from workflow.data.vocab import train_vocab
from workflow.report.corpora import corpus_statistics

REPO = Path(__file__).resolve().parents[1]
WORDS = ("river mill harbour valley council bridge railway station market church castle tower garden forest "
         "meadow village county museum library school").split()


def sentence(seed: int) -> str:
    rng = np.random.default_rng(seed)
    words = [WORDS[i] for i in rng.integers(len(WORDS), size=6 + seed % 5)]
    return f"{words[0].capitalize()} {' '.join(words[1:-1])} stood there in {1800 + seed} by the {words[-1]}."


def document(seed: int, n_sentences: int = 4) -> list[str]:
    return [sentence(seed * 100 + i) for i in range(n_sentences)]


def write_text_corpus(directory: Path, seeds) -> list[list[str]]:
    """One file per document, two paragraphs each; returns the documents' sentences."""
    directory.mkdir(parents=True)
    documents = [document(seed) for seed in seeds]
    for seed, sentences in zip(seeds, documents):
        (directory / f"doc{seed:03d}.txt").write_text(" ".join(sentences[:2]) + "\n\n" + " ".join(sentences[2:]) + "\n")
    return documents


def write_jsonl_corpus(path: Path, seeds, opener=open) -> list[list[str]]:
    documents = [document(seed) for seed in seeds]
    with opener(path, "wt", encoding="utf-8") as out:
        for seed, sentences in zip(seeds, documents):
            out.write(json.dumps({"id": seed, "body": " ".join(sentences)}) + "\n")
    return documents


def documents_of(path: Path) -> list[list[str]]:
    return [block.split("\n") for block in path.read_text(encoding="utf-8").split("\n\n") if block.strip()]


def test_text_corpus_is_one_document_per_file_in_path_order_split_into_its_sentences(tmp_path):
    expected = write_text_corpus(tmp_path / "notes", [3, 1, 2])
    corpus = Corpus.from_config("notes", {"format": "text", "path": str(tmp_path / "notes")})
    format_corpus(corpus, tmp_path / "out.txt", min_article_chars=50)
    assert documents_of(tmp_path / "out.txt") == [expected[1], expected[2], expected[0]]  # doc001, doc002, doc003


def test_blank_line_documents_are_google_berts_input_format(tmp_path):
    documents = [document(seed) for seed in (5, 6, 7)]
    (tmp_path / "google.txt").write_text("\n\n".join("\n".join(sentences) for sentences in documents) + "\n")
    corpus = Corpus.from_config("google", {"format": "text", "path": str(tmp_path / "*.txt"), "documents": "blank_line"})
    assert [where for where, _ in corpus_documents(corpus)] == [f"{tmp_path / 'google.txt'}:{line}" for line in (1, 6, 11)]
    format_corpus(corpus, tmp_path / "out.txt", min_article_chars=50)
    assert documents_of(tmp_path / "out.txt") == documents


@pytest.mark.parametrize(("suffix", "opener"), [("", open), (".gz", gzip.open), (".bz2", bz2.open)])
def test_jsonl_corpus_reads_text_field_plain_or_compressed(tmp_path, suffix, opener):
    expected = write_jsonl_corpus(tmp_path / f"web.jsonl{suffix}", [8, 9], opener)
    corpus = Corpus.from_config("web", {"format": "jsonl", "path": str(tmp_path / "web.jsonl*"), "text_field": "body"})
    report = format_corpus(corpus, tmp_path / "out.txt", min_article_chars=50)
    assert documents_of(tmp_path / "out.txt") == expected
    assert report["documents"]["kept"] == 2 and report["sentences"] == 8


def run_format(corpus: dict, tmp_path: Path, env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workflow.data.format", "--corpus", json.dumps(corpus), "--output",
                           str(tmp_path / "out.txt")], capture_output=True, text=True, env=env)


def test_a_malformed_jsonl_line_is_one_error_line_naming_corpus_file_and_line(tmp_path, repo_env):
    path = tmp_path / "web.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n\n" + '{"text": "cut off\n')
    result = run_format({"name": "web", "format": "jsonl", "path": str(path)}, tmp_path, repo_env)
    assert result.returncode == 1 and not (tmp_path / "out.txt").exists()
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: corpora.web: {path}:3: not a JSON object")
    path.write_text(json.dumps({"body": "no text field"}) + "\n")
    result = run_format({"name": "web", "format": "jsonl", "path": str(path)}, tmp_path, repo_env)
    assert result.stderr.strip().splitlines()[-1] == \
        f"error: corpora.web: {path}:1: no string field 'text' (corpora.web.text_field)"


def test_a_missing_path_or_an_empty_corpus_is_one_error_line_naming_the_corpus(tmp_path, repo_env):
    result = run_format({"name": "notes", "format": "text", "path": str(tmp_path / "nothing")}, tmp_path, repo_env)
    assert result.stderr.strip().splitlines()[-1] == f"error: corpora.notes: {tmp_path / 'nothing'}: no such file"
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "a.txt").write_text("Too short to keep.\n")
    result = run_format({"name": "notes", "format": "text", "path": str(tmp_path / "short")}, tmp_path, repo_env)
    assert result.returncode == 1 and not (tmp_path / "out.txt").exists()
    assert result.stderr.strip().splitlines()[-1] == (f"error: corpora.notes: {tmp_path / 'short'}: empty corpus: none "
                                                      "of its 1 documents has min_article_chars=200 characters of prose")


def test_config_without_any_corpus_or_with_a_path_matching_nothing_is_refused(tmp_path):
    config = {"wikipedia": {"enabled": False}, "bookcorpus": {"enabled": False}, "corpora": {}}
    assert "there is no text to pretrain on" in corpora_error(config)
    config["corpora"] = {"web": {"format": "jsonl", "path": str(tmp_path / "*.jsonl")}}
    assert corpora_error(config) == f"corpora.web: {tmp_path / '*.jsonl'}: the glob matches no file"
    with pytest.raises(UserError, match="corpora.web.documents: 'lines'"):
        Corpus.from_config("web", {"format": "text", "path": "x", "documents": "lines"})


def test_shards_mix_corpora_identically_for_any_processes_and_count_each_corpus_documents_and_tokens(tmp_path):
    notes = write_text_corpus(tmp_path / "notes", range(10, 22))
    web = write_jsonl_corpus(tmp_path / "web.jsonl", range(30, 50))
    formatted = [tmp_path / "formatted" / "notes.txt", tmp_path / "formatted" / "web.txt"]
    format_corpus(Corpus("notes", "text", str(tmp_path / "notes")), formatted[0], min_article_chars=50)
    format_corpus(Corpus("web", "jsonl", str(tmp_path / "web.jsonl"), "body"), formatted[1], min_article_chars=50)
    shards = {}
    for processes in (1, 2):
        root = tmp_path / f"shards{processes}"
        shard_corpus(formatted, root / "training", root / "test", 3, 1, seed=7, processes=processes,
                     manifest=root / "corpora.json")
        shards[processes] = {path.relative_to(root): path.read_bytes() for path in sorted(root.rglob("*.*"))}
    assert shards[1] == shards[2]
    manifest = json.loads(shards[1][Path("corpora.json")])
    assert manifest["corpora"] == ["notes", "web"]
    assert np.sum(manifest["training"] + manifest["test"], axis=0).tolist() == [len(notes), len(web)]
    root = tmp_path / "shards1"
    train_vocab([root / "training" / f"shard_{i}.txt" for i in range(3)], tmp_path / "vocab.txt", size=150)
    (tmp_path / "tokenized").mkdir()
    for split, n in (("training", 3), ("test", 1)):
        for index in range(n):
            tokenize_shard(root / split / f"shard_{index}.txt", tmp_path / "vocab.txt",
                           tmp_path / "tokenized" / split / f"shard_{index}.npz")
    summaries = []
    for name in ("notes", "web"):
        summaries.append(tmp_path / "formatted" / f"{name}.summary.json")
        summaries[-1].write_text(json.dumps(format_corpus(
            Corpus(name, "text", str(tmp_path / "notes")) if name == "notes"
            else Corpus(name, "jsonl", str(tmp_path / "web.jsonl"), "body"), tmp_path / "again.txt", min_article_chars=50)))
    tokenizer, _ = bert_tokenizer(tmp_path / "vocab.txt")
    tokens = [sum(len(tokenizer.encode(s, add_special_tokens=False).ids) for d in docs for s in d) for docs in (notes, web)]
    unknown = [sum(tokenizer.encode(s, add_special_tokens=False).ids.count(1) for d in docs for s in d)  # [UNK]: 1
               for docs in (notes, web)]
    assert corpus_statistics(summaries, root / "corpora.json", tmp_path / "tokenized") == [
        {"corpus": "notes", "documents_read": 12, "documents": 12, "sentences": 48, "tokens": tokens[0],
         "unknown_tokens": unknown[0]},
        {"corpus": "web", "documents_read": 20, "documents": 20, "sentences": 80, "tokens": tokens[1],
         "unknown_tokens": unknown[1]},
    ]


def segments(row: dict) -> list[list[int]]:
    """Sentence A and B of an encoded row (NVIDIA schema), the masked positions restored."""
    ids = row["input_ids"].copy()
    for position, original in zip(row["masked_lm_positions"], row["masked_lm_ids"]):
        if position:
            ids[position] = original
    n = int(row["input_mask"].sum())
    segment = row["segment_ids"][:n]
    return [ids[1:n][segment[1:] == s].tolist()[:-1] for s in (0, 1)]  # [CLS] A [SEP] B [SEP]


def test_wikipedia_off_with_a_text_and_a_jsonl_corpus_builds_training_rows_of_their_sentences(tmp_path, repo_env):
    sources = tmp_path / "sources"
    notes = write_text_corpus(sources / "notes", range(10, 22))
    web = write_jsonl_corpus(sources / "web.jsonl.gz", range(30, 50), gzip.open)
    config = yaml.safe_load((REPO / "sample" / "config.yaml").read_text())
    config = {key: config[key] for key in ("format", "vocab", "encode")}
    config.update(wikipedia={"enabled": False}, bookcorpus={"enabled": False},
                  shard={"n_training_shards": 2, "n_test_shards": 1},
                  corpora={"notes": {"format": "text", "path": str(sources / "notes")},
                           "web": {"format": "jsonl", "path": str(sources / "*.jsonl.gz"), "text_field": "body"}})
    config["vocab"]["size"] = 150
    config["encode"].update(packing={"enabled": False}, dupe_factor=2)
    work = tmp_path / "work"
    work.mkdir()
    (work / "Snakefile").write_text(f'configfile: "{REPO}/config.yaml"\n' + "".join(
        f'include: "{REPO}/rules/{name}.smk"\n'
        for name in ("common", "download", "extract", "format", "shard", "vocab", "tokenize", "encode")))
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    result = subprocess.run([sys.executable, "-m", "snakemake", "data/hdf5_seq128", "results/corpora.csv", "--cores",
                             "2", "--configfile", "config.yaml"], cwd=work, capture_output=True, text=True, env=repo_env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert not (work / "data" / "download").exists()  # no Wikipedia was planned
    tokenizer, _ = bert_tokenizer(work / "data" / "vocab.txt")
    sources_ids = [" ".join(map(str, tokenizer.encode(" ".join(d), add_special_tokens=False).ids))
                   for d in notes + web]
    rows = 0
    for path in sorted((work / "data" / "hdf5_seq128" / "training").glob("*.hdf5")):
        with h5py.File(path, "r") as handle:
            arrays = {name: handle[name][:] for name in handle}
        for index in range(len(arrays["input_ids"])):
            for ids in segments({name: array[index] for name, array in arrays.items()}):
                assert any(f" {' '.join(map(str, ids))} " in f" {source} " for source in sources_ids)
            rows += 1
    assert rows > 20
    lines = (work / "results" / "corpora.csv").read_text().splitlines()
    assert lines[0] == "corpus,documents_read,documents,sentences,tokens,unknown_tokens"
    assert [line.split(",")[:4] for line in lines[1:]] == [["notes", "12", "12", "48"], ["web", "20", "20", "80"]]
