# Input and params functions of rules/format.smk (functions apart from rules, as `snakemake --lint` asks).
import shlex

from workflow.data.corpora import Corpus, corpus_files


def punkt_training_parts(wildcards):
    """The parts of the dump Punkt trains on (their first pages, extracted by punkt itself): the first
    format.punkt_parts (null: all), in page-id order."""
    return wikipedia_parts("data/download/wikipedia/{part}.xml.bz2")[: config["format"]["punkt_parts"]]


def user_corpus(corpus):
    """The `corpora` entry a format job's `corpus` wildcard (corpora/NAME) names, or None."""
    name = corpus.removeprefix("corpora/")
    return Corpus.from_config(name, config["corpora"][name]) if name != corpus else None


def format_inputs(wildcards):
    """What format reads: a part's extracted articles and the corpus' Punkt model, the books directory, or a user
    corpus' files (so that an edited file reformats it)."""
    if wildcards.corpus == "bookcorpus":
        return {"text": "data/download/bookcorpus"}
    if corpus := user_corpus(wildcards.corpus):
        return {"text": corpus_files(corpus)}
    inputs = {"text": f"data/extracted/{wildcards.corpus}.jsonl"}
    if not config["format"]["punkt_model"]:
        inputs["punkt"] = "data/punkt/wikipedia"
    return inputs


def format_source(wildcards):
    """format's source arguments: --input PATH, or a user corpus' config section whole (--corpus JSON)."""
    if corpus := user_corpus(wildcards.corpus):
        section = json.dumps({"name": corpus.name, **config["corpora"][corpus.name]}, sort_keys=True)
        return f"--corpus {shlex.quote(section)}"
    source = "data/download/bookcorpus" if wildcards.corpus == "bookcorpus" else f"data/extracted/{wildcards.corpus}.jsonl"
    return f"--input {shlex.quote(source)}"


def format_language(wildcards):
    """The language whose curated abbreviations Punkt adds: a user corpus' own, else wikipedia.language."""
    corpus = user_corpus(wildcards.corpus)
    return (corpus and corpus.language) or config["wikipedia"]["language"]


def format_punkt_model(wildcards):
    """The Punkt model format loads: the configured one, else (Wikipedia) the one trained once, else none
    (books, user corpora: format trains on them)."""
    if config["format"]["punkt_model"] or not wildcards.corpus.startswith("wikipedia/"):
        return config["format"]["punkt_model"] or ""
    return "data/punkt/wikipedia"
