"""recipes/modernbert-base.yaml: Snakemake plans the DAG with it (over the sample, offline), its values are
ModernBERT's published ones (arXiv 2412.13663 and its repository's yamls/modernbert/*.yaml), its step counts are
the published token budget through our batch ramp, and docs/modernbert.md cites every value it sets."""
import re
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO, copy_workflow, snakemake_env
from workflow.train.optim.schedules import BatchRamp

RECIPE = REPO / "recipes" / "modernbert-base.yaml"

# The published values, by the recipe's key: ModernBERT-base's yamls (pretrain: phase 1; context-extension and
# learning-rate-decay: phase 2, here one phase of 250B + 50B tokens) and the paper.
PUBLISHED = {
    "vocab.type": "bpe",
    "vocab.size": 50368,                                     # vocab_size
    "encode.objective": "documents",                         # sequence_packing of documents, unpadded attention
    "encode.masking": "dynamic",                             # masks drawn as the loader reads (their collator)
    "encode.masking_rule": "per_token",                      # each token with mlm_probability
    "encode.masked_lm_prob": 0.3,                            # mlm_probability
    "encode.eval_masked_lm_prob": 0.15,                      # eval_loader mlm_probability
    "encode.phase1.max_seq_length": 1024,                    # pretrain max_seq_len
    "encode.phase2.max_seq_length": 8192,                    # context-extension max_seq_len
    "model.family": "modernbert",
    "model.preset": "modernbert-base",                       # 22 x 768, intermediate 1,152, 12 heads
    "model.architecture.global_rope_theta": 10000.0,         # pretrain rotary_emb_base
    "model.architecture.local_rope_theta": 10000.0,          # local_attn_rotary_emb_base
    "pretrain.optimizer": "stable_adamw",                    # decoupled_stableadamw
    "pretrain.stable_adamw.weight_decay": 1.0e-5,
    "pretrain.stable_adamw.beta1": 0.9,
    "pretrain.stable_adamw.beta2": 0.98,
    "pretrain.stable_adamw.eps": 1.0e-6,
    "pretrain.stable_adamw.max_grad_norm": None,             # no clipping configured
    "pretrain.stable_adamw.decouple_lr": True,               # decoupled_
    "pretrain.phase1.learning_rate": 8.0e-4,
    "pretrain.phase1.schedule": "wsd",                       # warmup_stable_decay, t_decay 0tok
    "pretrain.phase1.global_batch_size": 4608,               # global_train_batch_size
    "pretrain.phase1.micro_batch_size": 96,                  # device_train_microbatch_size
    "pretrain.phase1.batch_size_warmup.start_size": 768,     # batch_size_warmup_min_size 96 a GPU x 8
    "pretrain.phase2.learning_rate": 3.0e-4,
    "pretrain.phase2.schedule": "wsd",                       # constant_with_warmup, then one_minus_sqrt
    "pretrain.phase2.warmup_proportion": 0.0,                # t_warmup 0tok
    "pretrain.phase2.decay_shape": "1-sqrt",                 # one_minus_sqrt
    "pretrain.phase2.final_lr_fraction": 0.001,              # alpha_f
    "pretrain.phase2.global_batch_size": 576,                # global_train_batch_size
    "pretrain.phase2.micro_batch_size": 12,                  # device_train_microbatch_size
    "pretrain.phase2.global_rope_theta": 160000.0,           # context-extension rotary_emb_base
}
TOKENS = {"phase1": 1_719_000_000_000, "phase2": 300_000_000_000}  # max_duration: 1,719B; 250B + 50B
WARMUP_TOKENS, RAMP_TOKENS, DECAY_TOKENS = 3_000_000_000, 50_000_000_000, 50_000_000_000  # t_warmup, ramp, decay


def recipe() -> dict:
    return yaml.safe_load(RECIPE.read_text())


def value(config: dict, key: str):
    for part in key.split("."):
        config = config[part]
    return config


def test_the_recipe_sets_modernberts_published_values():
    config = recipe()
    assert {key: value(config, key) for key in PUBLISHED} == PUBLISHED


def test_the_recipes_step_counts_are_the_published_token_budget():
    """Phase 1: 1,719B tokens in sequences of 1,024, the first 50B in the ramp's smaller steps, the first 3B in the
    warm-up; phase 2: 300B tokens in steps of 576 x 8,192, the last 50B decaying (each within one step)."""
    phase1, phase2 = recipe()["pretrain"]["phase1"], recipe()["pretrain"]["phase2"]
    length1, length2 = 1024, 8192
    assert phase1["batch_size_warmup"]["sequences"] == RAMP_TOKENS // length1
    ramp = BatchRamp(phase1["global_batch_size"], phase1["batch_size_warmup"]["start_size"],
                     phase1["batch_size_warmup"]["sequences"])
    steps = phase1["total_steps"]
    assert ramp.sequences_before(steps - 1) * length1 < TOKENS["phase1"] <= ramp.sequences_before(steps) * length1
    warmup = round(phase1["warmup_proportion"] * steps)
    assert abs(ramp.sequences_before(warmup) * length1 - WARMUP_TOKENS) < phase1["global_batch_size"] * length1
    step_tokens = phase2["global_batch_size"] * length2
    assert (phase2["total_steps"] - 1) * step_tokens < TOKENS["phase2"] <= phase2["total_steps"] * step_tokens
    decay = phase2["decay_proportion"] * phase2["total_steps"] * step_tokens
    assert abs(decay - DECAY_TOKENS) < step_tokens


def test_docs_cite_every_value_the_recipe_sets():
    section = (REPO / "docs" / "modernbert.md").read_text().split("## The recipe file", 1)[1].split("\n## ", 1)[0]
    assert "2412.13663" in section and "yamls/modernbert" in section

    def keys(node, prefix=""):
        for name, child in node.items():
            yield from keys(child, f"{prefix}{name}.") if isinstance(child, dict) else [f"{prefix}{name}"]

    missing = [key for key in keys(recipe()) if f"`{key}`" not in section]
    assert not missing, f"docs/modernbert.md's recipe section does not cite {missing}"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return copy_workflow(tmp_path_factory.mktemp("recipes"))


def test_snakemake_plans_both_phases_with_the_recipe(workdir):
    """Over the sample (offline: the default config reads the dump's checksum list from the network)."""
    result = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-p", "pretrain", "--configfile",
                             "sample/config.yaml", "recipes/modernbert-base.yaml"], cwd=workdir, text=True,
                            capture_output=True, env=snakemake_env(), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"^pretrain_phase\s+2$", result.stdout, re.MULTILINE), result.stdout[-3000:]
    encodes = [line for line in result.stdout.splitlines() if "workflow.data.encode" in line]
    for length in (1024, 8192):
        assert any(f"--max-seq-length {length}" in line for line in encodes), encodes[:2]
