# Config validation, shared path helpers and input functions. No rule lives here.
import functools
import json
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
from workflow.glue.data import TASKS as GLUE_TASKS


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

def config_consistency_error(config):
    """What the schema cannot say (relations between keys), as one line naming the key; None when consistent."""
    for phase in ("phase1", "phase2"):
        section = config["pretrain"][phase]
        key = f"pretrain.{phase}"
        if section.get("max_steps") and section["max_steps"] > section["total_steps"]:
            return (f"config key '{key}.max_steps': {section['max_steps']} exceeds {key}.total_steps "
                    f"({section['total_steps']})")
        if section["global_batch_size"] % section["micro_batch_size"]:
            return (f"config key '{key}.global_batch_size': {section['global_batch_size']} is not a multiple of "
                    f"{key}.micro_batch_size ({section['micro_batch_size']})")
    squad = config["squad"]
    if squad["batch_size"] % squad["micro_batch_size"]:
        return (f"config key 'squad.batch_size': {squad['batch_size']} is not a multiple of squad.micro_batch_size "
                f"({squad['micro_batch_size']})")
    layouts = [(layout["nodes"], layout["gpus_per_node"]) for layout in config["scaling"]["layouts"]]
    if len(set(layouts)) < len(layouts):
        return "config key 'scaling.layouts': a layout (nodes, gpus_per_node) is listed twice"
    glue = config["glue"]
    if glue["tasks"] and not glue["url"]:
        return "config key 'glue.url': required when glue.tasks is non-empty (a directory or base URL of GLUE TSVs)"
    for task in glue["tasks"]:
        batch, micro = (glue_setting(task, key) for key in ("batch_size", "micro_batch_size"))
        if batch % micro:
            return (f"config key 'glue.batch_size': {batch} is not a multiple of glue.micro_batch_size ({micro}) "
                    f"for task {task} (glue.overrides.{task} may set either)")
    return None


def glue_setting(task, key):
    """A GLUE task's value of `key`: glue.overrides.<task>.<key> if set, else glue.<key>."""
    return config["glue"]["overrides"].get(task, {}).get(key, config["glue"][key])


if config_consistency_error(config):
    raise ValueError(config_consistency_error(config))

def config_sections(*sections):
    """A params function: the config `sections` as JSON, handed over whole to a module that validates them.

    It takes `threads`, so Snakemake counts it as derived (like threads) and leaves it out of the rerun check:
    cadence or micro-batch edits rerun nothing; the rule's `recipe` param holds what changes its outputs.
    """

    def sections_json(wildcards, threads):
        return json.dumps({key: config[key] for key in sections}, sort_keys=True)

    return sections_json


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
    layout=r"\d+x\d+",


def wikipedia_part_url(wildcards):
    return wikipedia_dump_parts()[wildcards.part].url


def wikipedia_part_checksum_url(wildcards):
    """The checksum list a part is verified against ("" = the list beside the dump, if any)."""
    return wikipedia_dump_parts()[wildcards.part].checksum_url


def wikipedia_parts(pattern):
    """`pattern` filled in for every part of the dump, in page-id order (the order of the articles)."""
    return expand(pattern, part=list(wikipedia_dump_parts()))


def formatted_corpora(wildcards):
    """The formatted text the shards are cut from, in corpus order: every Wikipedia part, then BookCorpus if enabled."""
    books = ["data/formatted/bookcorpus.txt"] if config["bookcorpus"]["enabled"] else []
    return wikipedia_parts("data/formatted/wikipedia/{part}.txt") + books


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


def packing_arguments(wildcards):
    """encode's packing options from config encode.packing."""
    packing = config["encode"]["packing"]
    if not packing["enabled"]:
        return "--no-packing"
    return f"--packing --max-sequences-per-pack {packing['max_sequences_per_pack']} --pack-algorithm {packing['algorithm']}"


def encoded_shards(wildcards):
    """Every encoded shard, both splits, of sequence length wildcards.seq."""
    return [
        f"data/encoded_seq{wildcards.seq}/{split}/shard_{index}.hdf5"
        for split in SPLITS
        for index in shard_indices(split)
    ]


def pretrain_inputs(wildcards):
    """A phase's data and vocab; phase 2 also starts from phase 1's export (and LAMB moments)."""
    inputs = {"data": hdf5_dir(wildcards.phase), "vocab": "data/vocab.txt"}
    if wildcards.phase == "phase2":
        inputs["init"] = "results/pretrain/phase1/model"
        if config["pretrain"]["carry_optimizer_state"]:
            inputs["init_optimizer"] = "results/pretrain/phase1/optimizer_state.pt"
    return inputs


