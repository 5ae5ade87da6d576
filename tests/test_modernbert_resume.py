"""ModernBERT resumes as BERT does (issue 44 item 6): a phase SIGKILLed mid-phase reruns to bit-identical weights,
and a run checkpointed on 2 ranks continues on 1 like an uninterrupted run (fp32 summation order apart). The data:
the sample's text in the full-sentences recipe (ModernBERT has no next-sentence head); the optimizer: StableAdamW,
the family's own, its unfused path (Triton's kernel is CUDA's)."""
import logging
import multiprocessing
import re
import signal

import pytest
import torch

from tests.test_objective import full_sentence_data, sample  # noqa: F401 (fixtures)
from tests.test_pretrain import _free_port, _rank_worker, read_metrics, settings
from workflow.train import checkpoint as ckpt
from workflow.train.models.family import family
from workflow.train.pretrain import pretrain

TINY = {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2, "intermediate_size": 48,
        "local_attention": 16, "max_position_embeddings": 64, "global_attn_every_n_layers": 3}


def modernbert_settings(data, out, dropout: float = 0.1, **overrides):
    architecture = {**TINY, "embedding_dropout": dropout, "mlp_dropout": dropout, "attention_dropout": 0.0}
    values = dict(family="modernbert", preset="modernbert-tiny", architecture=architecture, bert_config=None,
                  optimizer="stable_adamw", fused=False, learning_rate=1e-3, total_steps=8,
                  global_batch_size=16, micro_batch_size=8, checkpoint_every=3, log_every=1, eval_max_sequences=32,
                  deterministic=True)
    return settings(data, out, **{**values, **overrides})


def _pretrain_killed_at(step: int, s) -> None:
    import os

    os.environ["SNAKEBERT_FAIL_AT_STEP"] = str(step)
    pretrain(s)


def weights(directory) -> dict:
    return family("modernbert").load_directory(directory)[1]


def test_a_modernbert_phase_killed_mid_phase_reruns_to_bit_identical_weights(full_sentence_data, tmp_path,  # noqa: F811
                                                                             caplog):
    data = full_sentence_data["full"]
    straight = modernbert_settings(data, tmp_path / "straight")
    pretrain(straight)
    crashed = modernbert_settings(data, tmp_path / "crashed")
    process = multiprocessing.get_context("spawn").Process(target=_pretrain_killed_at, args=(5, crashed))
    process.start()
    process.join(timeout=300)
    assert process.exitcode == -signal.SIGKILL, process.exitcode
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "crashed" / "run" / "checkpoints")] == [
        "step_00000003.pt"]
    with caplog.at_level(logging.INFO, logger="engine"):
        summary = pretrain(crashed)  # the rerun
    assert re.search(r"resumed from \S+step_00000003\.pt at step 3/8 \(48 sequences consumed", caplog.text), caplog.text
    assert summary["steps"] == 8
    expected, got = weights(straight.out_model), weights(crashed.out_model)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    assert [m["loss"] for m in read_metrics(crashed.out_metrics)][-5:] == \
        [m["loss"] for m in read_metrics(straight.out_metrics)][-5:]


def test_a_modernbert_run_checkpointed_on_2_ranks_continues_on_1_like_an_uninterrupted_run(
        full_sentence_data, tmp_path):  # noqa: F811
    data = full_sentence_data["full"]
    common = dict(dropout=0.0, checkpoint_every=100)  # dropout masks depend on the rank layout
    straight = modernbert_settings(data, tmp_path / "straight", **common)
    pretrain(straight)
    elastic = tmp_path / "elastic"
    torch.multiprocessing.spawn(_rank_worker, nprocs=2, args=(2, _free_port(), modernbert_settings(
        data, elastic, micro_batch_size=4, max_steps=4, **common)))
    pretrain(modernbert_settings(data, elastic, **common))  # 1 rank, another micro-batch
    state, _ = ckpt.load_latest_checkpoint(elastic / "run" / "checkpoints")
    assert (state["step"], state["consumed"]) == (8, 8 * 16)
    expected, got = weights(straight.out_model), weights(elastic / "model")
    for name in expected:  # equal up to fp32 reduction order (gloo sums, other micro-batch splits)
        assert torch.allclose(got[name], expected[name], atol=1e-5, rtol=1e-4), name
    losses = [(m["step"], m["loss"]) for m in read_metrics(elastic / "metrics.jsonl")]
    assert losses == [(m["step"], pytest.approx(m["loss"], abs=1e-5)) for m in read_metrics(straight.out_metrics)]

