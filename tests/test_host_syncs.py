"""The long run's step accounting on CPU: fp16 steps the loss scaler skips leave the learning-rate schedule where it
was, are counted and keep inf out of the logged gradient norm (also across a resume); no host sync on a step between
log lines and checkpoints (counted through accelerator.counting_host_syncs, what would wait for a GPU); the stop vote
read one step late."""
import json
from pathlib import Path

import pytest
import torch

from tests.test_finetune_ddp import FAMILIES, HEADS, RECIPE, prepare
from tests.test_pretrain import data, read_metrics, settings  # noqa: F401  (the data fixture)
from workflow.train import accelerator, engine
from workflow.train.pretrain import pretrain


def metrics(s) -> list[dict]:
    return read_metrics(s.out_metrics)


@pytest.fixture
def fp16_on_cpu(monkeypatch):
    """fp16 is refused off CUDA (no speed-up there): the device allows it here; GradScaler and autocast run for real."""
    import workflow.train.pretrain as pretrain_module

    monkeypatch.setattr(pretrain_module, "resolve_precision", lambda chosen, device, key: chosen)


@pytest.fixture
def overflow_at(monkeypatch):
    """overflow_at(steps): the gradient of the optimizer steps numbered `steps` (counted over the whole test, resumes
    included) holds an inf, as an fp16 overflow leaves it."""
    real, calls, chosen = engine._optimizer_step, [0], set()

    def step(model, *args, **kwargs):
        calls[0] += 1
        if calls[0] in chosen:
            next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
        return real(model, *args, **kwargs)

    monkeypatch.setattr(engine, "_optimizer_step", step)
    return chosen.update


def test_a_skipped_fp16_step_leaves_the_schedule_counts_the_skip_and_keeps_grad_norm_finite(
        data, tmp_path, fp16_on_cpu, overflow_at):  # noqa: F811
    common = dict(total_steps=8, log_every=1, checkpoint_every=8, precision="fp16", eval_max_sequences=16)
    reference = settings(data, tmp_path / "reference", **common)
    pretrain(reference)
    overflow_at({8 + 3})  # the 3rd step of the second run (the reference took 8)
    skipped = settings(data, tmp_path / "skipped", **common)
    pretrain(skipped)
    expected, got = metrics(reference), metrics(skipped)
    assert [m["skipped_steps"] for m in expected] == [0] * 8
    assert [m["skipped_steps"] for m in got] == [0, 0, 1, 0, 0, 0, 0, 0]
    # The schedule stands still on the skipped step: from step 3 on, each lr is the reference's one step earlier.
    assert [m["lr"] for m in got] == [m["lr"] for m in expected[:2]] + [m["lr"] for m in expected[1:7]]
    assert expected[1]["lr"] != expected[2]["lr"]  # (the warm-up moves it every step)
    # The skipped step's inf norm is in no mean: its line (a window of that step alone) has none.
    norms = [m["grad_norm"] for m in got]
    assert norms[2] is None and all(0 < n < float("inf") for n in norms[:2] + norms[3:])
    assert norms[:2] == [m["grad_norm"] for m in expected[:2]]
    state = torch.load(Path(skipped.run_dir) / "checkpoints" / "step_00000008.pt", weights_only=False)
    assert state["skipped_steps"] == 1 and state["scheduler"]["last_epoch"] == 7
    summaries = [json.loads(Path(s.out_summary).read_text()) for s in (reference, skipped)]
    assert [summary["skipped_steps"] for summary in summaries] == [0, 1]


def test_a_phase_with_skipped_fp16_steps_ends_with_its_data_and_its_summary_says_how_far_the_schedule_got(
        data, tmp_path, fp16_on_cpu, overflow_at, caplog):  # noqa: F811
    # Decided: no extra steps to finish the schedule (the data read and the compute stay what the config planned).
    from workflow.train.optim.lamb import PolyWarmup

    overflow_at({3, 5})
    s = settings(data, tmp_path, total_steps=8, log_every=1, checkpoint_every=8, precision="fp16", eval_max_sequences=16)
    summary = pretrain(s)
    assert (summary["steps"], summary["skipped_steps"], summary["schedule_steps"]) == (8, 2, 6)
    assert summary["sequences"] == 8 * s.phase.global_batch_size
    assert summary["final_learning_rate"] == pytest.approx(s.phase.learning_rate * PolyWarmup(8, s.phase.warmup_proportion)(6))
    assert summary["final_learning_rate"] == metrics(s)[-1]["lr"] > 0  # 2 steps short: not yet decayed to 0
    assert json.loads(Path(s.out_summary).read_text())["schedule_steps"] == 6
    assert "the learning-rate schedule ends at its step 6 of 8" in caplog.text


def test_a_run_resumed_after_a_skipped_fp16_step_equals_the_uninterrupted_one(data, tmp_path, fp16_on_cpu,
                                                                             overflow_at):  # noqa: F811
    common = dict(total_steps=8, log_every=2, checkpoint_every=2, precision="fp16", eval_max_sequences=16)
    overflow_at({3, 8 + 3})
    whole = settings(data, tmp_path / "whole", **common)
    pretrain(whole)
    resumed = settings(data, tmp_path / "resumed", **common)
    pretrain(settings(data, tmp_path / "resumed", **common, max_steps=4))  # optimizer steps 9..12: the skip at 11
    pretrain(resumed)
    assert metrics(resumed) == [{**m, "seq_per_s": r["seq_per_s"], "tokens_per_s": r["tokens_per_s"],
                                 "real_tokens_per_s": r["real_tokens_per_s"]}
                                for m, r in zip(metrics(whole), metrics(resumed))]
    assert [m["skipped_steps"] for m in metrics(resumed)] == [0, 1, 0, 0]
    assert json.loads(Path(resumed.out_summary).read_text())["skipped_steps"] == 1  # step 3, kept over the resume
    assert all(0 < m["grad_norm"] < float("inf") for m in metrics(resumed))  # steps 3-4: step 4's finite norm
    from safetensors.torch import load_file

    a, b = (load_file(str(Path(s.out_model) / "model.safetensors")) for s in (whole, resumed))
    assert len(a) > 10 and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("precision, per_step", [("fp32", 0), ("fp16", 1)])
