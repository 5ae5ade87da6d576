# Config validation, shared path helpers and input functions. No rule lives here.
import jsonschema
import yaml
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate


def config_error(config, schema_path):
    """One line naming the first bad config key as a dotted path (jsonschema's best match) and what is wrong."""
    with open(schema_path) as stream:
        schema = yaml.safe_load(stream)
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(config))
    key = ".".join(str(part) for part in error.absolute_path)
    if error.validator == "additionalProperties":
        unknown = sorted(set(error.instance) - set(error.schema.get("properties", {})))
        prefix = f"{key}." if key else ""
        dotted = ", ".join(f"'{prefix}{name}'" for name in unknown)
        return f"config: unknown key {dotted} (every key is listed in config.schema.yaml)"
    return f"config key '{key}': {error.message}"


try:
    validate(config, "../config.schema.yaml")  # also fills in the schema's defaults
except WorkflowError:
    raise ValueError(config_error(config, f"{workflow.basedir}/config.schema.yaml")) from None

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


def vocab_shard_indices():
    """The training shards a vocab is trained on: the first vocab.training_shards (null: all)."""
    n_shards = config["shard"]["n_training_shards"]
    return range(min(n_shards, config["vocab"]["training_shards"] or n_shards))


def max_predictions_per_seq(wildcards):
    """max_predictions_per_seq of the phase whose max_seq_length is wildcards.seq."""
    return config["encode"][phase_of_seq(wildcards)]["max_predictions_per_seq"]


def encoded_shards(wildcards):
    """Every encoded shard, both splits, of sequence length wildcards.seq."""
    return [
        f"data/encoded_seq{wildcards.seq}/{split}/shard_{index}.hdf5"
        for split in SPLITS
        for index in shard_indices(split)
    ]


def all_targets():
    """What `snakemake all` builds: the data, both pretraining phases, the SQuAD evaluation."""
    return [
        hdf5_dir("phase1"),
        hdf5_dir("phase2"),
        "results/pretrain/phase2/model",
        "results/squad/eval.json",
        "results/summary.csv",
        *REPORT_TARGETS,
    ]
