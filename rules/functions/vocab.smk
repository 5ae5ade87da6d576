# Input and params functions of rules/vocab.smk (functions apart from rules, as `snakemake --lint` asks).


def vocab_shard_indices():
    """The training shards a vocab is trained on: the first vocab.training_shards (null: all)."""
    n_shards = config["shard"]["n_training_shards"]
    return range(min(n_shards, config["vocab"]["training_shards"] or n_shards))
