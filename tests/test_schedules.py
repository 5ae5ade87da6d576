"""A phase's schedules: warm-up-stable-decay's learning rates at chosen steps and on resume, the batch-size warm-up's
sequence offsets, and a run with both (and StableAdamW) stopped mid-ramp that resumes on another number of ranks
like an uninterrupted run."""
import io
import json
import math

import pandas as pd
import pytest
import torch

from tests.test_pretrain import _free_port, _rank_worker, bert_config, data, read_metrics, settings  # noqa: F401
from workflow.cli import UserError
from workflow.config import schedule_config_error, validate_config
from workflow.report.report import training_time
from workflow.train import checkpoint as ckpt
from workflow.train.optim.lamb import PolyWarmup
from workflow.train.models.bert import load_pretrained
from workflow.train.pretrain import TrainSettings, pretrain
from workflow.train.pretraining_data import PretrainingSequences, list_shards
from workflow.train.optim.schedules import BatchRamp, WarmupStableDecay, make_scheduler


def test_wsd_warms_up_holds_the_peak_then_decays_1_sqrt_to_the_final_fraction():
    wsd = WarmupStableDecay(total_steps=100, warmup_proportion=0.1, decay_proportion=0.4, decay_shape="1-sqrt",
                            final_lr_fraction=0.1)
    at = {t: wsd(t - 1) for t in (5, 10, 35, 60, 70, 90, 100)}  # optimizer step t = index + 1, as PolyWarmup's
    assert at[5] == pytest.approx(0.5)             # in the warm-up
    assert at[10] == 1.0 and at[35] == 1.0          # the warm-up's end, the stable middle
    assert at[60] == 1.0                            # the last stable step: the decay starts after it
    assert at[70] == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(10 / 40)))  # 0.55
    assert at[90] == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(30 / 40)))
    assert at[100] == pytest.approx(0.1)            # the final fraction at the last step
    linear = WarmupStableDecay(100, 0.1, 0.4, "linear", 0.0)
    assert linear(79) == pytest.approx(0.5) and linear(99) == 0.0
    # ModernBERT's two phases: the first all stable after its warm-up, the next without a second warm-up.
    stable = WarmupStableDecay(100, 0.1, 0.0)
    assert [stable(i) for i in (9, 50, 99)] == [1.0, 1.0, 1.0]
    carry_on = WarmupStableDecay(50, 0.0, 0.5, "1-sqrt", 0.0)
    assert carry_on(0) == 1.0 and carry_on(24) == 1.0 and carry_on(49) == 0.0


def test_poly_is_still_nvidias_schedule():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = make_scheduler(optimizer, 100, 0.1)  # schedule poly, the default
    assert isinstance(scheduler.lr_lambdas[0], PolyWarmup)


