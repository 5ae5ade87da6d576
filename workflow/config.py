"""The workflow's config, validated against config.schema.yaml with the schema's defaults filled in: what the
Snakefile does when it starts (rules/common.smk calls validate_config), for a stage run outside Snakemake too.

API:
    validate_config(config, schema_path=SCHEMA) -> config   in place: defaults filled in; UserError naming the key
    load_config(path) -> config                             a YAML config file, validated
    schema_defaults(section) -> dict                        a section as a config that leaves it out has it: how
                                                            code and tests without a config file get the defaults
    PHASES                                                  the pretraining phases, in order (pretrain.<phase>,
                                                            encode.<phase>, the {phase} wildcard, --phase)
    pretrain_config_error(pretrain) -> one line or None     the pretrain section's relations between keys, each
                                                            phase's and the optimizer's below: the Snakefile's check
                                                            at parse time and the job's, one function
    optimizer_config_error(pretrain) -> one line or None    a key set in the section of the optimizer not chosen
    schedule_config_error(phase, key) -> one line or None   pretrain.<phase>: a wsd key set under schedule poly, or
                                                            warm-up and decay longer than the phase
"""
from __future__ import annotations

import copy
import functools
import os
from pathlib import Path

import jsonschema
import yaml

from workflow.cli import UserError
from workflow.phases import PHASES  # noqa: F401 (the config's phases: workflow/phases.py)

SCHEMA = Path(__file__).resolve().parents[1] / "config.schema.yaml"
WSD_KEYS = ("decay_proportion", "decay_shape", "final_lr_fraction")  # pretrain.<phase>'s keys of schedule wsd
# pretrain.<phase>.schedule where the section leaves it out (the schema: "absent = poly"). Not a schema default: one
# would write itself into every phase section, and so into the params of phases already trained.
DEFAULT_SCHEDULE = "poly"


def _with_defaults(validator_class):
    """The validator that fills in each property's schema default before checking it (jsonschema's FAQ recipe, as
    Snakemake's `validate` uses it)."""
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        for name, subschema in properties.items():
            if isinstance(instance, dict) and "default" in subschema:
                instance.setdefault(name, copy.deepcopy(subschema["default"]))
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


def config_error(config: dict, schema: dict) -> str:
    """One line naming the first bad config key as a dotted path (jsonschema's best match) and what is wrong."""
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(config))
    key = ".".join(str(part) for part in error.absolute_path)
    if error.validator == "additionalProperties":
        unknown = sorted(set(error.instance) - set(error.schema.get("properties", {})))
        prefix = f"{key}." if key else ""
        dotted = ", ".join(f"'{prefix}{name}'" for name in unknown)
        return f"config: unknown key {dotted} (every key is listed in config.schema.yaml)"
    return f"config key '{key}': {error.message}"


@functools.cache
def _schema(schema_path: str) -> dict:
    with open(schema_path) as stream:
        return yaml.safe_load(stream)


def validate_config(config: dict, schema_path: str | os.PathLike = SCHEMA) -> dict:
    schema = _schema(str(schema_path))
    try:
        _with_defaults(jsonschema.Draft202012Validator)(schema).validate(config)
    except jsonschema.exceptions.ValidationError:
        raise UserError(config_error(config, schema)) from None
    return config


def schema_defaults(section: str) -> dict:
    """The config `section` as the schema's defaults make it (a fresh copy)."""
    return validate_config({})[section]


def load_config(path: str | os.PathLike) -> dict:
    try:
        with open(path) as stream:
            config = yaml.safe_load(stream) or {}
    except (OSError, yaml.YAMLError) as error:
        raise UserError(f"{path}: not a readable YAML config ({error})") from None
    return validate_config(config)


def pretrain_config_error(pretrain: dict) -> str | None:
    """The config's pretrain section (defaults filled in): what the schema cannot say (relations between keys), as
    one line naming the key; None when consistent."""
    for phase in PHASES:
        section, key = pretrain[phase], f"pretrain.{phase}"
        error = phase_forms_error(section, key) or schedule_config_error(section, key)
        if error:
            return error
        if section.get("max_steps") and section.get("total_steps") and section["max_steps"] > section["total_steps"]:
            return (f"config key '{key}.max_steps': {section['max_steps']} exceeds {key}.total_steps "
                    f"({section['total_steps']})")
    return optimizer_config_error(pretrain)


def optimizer_config_error(pretrain: dict) -> str | None:
    """The config's pretrain section (defaults filled in): a key of the section of an optimizer not chosen
    (pretrain.lamb with pretrain.optimizer: adamw, pretrain.stable_adamw with lamb, ...) set to other than its default
    would do nothing; the line naming it, None when there is none."""
    schema = _schema(str(SCHEMA))["properties"]["pretrain"]["properties"]
    chosen = pretrain["optimizer"]
    for other in schema["optimizer"]["enum"]:
        defaults = {key: value.get("default") for key, value in schema[other]["properties"].items()}
        for key, value in pretrain.get(other, {}).items() if other != chosen else ():
            if key in defaults and value != defaults[key]:
                instead = (f"set pretrain.{chosen}.{key} instead" if key in schema[chosen]["properties"] else
                           f"{chosen} has no {key}")
                return (f"config pretrain.{other}.{key}: {value} is set, but pretrain.optimizer is {chosen}, which "
                        f"reads pretrain.{chosen}; {instead}, or pretrain.optimizer: {other}")
    return None


def phase_forms(phase: dict, key: str) -> list[tuple[dict, str, str, str]]:
    """(section, its dotted name, the value in sequences or steps, the same in row tokens) of each value a phase
    section gives in one form or the other (pretrain.<phase> and its batch_size_warmup)."""
    forms = [(phase, key, "global_batch_size", "global_batch_tokens"), (phase, key, "total_steps", "total_tokens")]
    ramp = phase.get("batch_size_warmup") or {}
    if ramp:
        forms += [(ramp, f"{key}.batch_size_warmup", "start_size", "start_tokens"),
                  (ramp, f"{key}.batch_size_warmup", "sequences", "tokens")]
    return forms


def phase_forms_error(phase: dict, key: str) -> str | None:
    """Each value of the phase in exactly one form (sequences/steps or row tokens): else one line naming the key."""
    for section, where, counted, tokens in phase_forms(phase, key):
        given = [name for name in (counted, tokens) if section.get(name) is not None]
        if len(given) != 1:
            return (f"config {where}: set {counted} or {tokens}" if not given else
                    f"config {where}: {counted} and {tokens} are both set; give one (null the other)")
    return None


def schedule_config_error(phase: dict, key: str) -> str | None:
    """`phase`: the config's pretrain.<phase> section (key: its dotted name). A wsd key under schedule poly would do
    nothing; warm-up plus decay longer than the phase has no stable stretch to stand on."""
    if phase.get("schedule", DEFAULT_SCHEDULE) == "poly":
        for name in WSD_KEYS:
            if phase.get(name) is not None:
                return (f"config {key}.{name}: {phase[name]} is set, but {key}.schedule is poly (NVIDIA's), which "
                        f"has no decay to shape; set {key}.schedule: wsd, or remove {key}.{name}")
        return None
    warmup, decay = phase.get("warmup_proportion", 0), phase.get("decay_proportion") or 0
    if warmup + decay > 1:
        return (f"config {key}: warmup_proportion {warmup} + decay_proportion {decay} exceed 1 (the whole phase); "
                f"lower either")
    return None
