"""A bad config (unknown key, wrong type, value out of range) stops Snakemake before any job, naming the key."""
import re
import subprocess
import sys

import pytest

from tests.conftest import copy_workflow


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
    ("squad: {batch_size: 24, micro_batch_size: 16}",
     "config key 'squad.batch_size': 24 is not a multiple of squad.micro_batch_size (16)"),
    ("squad: {weight_decay: -1}", "config key 'squad.weight_decay': -1 is less than the minimum of 0"),
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
    assert re.search(r"^pretrain\s+2$", result.stdout, re.MULTILINE), result.stdout