def lr_sequence(total, steps, saved=None):
    """The learning rates of `steps` steps of a wsd schedule (resumed from `saved` as the engine resumes: the
    optimizer's and the scheduler's state) and the state after them."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-3)
    scheduler = make_scheduler(optimizer, total, 0.05, "wsd", decay_proportion=0.5, decay_shape="1-sqrt",
                               final_lr_fraction=0.02)
    if saved is not None:
        saved = torch.load(saved, weights_only=False)
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    buffer = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, buffer)
    buffer.seek(0)
    return rates, buffer


def test_a_run_resumed_mid_decay_follows_the_same_learning_rates():
    straight, _ = lr_sequence(40, 40)
    first, saved = lr_sequence(40, 27)  # the decay starts after step 20
    rest, _ = lr_sequence(40, 13, saved)
    assert first + rest == straight
    assert straight[19] == 2e-3 and straight[39] == pytest.approx(2e-3 * 0.02)


def test_wsd_keys_under_poly_or_a_phase_shorter_than_warm_up_and_decay_are_one_error_naming_them():
    assert schedule_config_error({"decay_proportion": 0.2}, "pretrain.phase1") == (
        "config pretrain.phase1.decay_proportion: 0.2 is set, but pretrain.phase1.schedule is poly (NVIDIA's), which "
        "has no decay to shape; set pretrain.phase1.schedule: wsd, or remove pretrain.phase1.decay_proportion")
    assert schedule_config_error({"schedule": "wsd", "warmup_proportion": 0.7, "decay_proportion": 0.4},
                                 "pretrain.phase2").startswith("config pretrain.phase2: warmup_proportion 0.7 + "
                                                               "decay_proportion 0.4 exceed 1")
    config = validate_config({"model": {"bert_config": None}, "pretrain": {"phase1": {
        "learning_rate": 8e-4, "warmup_proportion": 0.01, "total_steps": 10, "global_batch_size": 8,
        "micro_batch_size": 4, "final_lr_fraction": 0.1}}})
    with pytest.raises(UserError, match=r"pretrain\.phase1\.final_lr_fraction: 0\.1 is set, but "):
        TrainSettings.from_config(config, "phase1", data_dir="", vocab="", run_dir="", out_model="", out_metrics="",
                                  out_summary="")
    config["pretrain"]["phase1"].update(schedule="wsd", batch_size_warmup={"start_size": 9, "sequences": 100})
    with pytest.raises(UserError, match=r"batch_size_warmup\.start_size \(9\) exceeds pretrain\.phase1\."
                                        r"global_batch_size \(8\)"):
        TrainSettings.from_config(config, "phase1", data_dir="", vocab="", run_dir="", out_model="", out_metrics="",
                                  out_summary="")


def test_the_batch_ramp_gives_each_steps_size_and_sequence_offset():
    ramp = BatchRamp(64, start_size=16, sequences=200)
    # start + (64 - 16) x s // 200 at the sequences s trained before, until s reaches 200
    assert [ramp.batch_at(k) for k in range(9)] == [16, 19, 24, 30, 37, 46, 57, 64, 64]
    assert [ramp.sequences_before(k) for k in (0, 1, 2, 7, 9)] == [0, 16, 35, 229, 357]
    assert ramp.ramp_steps == 7
    assert all(ramp.sequences_before(k + 1) - ramp.sequences_before(k) == ramp.batch_at(k) for k in range(30))
    none = BatchRamp(64)
    assert [none.batch_at(k) for k in (0, 5)] == [64, 64] and none.sequences_before(5) == 320


RECIPE = dict(optimizer="stable_adamw", weight_decay=1e-5, beta2=0.98, max_grad_norm=None, learning_rate=1e-2,
              schedule="wsd", decay_proportion=0.5, final_lr_fraction=0.1,
              batch_size_warmup={"start_size": 4, "sequences": 40})


def test_a_run_with_a_batch_ramp_stopped_mid_ramp_resumes_on_other_ranks_like_an_uninterrupted_run(data, tmp_path):
    config_path = bert_config(tmp_path / "config.json", dropout=0.0)  # dropout masks depend on the rank layout
    common = dict(total_steps=8, global_batch_size=16, checkpoint_every=100, log_every=1, eval_max_sequences=32,
                  bert_config=config_path, **RECIPE)
    straight = settings(data, tmp_path / "straight", micro_batch_size=4, **common)
    pretrain(straight)
    ramp = straight.batch_ramp
    assert [ramp.batch_at(k) for k in range(8)] == [4, 5, 6, 8, 10, 13, 16, 16]

    # The same run stopped at step 3 (mid-ramp) and resumed on one rank: bit-identical weights.
    again = tmp_path / "again"
    pretrain(settings(data, again, micro_batch_size=4, max_steps=3, **common))
    pretrain(settings(data, again, micro_batch_size=4, **common))
    _, expected = load_pretrained(straight.out_model)
    _, got = load_pretrained(again / "model")
    assert all(torch.equal(got[name], expected[name]) for name in expected)

    # Stopped at step 3 on 2 ranks, resumed on 1 with another micro-batch: equal up to fp32 reduction order.
    elastic = tmp_path / "elastic"
    torch.multiprocessing.spawn(_rank_worker, nprocs=2, args=(2, _free_port(), settings(
        data, elastic, micro_batch_size=2, max_steps=3, **common)))
    state, _ = ckpt.load_latest_checkpoint(elastic / "run" / "checkpoints")
    assert (state["step"], state["consumed"], len(state["rng"])) == (3, 4 + 5 + 6, 2)
    pretrain(settings(data, elastic, micro_batch_size=8, **common))
    state, _ = ckpt.load_latest_checkpoint(elastic / "run" / "checkpoints")
    assert (state["step"], state["consumed"]) == (8, ramp.sequences_before(8)) == (8, 78)
    _, got = load_pretrained(elastic / "model")
    for name in expected:
        assert torch.allclose(got[name], expected[name], atol=1e-5, rtol=1e-4), name
    losses = [(m["step"], m["loss"]) for m in read_metrics(elastic / "metrics.jsonl")]
    assert losses == [(m["step"], pytest.approx(m["loss"], abs=1e-5)) for m in read_metrics(straight.out_metrics)]
    # The steps trained on sequences [0, 78) of the global order, once each: their real tokens.
    sequences = PretrainingSequences(list_shards(straight.data_dir, "training"), straight.seed)
    real = int(sequences.read(0, 78)["attention_mask"].sum())
    assert sum(m["real_tokens"] for m in read_metrics(elastic / "metrics.jsonl")) == real
    lines = read_metrics(straight.out_metrics)
    assert [m["window_sequences"] for m in lines] == [ramp.batch_at(k) for k in range(8)]
    seconds = training_time(pd.DataFrame(lines), straight.phase.global_batch_size)  # the report's time axis
    assert seconds.iloc[-1] == pytest.approx(sum(m["window_sequences"] / m["seq_per_s"] for m in lines))
    summary = json.loads((tmp_path / "straight" / "summary.json").read_text())
    assert summary["sequences"] == 78 and summary["optimizer"].startswith("optimi.StableAdamW")
    assert summary["final_learning_rate"] == pytest.approx(1e-2 * 0.1)


def test_an_all_stable_phase_1_hands_phase_2_its_peak_and_stable_adamw_state_without_a_second_warm_up(data, tmp_path):
    config_path = bert_config(tmp_path / "config.json")
    recipe = dict(optimizer="stable_adamw", weight_decay=1e-5, beta2=0.98, max_grad_norm=None, learning_rate=1e-2,
                  schedule="wsd", global_batch_size=16, micro_batch_size=8, log_every=1, eval_max_sequences=16,
                  bert_config=config_path)
    phase1 = settings(data, tmp_path / "phase1", total_steps=6, warmup_proportion=0.5, decay_proportion=0.0,
                      out_optimizer=str(tmp_path / "phase1" / "optimizer_state.pt"), **recipe)
    pretrain(phase1)
    assert [m["lr"] for m in read_metrics(phase1.out_metrics)][2:] == [1e-2] * 4  # the peak from the warm-up's end
    phase2 = settings(data, tmp_path / "phase2", phase="phase2", total_steps=4, warmup_proportion=0.0,
                      decay_proportion=0.5, decay_shape="linear", init_from=phase1.out_model,
                      init_optimizer=phase1.out_optimizer, **recipe)
    pretrain(phase2)
    # A metrics line's lr is the next step's: step 2 at the peak (as step 1), steps 3 and 4 decay to 0
    assert [m["lr"] for m in read_metrics(phase2.out_metrics)] == pytest.approx([1e-2, 5e-3, 0.0, 0.0])
    state, _ = ckpt.load_latest_checkpoint(tmp_path / "phase2" / "run" / "checkpoints")
    assert [int(group["step"]) for group in state["optimizer"]["param_groups"]] == [6 + 4, 6 + 4]
