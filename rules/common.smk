# Config validation, shared path helpers and input functions. No rule lives here.
from snakemake.utils import validate


validate(config, "../config.schema.yaml")

SPLITS = ["training", "test"]
PHASES = ["phase1", "phase2"]


wildcard_constraints:
    split="training|test",
    index=r"\d+",
    seq=r"\d+",
    phase="phase1|phase2",


def shard_indices(split):
    """Indices of the text shards of one split (training or test)."""
    return range(config["shard"][f"n_{split}_shards"])


def seq_length(phase):
    return config["encode"][phase]["max_seq_length"]


def hdf5_dir(phase):
    """The directory a trainer reads for a phase: data/hdf5_seq128, data/hdf5_seq512."""
    return f"data/hdf5_seq{seq_length(phase)}"


def phase_of_seq(wildcards):
    """The phase whose encode settings produce sequences of length wildcards.seq."""
    for phase in PHASES:
        if seq_length(phase) == int(wildcards.seq):
            return phase
    raise ValueError(f"no phase in config 'encode' has max_seq_length {wildcards.seq}")


def all_targets():
    """What `snakemake all` builds: the data, both pretraining phases, the SQuAD evaluation."""
    return [
        hdf5_dir("phase1"),
        hdf5_dir("phase2"),
        "results/pretrain/phase2/model",
        "results/squad/eval.json",
        "results/summary.csv",
    ]
