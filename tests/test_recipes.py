"""recipes/modernbert-base.yaml: Snakemake plans the DAG with it (over the sample, offline), its values are
ModernBERT's published ones (arXiv 2412.13663 and its repository's yamls/modernbert/*.yaml), its budgets in tokens
become the published step counts through our batch ramp on any packing, and docs/modernbert.md cites every value it
sets."""
import json
import re
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO, copy_workflow, snakemake_env
from workflow.train.optim.schedules import BatchRamp
from workflow.train.pretrain import phase_in_sequences

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
    "pretrain.phase1.global_batch_tokens": 4608 * 1024,      # global_train_batch_size rows of max_seq_len
    "pretrain.phase1.total_tokens": 1_719_000_000_000,       # max_duration: 1,719B tokens
    "pretrain.phase1.micro_batch_size": 96,                  # device_train_microbatch_size
    "pretrain.phase1.batch_size_warmup.start_tokens": 768 * 1024,  # batch_size_warmup_min_size 96 a GPU x 8 rows
    "pretrain.phase1.batch_size_warmup.tokens": 50_000_000_000,    # batch_size_warmup_tokens
    "pretrain.phase2.learning_rate": 3.0e-4,
    "pretrain.phase2.schedule": "wsd",                       # constant_with_warmup, then one_minus_sqrt
    "pretrain.phase2.warmup_proportion": 0.0,                # t_warmup 0tok
    "pretrain.phase2.decay_shape": "1-sqrt",                 # one_minus_sqrt
    "pretrain.phase2.final_lr_fraction": 0.001,              # alpha_f
    "pretrain.phase2.global_batch_tokens": 576 * 8192,       # global_train_batch_size rows of max_seq_len
    "pretrain.phase2.total_tokens": 300_000_000_000,         # max_duration: 250B (context) + 50B (decay)
    "pretrain.phase2.micro_batch_size": 12,                  # device_train_microbatch_size
    "pretrain.phase2.global_rope_theta": 160000.0,           # context-extension rotary_emb_base
}
WARMUP_TOKENS, DECAY_TOKENS = 3_000_000_000, 50_000_000_000  # t_warmup, decay
STEPS = {"phase1": 376_499, "phase2": 63_579}  # the published budgets in our steps (1,719B; 250B + 50B tokens)


def recipe() -> dict:
    return yaml.safe_load(RECIPE.read_text())


def value(config: dict, key: str):
    for part in key.split("."):
        config = config[part]
    return config


def test_the_recipe_sets_modernberts_published_values():
    config = recipe()
    assert {key: value(config, key) for key in PUBLISHED} == PUBLISHED


def data_of(directory, length: int, sequences_per_row: int):
    """A data directory's manifest.json: one training shard of 1,000 rows of `length` tokens."""
    directory.mkdir()
    shards = [{"path": f"training/seq{length}_training_shard_0.hdf5", "n_rows": 1000,
               "n_instances": 1000 * sequences_per_row}]
    (directory / "manifest.json").write_text(json.dumps({"settings": {"max_seq_length": length}, "shards": shards}))
    return str(directory)


@pytest.mark.parametrize("sequences_per_row", [1, 8])
def test_the_recipes_token_budgets_are_its_published_step_counts_on_any_packing(tmp_path, sequences_per_row):
    """Phase 1: 1,719B tokens in rows of 1,024, the first 50B in the ramp's smaller steps, the first 3B in the
    warm-up; phase 2: 300B tokens in steps of 576 x 8,192, the last 50B decaying (each within one step). A row
    holding 8 sequences makes 8 times the sequences a step, and the same steps (the ramp's within 0.01%: its
    batches grow in whole sequences)."""
    phases = {phase: phase_in_sequences(recipe()["pretrain"][phase], f"pretrain.{phase}",
                                        data_of(tmp_path / phase, length, sequences_per_row))
              for phase, length in (("phase1", 1024), ("phase2", 8192))}
    phase1, phase2 = phases["phase1"], phases["phase2"]
    assert phase2["total_steps"] == STEPS["phase2"]
    assert phase1["total_steps"] == STEPS["phase1"] if sequences_per_row == 1 else \
        abs(phase1["total_steps"] - STEPS["phase1"]) < 1e-4 * STEPS["phase1"]
    assert phase1["global_batch_size"] == 4608 * sequences_per_row and phase2["global_batch_size"] == 576 * \
        sequences_per_row
    assert phase1["batch_size_warmup"] == {"start_size": 768 * sequences_per_row,
                                           "sequences": 48_828_125 * sequences_per_row}
    row_tokens = 1024 / sequences_per_row  # a sequence's share of a row
    ramp = BatchRamp(phase1["global_batch_size"], **phase1["batch_size_warmup"])
    steps, tokens = phase1["total_steps"], value(recipe(), "pretrain.phase1.total_tokens")
    assert ramp.sequences_before(steps - 1) * row_tokens < tokens <= ramp.sequences_before(steps) * row_tokens
    warmup = round(value(recipe(), "pretrain.phase1.warmup_proportion") * steps)
    assert abs(ramp.sequences_before(warmup) * row_tokens - WARMUP_TOKENS) < 4608 * 1024
    step_tokens = 576 * 8192
    decay = value(recipe(), "pretrain.phase2.decay_proportion") * phase2["total_steps"] * step_tokens
    assert abs(decay - DECAY_TOKENS) < step_tokens


def test_a_phase_in_both_forms_or_neither_is_a_one_line_error_naming_the_key(tmp_path):
    from workflow.cli import UserError
    from workflow.config import phase_forms_error

    phase = {"global_batch_size": 8, "total_steps": 10}
    assert phase_in_sequences(phase, "pretrain.phase1", None) == {}  # sequences and steps: no data read
    for change, message in (
            ({"global_batch_tokens": 4096}, "config pretrain.phase1: global_batch_size and global_batch_tokens are "
                                            "both set; give one (null the other)"),
            ({"total_steps": None}, "config pretrain.phase1: set total_steps or total_tokens"),
            ({"batch_size_warmup": {"start_size": 2, "sequences": 4, "tokens": 99}},
             "config pretrain.phase1.batch_size_warmup: sequences and tokens are both set; give one (null the other)"),
            ({"global_batch_size": None, "global_batch_tokens": 4096},
             f"config pretrain.phase1.global_batch_tokens: tokens become sequences by the training data's rows: "
             f"{tmp_path / 'none' / 'training'}: no *.hdf5 shards (empty or missing data directory)")):
        error = phase_forms_error({**phase, **change}, "pretrain.phase1")  # the Snakefile's and the job's check
        if error is None:
            with pytest.raises(UserError) as raised:
                phase_in_sequences({**phase, **change}, "pretrain.phase1", str(tmp_path / "none"))
            error = str(raised.value)
        assert error == message


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
