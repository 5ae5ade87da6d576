# Input and params functions of rules/shard.smk (functions apart from rules, as `snakemake --lint` asks).


def formatted_corpus_names():
    """The formatted corpora, in corpus order: every Wikipedia part (if enabled), BookCorpus (if enabled), then
    each `corpora` entry by name (data/formatted/{name}.txt)."""
    wikipedia = wikipedia_parts("wikipedia/{part}") if config["wikipedia"]["enabled"] else []
    books = ["bookcorpus"] if config["bookcorpus"]["enabled"] else []
    return wikipedia + books + [f"corpora/{name}" for name in sorted(config["corpora"])]


def formatted_corpora(wildcards):
    """The formatted text the shards are cut from, in corpus order (shard.py names a file's corpus by its path)."""
    return [f"data/formatted/{name}.txt" for name in formatted_corpus_names()]
