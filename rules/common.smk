# Config validation, the path helpers and input functions several stages share, and `all`'s targets. No rule lives
# here; a function only one stage uses lives in that stage's .smk.
import functools
import json
import os
import sys

# the repository root, so that the workflow package (and the schema) are found whichever Snakefile includes this file
# and whatever the run directory (`--directory`): here, and in every job through its shell command
REPO_ROOT = os.path.dirname(workflow.current_basedir.get_path_or_uri(secret_free=True))
sys.path.insert(0, REPO_ROOT)
# Snakemake's documented shell.prefix (it replaces the default `set -euo pipefail; `, kept here); inside the
# command, so a conda env (which blocks an inherited PYTHONPATH) and a Slurm job (which re-reads this file) get it
shell.prefix("set -euo pipefail; export PYTHONPATH={REPO_ROOT:q}${{PYTHONPATH:+:$PYTHONPATH}}; ")
from workflow.cli import UserError
from workflow.config import PHASES, pretrain_config_error, validate_config
from workflow.data.corpora import corpora_error
from workflow.data.download import dump_parts, wikipedia_dump_url
from workflow.data.masking_rule import encode_config_error
from workflow.data.vocab import vocab_config_error
from workflow.glue.data import TASKS as GLUE_TASKS
from workflow.tasks.config import task_config_error
from workflow.train.models.family import family as model_family, model_config_error


try:
    validate_config(config, f"{REPO_ROOT}/config.schema.yaml")  # also fills in the schema's defaults
except UserError as error:
    raise ValueError(str(error)) from None


def config_consistency_error(config):
    """What the schema cannot say (relations between keys), as one line naming the key; None when consistent."""
    error = pretrain_config_error(config["pretrain"])
    if error:
        return error
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
    return (encode_config_error(config) or task_config_error(config) or corpora_error(config)
            or vocab_config_error(config) or model_config_error(config))


def glue_setting(task, key):
    """A GLUE task's value of `key`: glue.overrides.<task>.<key> if set, else glue.<key>."""
    return config["glue"]["overrides"].get(task, {}).get(key, config["glue"][key])


if (consistency_error := config_consistency_error(config)):
    raise ValueError(consistency_error)

def config_sections(*sections):
    """A params function: the config `sections` as JSON, handed over whole to a module that validates them.

    It takes `threads`, so Snakemake counts it as derived (like threads) and leaves it out of the rerun check:
    cadence or micro-batch edits rerun nothing; the rule's `recipe` param holds what changes its outputs.
    No documented mechanism does this per param (`--rerun-triggers` drops params for every rule, and the data
    rules need them), so it rests on Snakemake 9's rules.py `_is_deriving_function`; tests/test_pretrain.py's
    cadence edit ("Nothing to be done") fails if an update changes it.
    """

    def sections_json(wildcards, threads):
        return json.dumps({key: config[key] for key in sections}, sort_keys=True)

    return sections_json


SPLITS = ["training", "test"]


@functools.cache
def wikipedia_dump_parts():
    """The files the Wikipedia dump is processed as (config wikipedia.parts): {name: DumpPart} in page-id order;
    names are page-id ranges `pFIRSTpLAST`, or `whole`. Read when the DAG first needs them (not by --lint), once."""
    wikipedia = config["wikipedia"]
    try:
        url = wikipedia["url"] or wikipedia_dump_url(wikipedia["language"])
        parts = dump_parts(url, wikipedia["checksum_url"], wikipedia["parts"], "data/download/wikipedia")
    except UserError as error:
        # one line and stop: an input function's exception would be an InputFunctionException with a traceback
        sys.exit(f"error: config key 'wikipedia.parts': {wikipedia['parts']} reads the dump's checksum list: {error}; "
                 "offline, set wikipedia.parts: single or point wikipedia.url at a local dump")
    return {part.name: part for part in parts}


wildcard_constraints:
    part=r"whole|p\d+p\d+",
    split="training|test",
    index=r"\d+",
    seq=r"\d+",
    phase="|".join(PHASES),
    layout=r"\d+x\d+",


def wikipedia_parts(pattern):
    """`pattern` filled in for every part of the dump, in page-id order (the order of the articles)."""
    return expand(pattern, part=list(wikipedia_dump_parts()))


def seq_length(phase):
    return config["encode"][phase]["max_seq_length"]


def hdf5_dir(phase):
    """The directory a trainer reads for a phase: data/hdf5_seq128, data/hdf5_seq512."""
    return f"data/hdf5_seq{seq_length(phase)}"


def glue_targets():
    """Each configured GLUE task's dev scores."""
    return expand("results/glue/{task}/eval.json", task=config["glue"]["tasks"])


def task_targets():
    """Each configured task's scores, and its predictions where it names a test file (rules/tasks.smk)."""
    tasks = config["tasks"]
    return [*expand("results/tasks/{name}/eval.json", name=list(tasks)),
            *[f"results/tasks/{name}/predictions.jsonl" for name, task in tasks.items() if task.get("test")]]


# The pretraining part of the report (`snakemake pretrain` builds it with both phases).
PRETRAIN_REPORT_TARGETS = [
    "results/report/pretrain_loss.png",
    "results/report/mlm_accuracy.png",
    "results/report/heldout_accuracy.png",
    "results/report/throughput.png",
    "results/report/gpu_telemetry.png",
    "results/report/config.yaml",
    "results/corpora.csv",
]


def squad_targets():
    """SQuAD's evaluation and its report figure, when squad.enabled."""
    return ["results/squad/eval.json", "results/report/squad_finetune.png"] if config["squad"]["enabled"] else []


def summary_squad_inputs():
    """The SQuAD files the summary reads ({} when squad.enabled is false): {squad_eval, squad_metrics}."""
    if not config["squad"]["enabled"]:
        return {}
    return {"squad_eval": "results/squad/eval.json", "squad_metrics": "results/squad/finetune_metrics.jsonl"}


def pretrain_targets():
    """What `snakemake pretrain` builds: the data, both pretraining phases and the pretraining part of the report."""
    return [*map(hdf5_dir, PHASES), f"results/pretrain/{PHASES[-1]}/model", *PRETRAIN_REPORT_TARGETS]


def all_targets():
    """What `snakemake all` builds: pretraining, then the evaluations the config names (SQuAD when squad.enabled, the
    GLUE tasks, the tasks) and the summary table."""
    return [*pretrain_targets(), *squad_targets(), *glue_targets(), *task_targets(), "results/summary.csv"]
