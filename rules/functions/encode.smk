# Input and params functions of rules/encode.smk (functions apart from rules, as `snakemake --lint` asks).
from workflow.data.hdf5 import PACKED_VERSION
from workflow.data.masking_rule import phase_max_predictions


def shard_indices(split):
    """Indices of the text shards of one split (training or test)."""
    return range(config["shard"][f"n_{split}_shards"])


def phase_of_seq(wildcards):
    """The phase whose encode settings produce sequences of length wildcards.seq."""
    for phase in PHASES:
        if seq_length(phase) == int(wildcards.seq):
            return phase
    raise ValueError(f"no phase in config 'encode' has max_seq_length {wildcards.seq}")


def max_predictions_per_seq(wildcards):
    """max_predictions_per_seq of the phase whose max_seq_length is wildcards.seq (derived where null)."""
    return phase_max_predictions(config["encode"], phase_of_seq(wildcards))


def masking_arguments(wildcards):
    """encode's masking options: whole words, and the masking, objective, masking rule and held-out probability only
    where not NVIDIA's recipe (so that data built before those keys keeps its params and is not rebuilt)."""
    encode = config["encode"]
    options = ["--whole-word-masking" if encode["whole_word_masking"] else "--no-whole-word-masking"]
    if encode["masking"] != "static":
        options.append(f"--masking {encode['masking']}")
    if encode["objective"] != "nsp":
        options.append(f"--objective {encode['objective']}")
    if encode["masking_rule"] != "google":
        options.append(f"--masking-rule {encode['masking_rule']}")
    if encode["eval_masked_lm_prob"] is not None:
        options.append(f"--eval-masked-lm-prob {encode['eval_masked_lm_prob']}")
    return " ".join(options)


def packing_arguments(wildcards):
    """encode's packing options from config encode.packing; for full sentences and documents also the packed layout's
    version, so that a new version changes the job's params and Snakemake rebuilds the shards of the recipe it
    changed (packed NSP data, unchanged, keeps its params and is not rebuilt)."""
    packing = config["encode"]["packing"]
    if not packing["enabled"]:
        return "--no-packing"
    options = f"--packing --max-sequences-per-pack {packing['max_sequences_per_pack']} --pack-algorithm {packing['algorithm']}"
    if config["encode"]["objective"] != "nsp":
        options += f" --packed-version {PACKED_VERSION}"
    return options


def encoded_shards(wildcards):
    """Every encoded shard, both splits, of sequence length wildcards.seq."""
    return [
        f"data/encoded_seq{wildcards.seq}/{split}/shard_{index}.hdf5"
        for split in SPLITS
        for index in shard_indices(split)
    ]
