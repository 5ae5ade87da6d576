"""Pretraining: learning, exact resume after kill -9, stop signals, checkpoint fallback, DDP, bad input."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from workflow.train import checkpoint as ckpt
from workflow.cli import UserError, run
from workflow.train.model import BertConfig, load_pretrained
from workflow.train.pretrain import TrainSettings, accumulation_steps, main, pretrain
from workflow.train.pretraining_data import list_shards, write_synthetic_shards

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Synthetic NVIDIA-schema shards (seq 32, 5 predictions, vocab 64) and a tiny bert_config.json."""
    root = tmp_path_factory.mktemp("pretrain_data")
    write_synthetic_shards(root / "hdf5", vocab_size=64, seq_length=32, max_predictions=5, n_training_shards=2,
                           n_test_shards=1, sequences_per_shard=256, seed=0)
    return root


def bert_config(path, dropout=0.1):
    BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
               max_position_embeddings=64, hidden_dropout_prob=dropout,
               attention_probs_dropout_prob=dropout).to_json(path)
    return str(path)


def settings(data, out, **overrides) -> TrainSettings:
    out = Path(out)
    values = dict(phase="phase1", data_dir=str(data / "hdf5"), vocab=str(data / "hdf5" / "vocab.txt"),
                  run_dir=str(out / "run"), out_model=str(out / "model"), out_metrics=str(out / "metrics.jsonl"),
                  out_summary=str(out / "summary.json"), learning_rate=3e-2, warmup_proportion=0.05,
                  total_steps=150, global_batch_size=32, micro_batch_size=16,
                  bert_config=bert_config(out.parent / f"{out.name}_bert_config.json"), device="cpu", log_every=10,
                  checkpoint_every=50, seed=7, threads=1)
    values.update(overrides)
    return TrainSettings(**values)


def command(s: TrainSettings) -> list[str]:
    argv = [sys.executable, "-m", "workflow.train.pretrain"]
    for key, value in vars(s).items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


def environment(**extra):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SNAKEBERT_FAIL_AT_STEP"):
        if key not in extra:
            env.pop(key, None)
    return env


def read_metrics(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_tiny_model_loss_falls_and_mlm_accuracy_beats_chance(data, tmp_path):
    summary = pretrain(settings(data, tmp_path / "out"))
    metrics = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(10, 151, 10))
    assert set(metrics[0]) >= {"step", "loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "lr", "grad_norm",
                               "seq_per_s", "tokens_per_s"}
    assert metrics[-1]["loss"] < 0.8 * metrics[0]["loss"]
    chance = 1 / 59  # 59 non-special tokens
    assert summary["test_mlm_accuracy"] > 5 * chance
    assert summary["steps"] == 150 and summary["test_sequences"] == 256
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["test_mlm_accuracy"] == \
        summary["test_mlm_accuracy"]
    config, state = load_pretrained(tmp_path / "out" / "model")
    assert config.hidden_size == 32 and "cls.predictions.bias" in state
    # No GPU here: the telemetry CSV is absent rather than empty.
    assert not (tmp_path / "out" / "run" / "gpu_telemetry.csv").exists()


