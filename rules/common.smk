# Config validation, shared path helpers and input functions. No rule lives here.
import functools
import os
import sys

import jsonschema
import yaml
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

# the repository root, so that the workflow package is importable whichever Snakefile includes this file
sys.path.insert(0, os.path.dirname(workflow.current_basedir.get_path_or_uri(secret_free=True)))
from workflow.cli import UserError
from workflow.data.download import dump_parts


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


@functools.cache
def wikipedia_dump_parts():
    """The files the Wikipedia dump is processed as (config wikipedia.parts): {name: DumpPart} in page-id order;
    names are page-id ranges `pFIRSTpLAST`, or `whole`. Read when the DAG first needs them (not by --lint), once."""
    wikipedia = config["wikipedia"]
    try:
        parts = dump_parts(wikipedia["url"], wikipedia["checksum_url"], wikipedia["parts"], "data/download/wikipedia")
    except UserError as error:
        raise ValueError(f"wikipedia.parts {wikipedia['parts']}: {error}") from None
    return {part.name: part for part in parts}


wildcard_constraints:
    part=r"whole|p\d+p\d+",
    split="training|test",
    index=r"\d+",
    seq=r"\d+",
    phase="phase1|phase2",


def wikipedia_part_url(wildcards):
    return wikipedia_dump_parts()[wildcards.part].url


def wikipedia_part_checksum_url(wildcards):
    """The checksum list a part is verified against ("" = the list beside the dump, if any)."""
    return wikipedia_dump_parts()[wildcards.part].checksum_url


def wikipedia_parts(pattern):
    """`pattern` filled in for every part of the dump, in page-id order (the order of the articles)."""
    return expand(pattern, part=list(wikipedia_dump_parts()))


def all_template_pages(wildcards):
    """The template pages of every part: each part is extracted with all of them, as in the whole dump."""
    return wikipedia_parts("data/extracted/wikipedia/{part}.templates.xml")


def all_extracted_parts(wildcards):
    return wikipedia_parts("data/extracted/wikipedia/{part}.jsonl")


def formatted_corpora(wildcards):
    """The formatted text the shards are cut from, in corpus order: every Wikipedia part, then BookCorpus if enabled."""
    books = ["data/formatted/bookcorpus.txt"] if config["bookcorpus"]["enabled"] else []
    return wikipedia_parts("data/formatted/wikipedia/{part}.txt") + books


def format_inputs(wildcards):
    """What format reads: a part's extracted articles and the corpus' Punkt model, or the books directory."""
    if wildcards.corpus == "bookcorpus":
        return {"text": "data/download/bookcorpus"}
    inputs = {"text": f"data/extracted/{wildcards.corpus}.jsonl"}
    if not config["format"]["punkt_model"]:
        inputs["punkt"] = "data/punkt/wikipedia"
    return inputs


def format_punkt_model(wildcards):
    """The Punkt model format loads: the configured one, else (Wikipedia) the one trained on all parts, else none
    (books: format trains on them)."""
    if config["format"]["punkt_model"] or wildcards.corpus == "bookcorpus":
        return config["format"]["punkt_model"] or ""
    return "data/punkt/wikipedia"


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
