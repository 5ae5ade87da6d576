# Input and params functions of rules/shard.smk (functions apart from rules, as `snakemake --lint` asks).


def formatted_corpora(wildcards):
    """The formatted text the shards are cut from, in corpus order: every Wikipedia part, then BookCorpus if enabled."""
    books = ["data/formatted/bookcorpus.txt"] if config["bookcorpus"]["enabled"] else []
    return wikipedia_parts("data/formatted/wikipedia/{part}.txt") + books