def test_no_host_sync_on_a_step_between_log_lines_and_checkpoints(data, tmp_path, fp16_on_cpu, precision,  # noqa: F811
                                                                 per_step):
    # Reads by a loader worker (the host's own work on host tensors) are outside the training thread's count.
    s = settings(data, tmp_path, total_steps=12, log_every=4, checkpoint_every=6, precision=precision,
                 loader_workers=1, eval_max_sequences=16)
    with engine.measured_host_syncs() as syncs:
        pretrain(s)
    # Boundaries: log lines at 4, 8, 12, checkpoints at 6, 12; fp16: GradScaler reads found_inf to decide each step.
    assert (syncs["between_steps"], syncs["boundary_steps"]) == (8, 4)
    assert syncs["between_syncs"] == 8 * per_step, syncs["calls"]
    log_steps = [syncs["calls"][k - 1] for k in (4, 8)]
    assert all(calls == ["item"] * per_step + ["tolist"] for calls in log_steps), log_steps  # the window's one read
    assert syncs["calls"][6 - 1] == ["item"] * per_step  # a checkpoint step (its write is not part of the step)


def test_the_counter_sees_what_waits_for_a_gpu_and_nothing_else():
    device = torch.device("cpu")
    with accelerator.counting_host_syncs(device) as calls:
        x = torch.ones(3)
        y = (x * 2).sum()
        x.fill_(4.0)
        host = torch.zeros(())
        host.copy_(y, non_blocking=True)
    assert calls == []
    with accelerator.counting_host_syncs(device) as calls:
        y.item(), x.tolist(), float(y), torch.tensor(1.0, device=device), x.cpu()
    assert calls == ["item", "tolist", "__float__", "tensor", "cpu"]


def test_the_stop_vote_is_read_one_step_late_between_boundaries_and_at_once_at_them():
    vote = engine.StopVote(torch.device("cpu"))
    assert vote.previous() == 0 and vote.current() == 0
    vote.cast(None)
    assert (vote.previous(), vote.current()) == (0, 0)
    vote.cast(10)  # SIGUSR1 received during this step
    assert (vote.previous(), vote.current()) == (0, 10)
    vote.cast(None)
    assert vote.previous() == 10  # every rank stops after this step
    vote.cast(15)
    with accelerator.counting_host_syncs(torch.device("cpu")) as calls:
        assert vote.current() == 15
    assert calls == []


@pytest.mark.parametrize("model_family", FAMILIES)
@pytest.mark.parametrize("head", HEADS)
def test_no_host_sync_in_a_finetuning_step_between_log_lines_and_checkpoints(head, model_family, tmp_path):
    # Per micro-batch there was a pageable copy of the row count and a read of the attention mask (is there padding?).
    from workflow.classify.model import job_of
    from workflow.glue.data import TASKS
    from workflow.squad.finetune import JOB
    from workflow.tasks.run import token_job
    from workflow.train import finetune as finetuning

    prepare(head, tmp_path, model_family)
    job = {"squad": JOB, "classification": job_of(TASKS["SST-2"]), "regression": job_of(TASKS["STS-B"]),
           "token_classification": token_job("ner", ["O", "B-PER", "I-PER"])}[head]
    s = finetuning.FinetuneSettings(**{**RECIPE, "log_every": 3, "checkpoint_every": 3, "precision": "fp32"})
    with engine.measured_host_syncs() as syncs:
        finetuning.finetune(job, tmp_path / "init", tmp_path / "train.npz", tmp_path / "model", tmp_path / "run", s,
                            device="cpu", threads=1)
    # 3 steps of 4 micro-batches (16 rows in 4s): steps 1-2 between boundaries, step 3 logs and checkpoints.
    assert (syncs["between_steps"], syncs["boundary_steps"]) == (2, 1)
    assert syncs["between_syncs"] == 0, repr(syncs["calls"])[:3000]


@pytest.mark.parametrize("family", ["bert", "modernbert", "roberta"])
def test_the_gpu_paths_loss_and_backward_read_nothing_back_from_the_device(family):
    """The step a GPU trains (packed rows unpadded through the varlen custom ops, bf16 autocast, the MLM loss as
    PretrainingTask computes it) on CPU's stand-ins: nothing in the model, its loss or its backward would make the
    host wait for the GPU. (The optimizers' CPU paths read host-side state; their CUDA paths are fused.)"""
    from types import SimpleNamespace

    from benchmarks.compile_cpu import build, micro_batches
    from benchmarks.gpu_measure import Device
    from workflow.train.models.family import family as model_family
    from workflow.train.precision import autocast
    from workflow.train.pretrain import PretrainingTask

    torch.manual_seed(0)
    args = SimpleNamespace(batches=3, rows=4, seq=128, vocab=1024)
    config, model = build(family, args.vocab, args.seq)
    task = PretrainingTask(None, args.seq, family == "bert", model_family(family).host_indices)
    cpu = Device("cpu")
    with cpu.packed_path():
        for batch in micro_batches(family, config, args):
            totals = task.count(batch)
            with accelerator.counting_host_syncs(cpu.torch) as calls:
                with autocast(cpu.torch, "bf16"):
                    loss = task.loss(model, batch, totals)["loss"]
                loss.backward()
            assert calls == [] and loss.isfinite()
            assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
