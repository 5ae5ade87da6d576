# Input and params functions of rules/vocab.smk (functions apart from rules, as `snakemake --lint` asks).
from workflow.data.vocab import VOCAB_FILES, Normalization

# The vocab every later stage reads: data/vocab.txt (vocab.type wordpiece) or data/tokenizer.json (bpe).
VOCAB = f"data/{VOCAB_FILES[config['vocab']['type']]}"
# The vocab rule's --type flag: in the command, not params, so that a WordPiece vocab made before vocab.type existed
# is not retrained (its output path names the type anyway).
VOCAB_TYPE_FLAG = "" if config["vocab"]["type"] == "wordpiece" else f" --type {config['vocab']['type']}"


def vocab_shard_indices():
    """The training shards a vocab is trained on: the first vocab.training_shards (null: all)."""
    n_shards = config["shard"]["n_training_shards"]
    return range(min(n_shards, config["vocab"]["training_shards"] or n_shards))


def normalization_flags():
    """--lowercase, --strip-accents, --tokenize-chinese-chars as config `vocab` sets them: the vocab, the tokenized
    shards and a tokenizer built from them (fine-tuning features, the export) must normalise alike."""
    return Normalization.from_config(config["vocab"]).flags()
