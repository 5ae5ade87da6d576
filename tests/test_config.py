"""A bad config (unknown key, wrong type, value out of range) stops Snakemake before any job, naming the key; the
shipped config.yaml is the schema's defaults with a comment per key."""
import re
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO, copy_workflow
from workflow.config import validate_config


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return copy_workflow(tmp_path_factory.mktemp("config"))


@pytest.mark.parametrize(("override", "message"), [
    ("shard: {n_trainng_shards: 4}",
     "config: unknown key 'shard.n_trainng_shards' (every key is listed in config.schema.yaml)"),
    ("colour: blue", "config: unknown key 'colour' (every key is listed in config.schema.yaml)"),
    ("seed: abc", "config key 'seed': 'abc' is not of type 'integer'"),
    ("format: {style: paragraphs}", "config key 'format.style': 'paragraphs' is not one of ['sentences', 'articles']"),
    ("shard: {n_training_shards: 0}", "config key 'shard.n_training_shards': 0 is less than the minimum of 1"),
    ("encode: {masked_lm_prob: 1.5}", "config key 'encode.masked_lm_prob': 1.5 is greater than the maximum of 1"),
    # Relations between keys, found before any job is submitted (not on the GPU partition, three times).
    ("pretrain: {phase1: {learning_rate: 0.01, warmup_proportion: 0.1, total_steps: 60, max_steps: 100,"
     " global_batch_size: 32, micro_batch_size: 16}}",
     "config key 'pretrain.phase1.max_steps': 100 exceeds pretrain.phase1.total_steps (60)"),
    # A phase in row tokens and in sequences at once: one form of each value (issue 43 item 5), and max_steps beside
    # total_tokens (no total_steps to exceed) plans.
    ("pretrain: {phase1: {global_batch_tokens: 4718592}}",
     "config pretrain.phase1: global_batch_size and global_batch_tokens are both set; give one (null the other)"),
    ("squad: {batch_size: 24, micro_batch_size: 16}",
     "config key 'squad.batch_size': 24 is not a multiple of squad.micro_batch_size (16)"),
    ("squad: {weight_decay: -1}", "config key 'squad.weight_decay': -1 is less than the minimum of 0"),
    # A key the chosen optimizer never reads: refused here, not when the phase job starts after the data half.
    ("pretrain: {optimizer: adamw, lamb: {beta2: 0.98}}",
     "config pretrain.lamb.beta2: 0.98 is set, but pretrain.optimizer is adamw, which reads pretrain.adamw; set "
     "pretrain.adamw.beta2 instead, or pretrain.optimizer: lamb"),
])
def test_bad_config_is_one_line_naming_the_key_and_plans_nothing(override, message, tmp_path, workdir):
    configfile = tmp_path / "bad.yaml"
    configfile.write_text(override + "\n")
    result = subprocess.run([sys.executable, "-m", "snakemake", "-n", "data/hdf5_seq128", "--configfile",
                             str(configfile)], cwd=workdir, capture_output=True, text=True)
    output = result.stdout + result.stderr
    assert result.returncode == 1
    assert message in output.splitlines()
    assert "Job stats" not in output


def test_shipped_configs_are_valid_and_defaults_are_filled(workdir):
    result = subprocess.run([sys.executable, "-m", "snakemake", "-n", "all", "--configfile", "sample/config.yaml"],
                            cwd=workdir, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"^pretrain_phase\s+2$", result.stdout, re.MULTILINE), result.stdout


# config.yaml is the schema's defaults, one commented line per key: the reference users read is one source.
CONFIG = REPO / "config.yaml"


def flat(mapping: dict, prefix: str = "") -> dict:
    """{dotted key: value} of a nested mapping; lists and empty mappings are values."""
    items = {}
    for key, value in mapping.items():
        if isinstance(value, dict) and value:
            items.update(flat(value, f"{prefix}{key}."))
        else:
            items[f"{prefix}{key}"] = value
    return items


def drift_from_schema(config_text: str) -> list[str]:
    """One line per key where the config text differs from the schema's defaults."""
    shipped, defaults = flat(yaml.safe_load(config_text)), flat(validate_config({}))
    lines = [f"{key}: not in config.yaml (schema default {defaults[key]!r})" for key in defaults if key not in shipped]
    lines += [f"{key}: {shipped[key]!r} in config.yaml, the schema's default is {defaults[key]!r}"
              for key in defaults if key in shipped and shipped[key] != defaults[key]]
    lines += [f"{key}: in config.yaml, not a schema default" for key in shipped if key not in defaults]
    return lines


def keys_without_comment(config_text: str) -> list[str]:
    """Dotted keys of the block mappings (lists' items are values) with no comment on their line or the one above."""
    lines = config_text.splitlines()
    missing = []

    def walk(node, prefix):
        for key, value in node.value:
            row = key.start_mark.line
            commented = " #" in lines[row] or (row > 0 and lines[row - 1].strip().startswith("#"))
            if not commented:
                missing.append(f"{prefix}{key.value} (line {row + 1})")
            if isinstance(value, yaml.MappingNode) and not value.flow_style:
                walk(value, f"{prefix}{key.value}.")

    walk(yaml.compose(config_text), "")
    return missing


def test_config_yaml_equals_the_schema_defaults_key_by_key():
    assert drift_from_schema(CONFIG.read_text()) == []


def test_every_key_of_config_yaml_has_a_one_line_comment():
    assert keys_without_comment(CONFIG.read_text()) == []


def test_a_drifted_or_uncommented_key_is_named():
    text = CONFIG.read_text()
    drifted = text.replace("seed: 12345 ", "seed: 7 ").replace("  punkt_parts: 1 ", "  punkt_partz: 1 ")
    assert drift_from_schema(drifted) == [
        "format.punkt_parts: not in config.yaml (schema default 1)",
        "seed: 7 in config.yaml, the schema's default is 12345",
        "format.punkt_partz: in config.yaml, not a schema default",
    ]
    uncommented = text.replace("  dupe_factor: 5               # times each document is used, with different masks",
                               "  dupe_factor: 5")
    line = uncommented.splitlines().index("  dupe_factor: 5") + 1
    assert keys_without_comment(uncommented) == [f"encode.dupe_factor (line {line})"]