def pretrain_init_args(wildcards):
    """The trainer's --init-from/--init-optimizer for phase 2 (phase 1 starts from config model.init_from)."""
    inputs = pretrain_inputs(wildcards)
    args = [f"--init-from {inputs['init']}"] if "init" in inputs else []
    if "init_optimizer" in inputs:
        args.append(f"--init-optimizer {inputs['init_optimizer']}")
    return " ".join(args)


def pretrain_recipe(wildcards):
    """What changes a phase's outputs (its params): the math, precision, max_steps and the evaluation size; not
    cadence, micro-batch size or threads."""
    pretrain = config["pretrain"]
    recipe = {key: value for key, value in pretrain[wildcards.phase].items() if key != "micro_batch_size"}
    recipe.update(lamb=pretrain["lamb"], precision=pretrain["precision"], seed=config["seed"],
                  eval_max_sequences=pretrain["eval_max_sequences"], model=config["model"])
    if wildcards.phase == "phase2":
        recipe["carry_optimizer_state"] = pretrain["carry_optimizer_state"]
        recipe["model"] = {k: v for k, v in config["model"].items() if k != "init_from"}  # phase 1's export
    return recipe


def squad_recipe(wildcards):
    """What changes the fine-tuned model (squad_finetune's params): not cadence, micro-batch size or threads."""
    keys = ("learning_rate", "epochs", "batch_size", "warmup_proportion", "weight_decay", "max_grad_norm", "precision")
    return {"seed": config["seed"], **{key: config["squad"][key] for key in keys}}


def glue_file_url(wildcards):
    """Where a GLUE file is: <glue.url>/<task>/<file>.tsv, as download_glue_data.py lays GLUE out."""
    return f"{config['glue']['url'].rstrip('/')}/{wildcards.glue_task}/{wildcards.glue_file}.tsv"


def glue_max_seq_length(wildcards):
    return glue_setting(wildcards.glue_task, "max_seq_length")


def glue_dev_features(wildcards):
    """{dev split: its features}: dev, or MNLI's dev_matched and dev_mismatched."""
    return {split: f"data/glue/{wildcards.glue_task}/{split}_features.npz"
            for split in GLUE_TASKS[wildcards.glue_task].dev_splits}


def glue_dev_feature_args(wildcards, input):
    return " ".join(f"--features {split}={input[split]}" for split in GLUE_TASKS[wildcards.glue_task].dev_splits)


def glue_recipe(wildcards):
    """What changes a task's fine-tuned model (glue_finetune's params): not cadence, micro-batch size or threads."""
    keys = ("max_seq_length", "learning_rate", "epochs", "batch_size", "warmup_proportion", "weight_decay",
            "max_grad_norm", "precision")
    return {"seed": config["seed"], **{key: glue_setting(wildcards.glue_task, key) for key in keys}}


def glue_targets():
    """Each configured GLUE task's dev scores."""
    return expand("results/glue/{task}/eval.json", task=config["glue"]["tasks"])


def scaling_layout(wildcards):
    """(nodes, GPUs per node) of a scaling layout name NxG."""
    nodes, gpus = wildcards.layout.split("x")
    return int(nodes), int(gpus)


def scaling_nodes(wildcards):
    return scaling_layout(wildcards)[0]


def scaling_gres(wildcards):
    return f"gpu:{scaling_layout(wildcards)[1]}"


def scaling_threads(wildcards):
    """The job's CPU threads: two per rank (the trainer gives each local rank its share)."""
    return 2 * scaling_layout(wildcards)[1]


def scaling_data(wildcards):
    return hdf5_dir(wildcards.phase)


def scaling_results():
    """Each configured phase's benchmark of each configured layout (config scaling)."""
    layouts = [f"{layout['nodes']}x{layout['gpus_per_node']}" for layout in config["scaling"]["layouts"]]
    return expand("results/scaling/{phase}/{layout}.json", phase=config["scaling"]["phases"], layout=layouts)


def all_targets():
    """What `snakemake all` builds: the data, both pretraining phases, the SQuAD evaluation, the GLUE tasks'."""
    return [
        hdf5_dir("phase1"),
        hdf5_dir("phase2"),
        "results/pretrain/phase2/model",
        "results/squad/eval.json",
        *glue_targets(),
        "results/summary.csv",
        *REPORT_TARGETS,
    ]