def test_kill_9_then_rerun_resumes_to_bit_identical_weights(data, tmp_path):
    # Dropout on, 2 micro-batches per step; 3 shards of 44 sequences = 15 micro-batches per epoch (4 rows of each
    # shard dropped), so the crash at step 7 falls in epoch 0 and the resumed run crosses shards and epochs.
    small = tmp_path / "small"
    write_synthetic_shards(small / "hdf5", n_training_shards=3, sequences_per_shard=44, seed=5)
    common = dict(total_steps=12, checkpoint_every=3, log_every=1, micro_batch_size=8, global_batch_size=16,
                  deterministic=True)
    straight = settings(small, tmp_path / "straight", **common)
    crashed = settings(small, tmp_path / "crashed", **common)
    assert subprocess.run(command(straight), env=environment(), capture_output=True).returncode == 0

    first = subprocess.run(command(crashed), env=environment(SNAKEBERT_FAIL_AT_STEP="7"), capture_output=True,
                           text=True)
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    assert not Path(crashed.out_model).exists()
    assert [p.name for p in ckpt.list_checkpoints(Path(crashed.run_dir) / "checkpoints")] == [
        "step_00000003.pt", "step_00000006.pt"]

    state, _ = ckpt.load_latest_checkpoint(Path(crashed.run_dir) / "checkpoints")
    assert state["data"]["consumed"] == 12  # 5 + 5 micro-batches of shards 1 and 2, then 2 of the third
    assert (state["data"]["epoch"], state["data"]["slot"], state["data"]["offset"]) == (0, 2, 2)

    second = subprocess.run(command(crashed), env=environment(), capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "at step 6" in second.stderr
    _, expected = load_pretrained(straight.out_model)
    _, got = load_pretrained(crashed.out_model)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    timing = {"seq_per_s", "tokens_per_s"}
    strip = [{k: v for k, v in m.items() if k not in timing} for m in read_metrics(straight.out_metrics)]
    assert strip == [{k: v for k, v in m.items() if k not in timing} for m in read_metrics(crashed.out_metrics)]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_stop_signal_writes_a_checkpoint_and_exits_non_zero(data, tmp_path, signum):
    s = settings(data, tmp_path / "out", total_steps=100000, checkpoint_every=100000, log_every=1)
    process = subprocess.Popen(command(s), env=environment(), stderr=subprocess.PIPE, text=True)
    metrics = Path(s.run_dir) / "metrics.jsonl"
    deadline = time.time() + 120
    while not metrics.exists() and time.time() < deadline and process.poll() is None:
        time.sleep(0.2)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, stderr[-2000:]
    state, path = ckpt.load_latest_checkpoint(Path(s.run_dir) / "checkpoints")
    assert state is not None and state["step"] >= 1
    assert path.name == f"step_{state['step']:08d}.pt"
    assert state["data"]["consumed"] == 2 * state["step"]
    assert not Path(s.out_model).exists()


@pytest.mark.parametrize("world", [1, 2])
def test_a_stream_started_at_a_position_continues_exactly_like_one_that_got_there(tmp_path, world):
    from workflow.train.pretraining_data import PretrainingStream

    write_synthetic_shards(tmp_path, n_training_shards=3, sequences_per_shard=21, seed=2)
    shards = list_shards(tmp_path, "training")
    for rank in range(world):
        running = PretrainingStream(shards, 4, seed=9, rank=rank, world_size=world)
        seen = [next(running) for _ in range(38)]  # 5 micro-batches per shard: 15 (world 1) per epoch
        assert running.epoch >= 2
        for start in (0, 4, 5, 11, 15, 17, 31):
            resumed = PretrainingStream(shards, 4, seed=9, rank=rank, world_size=world, consumed=start)
            for expected in seen[start:start + 6]:
                got = next(resumed)
                assert all(torch.equal(got[k], expected[k]) for k in expected)
    # Epochs reshuffle the shard order.
    stream = PretrainingStream(shards, 4, seed=9)
    assert len({tuple(stream.plan(e)) for e in range(6)}) > 1


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    for step in (1, 2, 3, 4):
        ckpt.save_checkpoint(tmp_path, step, {"step": step, "weights": torch.full((3,), float(step))}, keep=3)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [f"step_0000000{i}.pt" for i in (2, 3, 4)]
    newest = tmp_path / "step_00000004.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated, as by a crash during a non-atomic copy
    state, path = ckpt.load_latest_checkpoint(tmp_path)
    assert state["step"] == 3 and path.name == "step_00000003.pt"
    assert torch.equal(state["weights"], torch.full((3,), 3.0))
    assert "step_00000004.pt is unreadable" in caplog.text
    # A flipped byte that still unpickles is caught by the checksum.
    third = tmp_path / "step_00000003.pt"
    raw = bytearray(third.read_bytes())
    raw[-30] ^= 0xFF
    third.write_bytes(bytes(raw))
    state, _ = ckpt.load_latest_checkpoint(tmp_path)
    assert state["step"] == 2


def write_shard(path, n=8, seq=32, pred=5, drop=None, reshape=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {"input_ids": np.ones((n, seq), "i4"), "input_mask": np.ones((n, seq), "i1"),
              "segment_ids": np.zeros((n, seq), "i1"), "masked_lm_positions": np.ones((n, pred), "i4"),
              "masked_lm_ids": np.ones((n, pred), "i4"), "next_sentence_labels": np.zeros((n,), "i1")}
    if reshape:
        arrays[reshape] = np.ones((n, seq + 1), "i1")
    with h5py.File(path, "w") as handle:
        for name, value in arrays.items():
            if name != drop:
                handle.create_dataset(name, data=value)


def test_shard_missing_a_dataset_is_named(tmp_path):
    write_shard(tmp_path / "training" / "a.hdf5", drop="masked_lm_ids")
    with pytest.raises(UserError, match=r"a\.hdf5: missing dataset 'masked_lm_ids'"):
        list_shards(tmp_path, "training")


def test_shard_with_a_wrong_shape_is_named(tmp_path):
    write_shard(tmp_path / "training" / "b.hdf5", reshape="input_mask")
    with pytest.raises(UserError, match=r"b\.hdf5: dataset 'input_mask' has shape \(8, 33\), expected \(8, 32\)"):
        list_shards(tmp_path, "training")


def test_empty_data_directory_is_named(tmp_path, data, capsys):
    (tmp_path / "hdf5" / "training").mkdir(parents=True)
    s = settings(data, tmp_path / "out", data_dir=str(tmp_path / "hdf5"))
    with pytest.raises(SystemExit) as exit_info:
        run(main, command(s)[3:])
    assert exit_info.value.code == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert error == [f"error: {tmp_path / 'hdf5' / 'training'}: no *.hdf5 shards (empty or missing data directory)"]


@pytest.mark.parametrize("native", [False, True])
def test_auto_precision_picks_bf16_only_where_the_gpu_has_it_natively(monkeypatch, native):
    from workflow.train.precision import resolve_precision

    # A V100 reports bf16 "supported" through emulation (slow); an A100/H100 natively.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native or including_emulation)
    expected = "bf16" if native else "fp32"
    for config_key in ("pretrain.precision", "squad.precision"):  # one function serves both stages
        assert resolve_precision("auto", torch.device("cuda"), config_key) == expected


def test_global_batch_not_divisible_names_the_config_key(data, tmp_path):
    with pytest.raises(UserError, match=r"config pretrain\.phase2\.global_batch_size \(48\) is not divisible by "
                                        r"pretrain\.phase2\.micro_batch_size \(16\) x world size \(2\)"):
        accumulation_steps(48, 16, 2, "phase2")
    with pytest.raises(UserError, match=r"pretrain\.phase1\.global_batch_size \(40\)"):
        pretrain(settings(data, tmp_path / "out", global_batch_size=40))
    assert not (tmp_path / "out" / "run").exists()


# ---------------------------------------------------------------- DDP: 2 processes == 1 process


def _free_port() -> int:
    """A port p with p + 1 also free (two rendezvous in a row)."""
    for _ in range(100):
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no pair of free ports")


def _micro_batches(data_dir, count):
    from workflow.train.pretraining_data import PretrainingStream

    stream = PretrainingStream(list_shards(data_dir, "training"), 8, seed=1)
    return [next(stream) for _ in range(count)]


def _ddp_worker(rank, world, port, data_dir, config_path, result_path, full_settings):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from workflow.train import distributed
    from workflow.train.pretrain import build_model, train_step
    from workflow.train.lamb import make_optimizer

    env = distributed.setup("cpu")
    torch.manual_seed(0)
    config, model = build_model("tiny", config_path, None, 64, 32)
    optimizer, _ = make_optimizer(model, 1e-2)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    batches = _micro_batches(data_dir, 12)
    for step in range(3):  # 4 micro-batches per global step: rank r takes micro-batches 2r, 2r+1
        mine = batches[4 * step + 2 * rank: 4 * step + 2 * rank + 2]
        train_step(ddp, optimizer, mine, env.device)
    if rank == 0:
        torch.save(model.state_dict(), result_path)
    torch.distributed.barrier()
    distributed.cleanup()
    # The whole pipeline under 2 ranks: per-rank shards, gathered RNG states, reduced metrics and evaluation.
    os.environ["MASTER_PORT"] = str(port + 1)  # a fresh rendezvous: never race the old store's shutdown
    pretrain(full_settings)


def test_two_process_gloo_ddp_equals_one_process_with_the_same_global_batch(data, tmp_path):
    from workflow.train.lamb import make_optimizer
    from workflow.train.pretrain import build_model, train_step

    config_path = bert_config(tmp_path / "config.json", dropout=0.0)
    full = settings(data, tmp_path / "ddp", total_steps=4, checkpoint_every=2, log_every=2, global_batch_size=16,
                    micro_batch_size=4)
    torch.multiprocessing.spawn(_ddp_worker, args=(2, _free_port(), data / "hdf5", config_path,
                                                   tmp_path / "ddp.pt", full), nprocs=2)

    torch.manual_seed(0)
    _, model = build_model("tiny", config_path, None, 64, 32)
    optimizer, _ = make_optimizer(model, 1e-2)
    batches = _micro_batches(data / "hdf5", 12)
    for step in range(3):
        train_step(model, optimizer, batches[4 * step: 4 * step + 4], torch.device("cpu"))
    distributed_state = torch.load(tmp_path / "ddp.pt", weights_only=True)
    for name, value in model.state_dict().items():
        assert torch.allclose(value, distributed_state[name], atol=1e-6, rtol=1e-5), name

    summary = json.loads(Path(full.out_summary).read_text())
    assert summary["world_size"] == 2 and summary["accumulation_steps"] == 2 and summary["steps"] == 4
    assert summary["test_sequences"] == 256  # the test shard, evaluated once over both ranks
    state, _ = ckpt.load_latest_checkpoint(Path(full.run_dir) / "checkpoints")
    assert state["step"] == 4 and len(state["rng"]) == 2


# ---------------------------------------------------------------- launching: torchrun, srun, the rules


def test_rank_and_world_come_from_torchrun_or_from_a_slurm_step_only():
    from workflow.train.distributed import launch_command, read_environment

    assert read_environment({}) == (0, 1, 0)
    assert read_environment({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == (3, 4, 1)
    step = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_LOCALID": "1", "SLURM_JOB_ID": "77", "MASTER_ADDR": "node1"}
    assert read_environment(step) == (1, 2, 1) and step["MASTER_PORT"] == "15077"
    # A batch script carries SLURM_PROCID=0 and SLURM_NTASKS=2 but is one process: it must launch, not join.
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}
    assert read_environment(batch) == (0, 1, 0)
    # (the srun line of a batch step: tests/test_slurm.py, test_launcher_gives_every_rank_its_own_gpu_...)
    assert launch_command(["python", "x.py"], step) == ["python", "x.py"]
    assert launch_command(["python", "x.py"], {}) == ["python", "x.py"]


def _slurm_answers() -> bool:
    import shutil

    if not shutil.which("srun") or not shutil.which("sinfo"):
        return False
    states = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True).stdout.split()
    return any(s.rstrip("*~#") in ("idle", "mix") for s in states)


@pytest.mark.skipif(not _slurm_answers(), reason="no idle Slurm node here")
def test_srun_tasks_join_one_process_group_from_slurm_variables(tmp_path):
    script = ("import torch; from workflow.train import distributed as d; e = d.setup('cpu'); t = torch.ones(1) * "
              "(e.rank + 1); d.all_reduce_(t); print(e.rank, e.world_size, int(t.item()), flush=True); d.cleanup()")
    result = subprocess.run(["timeout", "120", "sbatch", "--wait", "--ntasks=2", "-o", str(tmp_path / "out"),
                             "--wrap", f"{sys.executable} -m workflow.train.distributed -- {sys.executable} -c \"{script}\""],
                            cwd=REPO, env=environment(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr + (tmp_path / "out").read_text(errors="replace")
    lines = sorted(line for line in (tmp_path / "out").read_text().splitlines() if len(line.split()) == 3)
    assert lines == ["0 2 3", "1 2 3"]


def test_snakemake_runs_phase1_then_phase2_from_phase1s_export(data, tmp_path):
    import shutil

    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    for name in ("Snakefile", "rules", "workflow", "envs", "config.yaml", "config.schema.yaml"):
        (work / name).symlink_to(REPO / name)
    write_synthetic_shards(work / "data" / "hdf5_seq32", seq_length=32, max_predictions=5, sequences_per_shard=64)
    write_synthetic_shards(work / "data" / "hdf5_seq64", seq_length=64, max_predictions=8, sequences_per_shard=32)
    shutil.copyfile(work / "data" / "hdf5_seq32" / "vocab.txt", work / "data" / "vocab.txt")
    bert_config(work / "bert_config.json")
    (work / "test.yaml").write_text(
        "encode: {phase1: {max_seq_length: 32, max_predictions_per_seq: 5},"
        " phase2: {max_seq_length: 64, max_predictions_per_seq: 8}}\n"
        "model: {preset: tiny, bert_config: bert_config.json}\n"
        "pretrain: {checkpoint_every: 2, log_every: 1, precision: auto, eval_max_sequences: 16,\n"
        "  phase1: {learning_rate: 0.01, warmup_proportion: 0.1, total_steps: 4, global_batch_size: 16,"
        " micro_batch_size: 8},\n"
        "  phase2: {learning_rate: 0.01, warmup_proportion: 0.1, total_steps: 6, max_steps: 3,"
        " global_batch_size: 8, micro_batch_size: 4}}\n")
    result = subprocess.run(["snakemake", "--cores", "2", "--configfile", "test.yaml", "--allowed-rules",
                             "pretrain_phase1", "pretrain_phase2", "--", "results/pretrain/phase2/model"],
                            cwd=work, env=environment(PATH=f"{Path(sys.executable).parent}{os.pathsep}"
                                                           f"{os.environ['PATH']}"),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    first = json.loads((work / "results/pretrain/phase1/summary.json").read_text())
    second = json.loads((work / "results/pretrain/phase2/summary.json").read_text())
    assert (first["steps"], first["seq_length"], first["accumulation_steps"]) == (4, 32, 2)
    assert (second["steps"], second["seq_length"], second["total_steps"]) == (3, 64, 6)
    assert second["test_sequences"] == 16
    assert [m["step"] for m in read_metrics(work / "results/pretrain/phase2/metrics.jsonl")] == [1, 2, 3]
    log = (work / "logs/pretrain_phase2/pretrain.log").read_text()
    assert "initialised from results/pretrain/phase1/model" in log
    assert "missing" not in log  # phase 1's export matched the model exactly: nothing missing, nothing extra
    assert (work / "runs/pretrain/phase1/checkpoints/step_00000004.pt").exists()
    # Phase 2 has its own optimizer and schedule: its checkpoints restart at step 1 with phase 2's step count.
    state, _ = ckpt.load_latest_checkpoint(work / "runs/pretrain/phase2/checkpoints")
    assert state["step"] == 3 and state["scheduler"]["last_epoch"] == 3
