# Input functions of rules/tokenize.smk (functions apart from rules, as `snakemake --lint` asks).


def corpus_statistics_inputs(wildcards):
    """Every corpus' format summary, the shards (their corpora.json) and every tokenized shard."""
    return {
        "formatted": [f"data/formatted/{name}.summary.json" for name in formatted_corpus_names()],
        "shards": "data/shards",
        "tokenized": [f"data/tokenized/{split}/shard_{index}.npz" for split in SPLITS for index in shard_indices(split)],
    }
