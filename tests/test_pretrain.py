"""Pretraining: learning, exact resume after kill -9, elastic resume over world sizes, refusals, stop signals,
checkpoint fallback, DDP, bf16 on CPU, bad input."""
import dataclasses
import json
import os
import re
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
from workflow.config import validate_config
from workflow.train.models.bert import BertConfig, load_pretrained
from workflow.train.engine import accumulation_steps
from workflow.train.pretrain import TrainSettings, main, pretrain
from workflow.train.settings import OptimizerSettings, PhaseSettings, PretrainSettings
from workflow.data.synthetic_shards import write_synthetic_shards
from workflow.train.pretraining_data import PretrainingSequences, list_shards

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


def _names(settings_class) -> set:
    return {field.name for field in dataclasses.fields(settings_class)}


def config_from(phase: str, values: dict) -> dict:
    """The config sections (seed, model, pretrain) that set `values`, flat keys each in its section: a phase's,
    the pretrain section's, its optimizer's or the model's."""
    optimizer = values.get("optimizer", "lamb")
    config = {"model": {}, "pretrain": {phase: {}, optimizer: {}}}
    for key, value in values.items():
        if key == "seed":
            config["seed"] = value
        elif key in _names(PhaseSettings):
            config["pretrain"][phase][key] = value
        elif key in _names(OptimizerSettings):
            config["pretrain"][optimizer][key] = value
        elif key in _names(PretrainSettings):
            config["pretrain"][key] = value
        else:
            config["model"][key] = value
    return config


def settings(data, out, **overrides) -> TrainSettings:
    """A tiny BERT's phase-1 settings on `data`, flat keys of any section overriding (config_from), the rest the
    schema's defaults."""
    out = Path(out)
    values = dict(phase="phase1", data_dir=str(data / "hdf5"), vocab=str(data / "hdf5" / "vocab.txt"),
                  run_dir=str(out / "run"), out_model=str(out / "model"), out_metrics=str(out / "metrics.jsonl"),
                  out_summary=str(out / "summary.json"), learning_rate=3e-2, warmup_proportion=0.05,
                  total_steps=150, global_batch_size=32, micro_batch_size=16,
                  bert_config=bert_config(out.parent / f"{out.name}_bert_config.json"), device="cpu", log_every=10,
                  checkpoint_every=50, seed=7, threads=1)
    values.update(overrides)
    phase = values.pop("phase")
    job = {key: values.pop(key) for key in list(values)
           if key in _names(TrainSettings) - {"seed", "model", "pretrain"} | {"init_from"}}
    return TrainSettings.from_config(config_from(phase, values), phase, **job)


def replace(s: TrainSettings, **changes) -> TrainSettings:
    """`s` with flat keys changed in their sections (as config_from places them)."""
    parts = {part: dataclasses.replace(getattr(s, part), **{key: changes.pop(key) for key in list(changes)
                                                            if key in _names(type(getattr(s, part))) - {"optimizer"}})
             for part in ("phase", "pretrain", "model")}
    return dataclasses.replace(s, **parts, **changes)


def config_of(s: TrainSettings) -> dict:
    """The workflow config sections (seed, model, pretrain) that give `s`."""
    phase = {key: getattr(s.phase, key) for key in _names(PhaseSettings) - {"name"}
             if getattr(s.phase, key) is not None or key == "max_steps"}
    pretrain = {key: getattr(s.pretrain, key) for key in _names(PretrainSettings) - {"optimizer"}}
    optimizer = s.pretrain.optimizer
    section = {key: getattr(optimizer, key) for key in _names(OptimizerSettings) - {"name"}
               if getattr(optimizer, key) is not None or key == "max_grad_norm"}
    model = {key: getattr(s.model, key) for key in ("family", "preset", "architecture", "bert_config", "init_from",
                                                     "dle_gelu")}
    return {"seed": s.seed, "model": model,
            "pretrain": {**pretrain, "optimizer": optimizer.name, optimizer.name: section, s.phase.name: phase}}


def command(s: TrainSettings) -> list[str]:
    argv = [sys.executable, "-m", "workflow.train.pretrain", "--phase", s.phase.name, "--config", json.dumps(config_of(s)),
            "--data-dir", s.data_dir, "--vocab", s.vocab, "--run-dir", s.run_dir,
            "--out-dir", str(Path(s.out_model).parent), "--device", s.device, "--threads", str(s.threads)]
    return argv + (["--deterministic"] if s.deterministic else [])


def environment(**extra):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SNAKEBERT_FAIL_AT_STEP"):
        if key not in extra:
            env.pop(key, None)
    return env


def read_metrics(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_the_export_merges_the_telemetry_rows_other_nodes_write_after_rank_0s_sampler_stopped(data, tmp_path,
                                                                                               monkeypatch):
    # Rank 0 merges the node files when its own sampler stops; another node's sampler may write its last second
    # after that. The export merges again once every rank has stopped: that row is in the phase's telemetry.
    from workflow.train import pretrain as module
    from workflow.train.telemetry import COLUMNS, node_files

    out = tmp_path / "out"
    other_node = node_files(out / "run" / "gpu_telemetry.csv") / "node2.csv"
    other_node.parent.mkdir(parents=True)
    row = "{},node2,0,300.0,60,1980,2619,90,40,1000,81920\n"
    other_node.write_text(",".join(COLUMNS) + "\n" + row.format(1.0))
    real_evaluate = module.evaluate

    def late_row_then_evaluate(*args, **kwargs):  # after the training loop (and rank 0's sampler) has ended
        with open(other_node, "a") as handle:
            handle.write(row.format(2.0))
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(module, "evaluate", late_row_then_evaluate)
    pretrain(settings(data, out, total_steps=4, checkpoint_every=4, out_telemetry=str(out / "gpu_telemetry.csv")))
    exported = (out / "gpu_telemetry.csv").read_text().splitlines()
    assert exported == [",".join(COLUMNS), row.format(1.0).strip(), row.format(2.0).strip()]


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
    assert json.loads((tmp_path / "out" / "model" / "tokenizer_config.json").read_text())["do_lower_case"] is True
    # No GPU here: the telemetry CSV is absent rather than empty.
    assert not (tmp_path / "out" / "run" / "gpu_telemetry.csv").exists()
    # TensorBoard scalars beside metrics.jsonl: the same values, step by step.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "out" / "run" / "tensorboard")).Reload()
    assert {"loss", "mlm_accuracy", "nsp_accuracy", "lr", "seq_per_s", "real_tokens_per_s",
            "grad_norm"} <= set(events.Tags()["scalars"])
    for key in ("loss", "mlm_accuracy", "lr", "grad_norm"):
        assert [(e.step, e.value) for e in events.Scalars(key)] == [
            (m["step"], pytest.approx(m[key], rel=1e-6)) for m in metrics], key


def test_kill_9_then_rerun_resumes_to_bit_identical_weights(data, tmp_path):
    # Dropout on, 2 micro-batches per step; 3 shards of 44 sequences = 132 per epoch, so the crash at step 7 falls in
    # epoch 0 and the resumed run crosses shards and epochs.
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
    assert state["consumed"] == 6 * 16  # sequences; the 132-sequence epoch ends during step 9

    second = subprocess.run(command(crashed), env=environment(), capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "at step 6" in second.stderr
    # A log file gets the periodic lines (seq/s, ETA), never a progress bar's carriage returns.
    assert "\r" not in second.stderr and re.search(r"step 7/12 loss \d\.\d{4} lr \S+ \d+ seq/s ETA \d:\d\d:\d\d\n",
                                                    second.stderr), second.stderr[-2000:]
    # TensorBoard: the crashed run's steps past its checkpoint purged, every step once.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(Path(crashed.run_dir) / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("loss")] == list(range(1, 13))
    _, expected = load_pretrained(straight.out_model)
    _, got = load_pretrained(crashed.out_model)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    timing = {"seq_per_s", "tokens_per_s", "real_tokens_per_s"}
    strip = [{k: v for k, v in m.items() if k not in timing} for m in read_metrics(straight.out_metrics)]
    assert strip == [{k: v for k, v in m.items() if k not in timing} for m in read_metrics(crashed.out_metrics)]


def test_a_signal_to_one_rank_stops_every_rank_after_one_checkpoint(data, tmp_path):
    s = settings(data, tmp_path / "out", total_steps=100000, checkpoint_every=100000, log_every=1,
                 global_batch_size=32, micro_batch_size=8)
    port = str(_free_port())
    ranks = [subprocess.Popen(command(s), stderr=subprocess.PIPE, text=True, env=environment(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
        for rank in range(2)]
    metrics = Path(s.run_dir) / "metrics.jsonl"
    deadline = time.time() + 180
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.time() < deadline:
        time.sleep(0.2)
    ranks[1].send_signal(signal.SIGUSR1)  # only rank 1 hears it (as when one node gets the warning first)
    errors = [rank.communicate(timeout=180)[1] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [128 + signal.SIGUSR1] * 2, errors[0][-2000:] + errors[1][-2000:]
    state, path = ckpt.load_latest_checkpoint(Path(s.run_dir) / "checkpoints")
    assert len(ckpt.list_checkpoints(Path(s.run_dir) / "checkpoints")) == 1 and len(state["rng"]) == 2
    assert state["consumed"] == 32 * state["step"] and state["step"] >= 2


def test_the_launcher_starts_one_rank_per_visible_gpu_on_a_machine_without_slurm(data, tmp_path):
    s = settings(data, tmp_path / "out", total_steps=2, checkpoint_every=2, log_every=1, eval_max_sequences=16,
                 micro_batch_size=8, threads=2)
    # Two CPU "GPUs": SNAKEBERT_LOCAL_RANKS stands in for torch.cuda.device_count().
    result = subprocess.run([sys.executable, "-m", "workflow.slurm.launch", "--", *command(s)],
                            env=environment(SNAKEBERT_LOCAL_RANKS="2"), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(Path(s.out_summary).read_text())
    assert (summary["world_size"], summary["accumulation_steps"]) == (2, 2)


def test_each_rank_takes_its_share_of_the_jobs_threads():
    from workflow.train.distributed import local_world_size

    assert local_world_size({}) == 1
    assert local_world_size({"LOCAL_WORLD_SIZE": "4"}) == 4  # torchrun
    assert local_world_size({"SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "2(x3)"}) == 2
    assert local_world_size({"SLURM_TASKS_PER_NODE": "8"}) == 1  # the batch script itself: one process


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
    assert state["consumed"] == 32 * state["step"]
    assert not Path(s.out_model).exists()


def test_a_stop_signal_during_evaluation_finishes_the_evaluation_and_export_and_exits_zero(data, tmp_path):
    # SNAKEBERT_SIGNAL_AT=evaluation: the trainer sends itself SIGTERM as evaluation starts (as Slurm's time limit
    # would, minutes from the end); the default action would kill it with the outputs half written.
    s = settings(data, tmp_path / "out", total_steps=2, checkpoint_every=2, log_every=1, eval_max_sequences=16)
    result = subprocess.run(command(s), env=environment(SNAKEBERT_SIGNAL_AT="evaluation"), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "received SIGTERM: the last checkpoint is written; finishing the evaluation and export first" in result.stderr
    assert json.loads(Path(s.out_summary).read_text())["steps"] == 2 and (Path(s.out_model) / "config.json").exists()


def test_any_range_of_the_global_sequence_order_reads_the_same_sequences(tmp_path):
    write_synthetic_shards(tmp_path, n_training_shards=3, sequences_per_shard=21, seed=2)
    order = PretrainingSequences(list_shards(tmp_path, "training"), seed=9, chunk_rows=8)
    whole = order.read(0, 150)  # 63 per epoch in 9 chunks: crosses chunks and two epoch boundaries
    for start, count in ((0, 4), (5, 17), (20, 2), (60, 9), (126, 24)):
        part = PretrainingSequences(list_shards(tmp_path, "training"), seed=9, chunk_rows=8).read(start, count)
        assert all(torch.equal(part[k], whole[k][start:start + count]) for k in whole)
    ids = [tuple(row.tolist()) for row in whole["input_ids"]]
    assert sorted(ids[:63]) == sorted(ids[63:126]) and ids[:63] != ids[63:126]  # each epoch: all, reshuffled
    sources = order.sources(0, 126)
    assert sorted(map(tuple, sources[:63])) == sorted(map(tuple, sources[63:])) == [
        (shard, row) for shard in range(3) for row in range(21)]


def step_mixing(shard_of: np.ndarray, document_of: np.ndarray, step: int) -> dict:
    """Per step of `step` sequences, averaged: the share of its sequences from its most common shard, the shards it
    draws from (fewest over the steps), the pairs of sequences that are copies of one document, and the share of steps
    holding such a pair."""
    shares, shards, pairs = [], [], []
    for k in range(len(shard_of) // step):
        counts = np.bincount(shard_of[k * step:(k + 1) * step])
        shares.append(counts.max() / step)
        shards.append(np.count_nonzero(counts))
        copies = np.unique(document_of[k * step:(k + 1) * step], return_counts=True)[1]
        pairs.append(int((copies * (copies - 1) // 2).sum()))
    return {"top_shard_share": np.mean(shares), "fewest_shards": min(shards), "copy_pairs": np.mean(pairs),
            "steps_with_copies": np.mean(np.array(pairs) > 0)}


def test_a_step_mixes_the_shards_and_documents_nearly_as_a_uniform_shuffle_does():
    """Full-size proportions at a small scale: a shard holds 1,024 chunks (256 shards of ~340k packed rows in chunks
    of 256) and every document's copies (dupe_factor 5) lie at random rows of one shard, as encode writes them; a step
    of 512 sequences sees ~1 pair of copies under a uniform shuffle (65,536 of 217 M at full size: ~40)."""
    from workflow.train.pretraining_data import ShardInfo

    n_shards, rows, copies, step = 32, 16384, 5, 512
    rng = np.random.default_rng(0)
    document = np.stack([rng.permutation(rows) // copies + shard * rows for shard in range(n_shards)])
    order = PretrainingSequences([ShardInfo(f"shard_{i}", rows, 128, 20) for i in range(n_shards)], seed=1,
                                 chunk_rows=16)
    sources = order.sources(0, order.epoch_length)
    ours = step_mixing(sources[:, 0], document[sources[:, 0], sources[:, 1]], step)
    uniform = rng.permutation(n_shards * rows)
    uniform = step_mixing(uniform // rows, document.ravel()[uniform], step)
    # The order before: shards one after the other in a shuffled order, rows shuffled within each.
    shard_of = np.repeat(rng.permutation(n_shards), rows)
    row_of = np.concatenate([rng.permutation(rows) for _ in range(n_shards)])
    before = step_mixing(shard_of, document[shard_of, row_of], step)
    assert before["top_shard_share"] == 1 and before["fewest_shards"] == 1 and before["copy_pairs"] > 30
    # Expected: 32 chunks of 16 rows per step, ~20 shards; copies meet in a chunk (+0.8 pairs) or as uniform (+1).
    assert ours["top_shard_share"] < 2.5 * uniform["top_shard_share"] < 0.15
    assert ours["fewest_shards"] >= 12
    assert ours["copy_pairs"] < 2 * uniform["copy_pairs"] < 2.2
    assert ours["steps_with_copies"] < uniform["steps_with_copies"] + 0.25 < 0.95


def test_a_rank_reads_only_chunks_of_rows_and_holds_a_few_whatever_the_shard_size(tmp_path, monkeypatch):
    """Memory per loader bounded: every HDF5 read is one chunk of rows, a process holds at most `cached_chunks`
    decoded chunks and `open_files` files, and a rank of 4 reads only about its quarter of a step."""
    import workflow.train.pretraining_data as pretraining_data

    write_synthetic_shards(tmp_path, n_training_shards=3, sequences_per_shard=200, seed=2)
    reads = []
    read_rows = pretraining_data.read_rows
    monkeypatch.setattr(pretraining_data, "read_rows", lambda arrays, first, stop: reads.append(stop - first) or
                        read_rows(arrays, first, stop))
    order = PretrainingSequences(list_shards(tmp_path, "training"), seed=1, chunk_rows=16, cached_chunks=2,
                                 open_files=2)
    for start in range(0, 1200, 40):  # two epochs
        order.read(start, 40)
        assert len(order._chunks) <= 2 and len(order._files) <= 2
    assert max(reads) == 16 and sum(reads) < 1.5 * 1200  # each chunk decoded about once
    reads.clear()
    order.micro_batches(0, 160, rank=1, world=4, rows=8)
    assert sum(reads) <= 3 * 16  # its 40 rows lie in at most 3 chunks of 16
    order.close()


def live_sequences(batch) -> list[int]:
    """The instances a packed batch trains on, in order (row by row, slot by slot)."""
    return [i for i in batch["instance_index"].flatten().tolist() if i >= 0]


def test_packed_reads_give_every_sequence_once_whatever_the_split_into_steps_and_micro_batches(tmp_path):
    write_synthetic_shards(tmp_path, n_training_shards=1, sequences_per_shard=40, seed=2, max_sequences_per_pack=3, short_seq_prob=0.7)
    shards = list_shards(tmp_path, "training")
    assert shards[0].packed and shards[0].n == 40 and shards[0].rows < 30  # several sequences per row
    length_of, row_of = packed_file_maps(shards[0].path)
    whole = PretrainingSequences(shards, seed=9, chunk_rows=4).read(0, 100)  # crosses chunks and two epochs
    order = live_sequences(whole)
    assert len(order) == 100 and sorted(order[:40]) == list(range(40)) and order[:40] != order[40:80]
    # Reads that start inside a row (its first sequences belong to the read before): two of them below.
    inside = [k for k in range(1, 100) if row_of[order[k - 1]] == row_of[order[k]]]
    assert len(inside) >= 20  # 40 sequences in < 30 rows, each epoch
    for start, count in ((0, 1), (1, 6), (7, 13), (20, 21), (41, 3), (77, 23), (inside[0], 5),
                         (inside[-1], 100 - inside[-1])):
        part = PretrainingSequences(shards, seed=9, chunk_rows=4).read(start, count)
        assert live_sequences(part) == order[start:start + count]
        assert int((part["next_sentence_labels"] >= 0).sum()) == count
        # A straddling row's other sequences are padding here: only the live sequences' tokens are real.
        assert int((part["attention_mask"] > 0).sum()) == sum(length_of[i] for i in live_sequences(part))


def packed_file_maps(path) -> tuple[dict, dict]:
    """{instance: its length}, {instance: its row} of a packed shard."""
    with h5py.File(path, "r") as handle:
        index, lengths = handle["instance_index"][()], handle["sequence_lengths"][()]
    rows = np.nonzero(index >= 0)
    return dict(zip(index[rows].tolist(), lengths[rows].tolist())), dict(zip(index[rows].tolist(), rows[0].tolist()))


@pytest.mark.parametrize("max_sequences_per_pack", [3, "auto"])  # auto: 10 slots at 32 tokens
def test_a_packed_step_has_the_loss_and_gradients_of_the_same_sequences_unpacked(tmp_path, max_sequences_per_pack):
    from workflow.train.models.bert import BertForPreTraining
    from workflow.train.pretrain import PretrainingTask
    from workflow.train.pretraining_data import make_batch, read_shard

    write_synthetic_shards(tmp_path / "plain", n_training_shards=1, sequences_per_shard=48, seed=4,
                           short_seq_prob=0.7)
    write_synthetic_shards(tmp_path / "packed", n_training_shards=1, sequences_per_shard=48, seed=4,
                           max_sequences_per_pack=max_sequences_per_pack, short_seq_prob=0.7)
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.from_json(bert_config(tmp_path / "config.json", dropout=0.0)))
    packed_task = PretrainingTask(PretrainingSequences(list_shards(tmp_path / "packed", "training"), seed=3), 32)
    # One step of 24 sequences after 5, in two micro-batches whose edge falls inside a row.
    _, row_of = packed_file_maps(list_shards(tmp_path / "packed", "training")[0].path)
    order = live_sequences(packed_task.read(0, 29))
    edge = next(k for k in range(10, 25) if row_of[order[k - 1]] == row_of[order[k]])
    micro = [packed_task.read(5, edge - 5), packed_task.read(edge, 29 - edge)]
    assert row_of[live_sequences(micro[0])[-1]] == row_of[live_sequences(micro[1])[0]]  # the edge splits a row

    def step(task, batches):
        model.zero_grad()
        counts = [task.count(b) for b in batches]
        totals = {key: sum(c[key] for c in counts).float() for key in counts[0]}
        loss = 0
        for batch in batches:
            out = task.loss(model, batch, totals)
            out["loss"].backward()
            loss += out["loss"].item()
        return loss, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    packed_loss, packed_grads = step(packed_task, micro)
    instances = np.array([i for m in micro for i in live_sequences(m)])
    assert len(instances) == 24 == len(set(instances))
    plain = [make_batch(read_shard(list_shards(tmp_path / "plain", "training")[0]), np.sort(instances))]
    plain_loss, plain_grads = step(packed_task, plain)
    assert abs(packed_loss - plain_loss) < 1e-5
    assert packed_grads.keys() == plain_grads.keys()
    for name in plain_grads:
        assert torch.allclose(packed_grads[name], plain_grads[name], atol=1e-5, rtol=1e-4), name



@pytest.mark.parametrize("packed", [False, True], ids=["nvidia_schema", "packed"])
def test_the_task_loss_at_real_prediction_slots_equals_the_loss_over_every_slot(tmp_path, packed):
    """PretrainingTask.loss runs the MLM head at the labelled slots only; the old head at every slot (empty ones
    ignored through label -1) gives the same loss, statistics and gradients."""
    import torch.nn.functional as F

    from workflow.train.models.bert import BertForPreTraining
    from workflow.train.pretrain import PretrainingTask

    write_synthetic_shards(tmp_path, n_training_shards=1, sequences_per_shard=40, seed=4, short_seq_prob=0.7,
                           max_sequences_per_pack=3 if packed else None)
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.from_json(bert_config(tmp_path / "config.json", dropout=0.0)))
    task = PretrainingTask(PretrainingSequences(list_shards(tmp_path, "training"), seed=3), 32)
    sources = task.sequences.sources(0, 40)
    start = next(k for k in range(5, 40) if (sources[k - 1] == sources[k]).all()) if packed else 5
    batch = task.read(start, 16)
    if packed:  # the read starts inside a packed row: its first sequence, [CLS] included, is padding here
        assert batch["attention_mask"][0, batch["cls_positions"][0, 0]] == 0
    valid = batch["masked_lm_labels"] >= 0
    assert 0 < valid.sum() < valid.numel()
    totals = {key: value.float() for key, value in task.count(batch).items()}

    def every_slot(model, batch, totals):
        mlm, nsp = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
                         batch["masked_lm_positions"], batch.get("position_ids"), batch.get("cls_positions"))
        labels, nsp_labels = batch["masked_lm_labels"].flatten(), batch["next_sentence_labels"].flatten()
        mlm, nsp = mlm.flatten(0, -2), nsp.flatten(0, -2)
        return {"loss": F.cross_entropy(mlm, labels, ignore_index=-1, reduction="sum") / totals["masked"]
                + F.cross_entropy(nsp, nsp_labels, ignore_index=-1, reduction="sum") / totals["sequences"],
                "mlm_correct": ((mlm.argmax(-1) == labels) & (labels >= 0)).sum(), "mlm_count": (labels >= 0).sum()}

    results = []
    for loss in (task.loss, every_slot):
        model.zero_grad(set_to_none=True)
        out = loss(model, batch, totals)
        out["loss"].backward()
        results.append((out, {name: p.grad.clone() for name, p in model.named_parameters()}))
    (sparse, sparse_grads), (dense, dense_grads) = results
    assert torch.allclose(sparse["loss"], dense["loss"], rtol=1e-6, atol=0)
    assert sparse["mlm_count"] == dense["mlm_count"] == valid.sum() and sparse["mlm_correct"] == dense["mlm_correct"]
    for name, gradient in dense_grads.items():
        assert (sparse_grads[name] - gradient).norm() <= 1e-6 * gradient.norm() + 1e-9, name

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
        accumulation_steps(48, 16, 2, "pretrain.phase2")


@pytest.mark.parametrize("packed", [False, True], ids=["nvidia_schema", "packed"])
def test_micro_batches_of_rows_have_one_shape_and_give_the_steps_loss_and_gradients_on_any_world(tmp_path, packed):
    """pretrain's micro_batch_size counts rows: a step's rows split over the ranks, in micro-batches of exactly that
    many rows (the last filled up with empty rows), train on the step's sequences with the loss and gradients of the
    step read as one batch, whatever the number of ranks."""
    from workflow.train.models.bert import BertForPreTraining
    from workflow.train.pretrain import PretrainingTask

    write_synthetic_shards(tmp_path, n_training_shards=2, sequences_per_shard=40, seed=4, short_seq_prob=0.7,
                           max_sequences_per_pack=3 if packed else None)
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.from_json(bert_config(tmp_path / "config.json", dropout=0.0)))
    task = PretrainingTask(PretrainingSequences(list_shards(tmp_path, "training"), seed=3, chunk_rows=8), 32)
    start, count, rows = 5, 29, 4  # the step starts and ends inside packed rows and crosses chunks

    def step(batches):
        model.zero_grad()
        counts = [task.count(b) for b in batches]
        totals = {key: sum(c[key] for c in counts).float() for key in counts[0]}
        loss = sum(task.loss(model, batch, totals)["loss"] for batch in batches)
        loss.backward()
        return totals, loss.item(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    def live_rows(batch):
        return int((batch["next_sentence_labels"] >= 0).reshape(len(batch["input_ids"]), -1).any(1).sum())

    whole = task.read(start, count)
    whole_totals, whole_loss, whole_grads = step([whole])
    assert whole_totals["sequences"] == count
    for world in (1, 2, 3):
        split = [task.micro_batches(start, count, rank, world, rows) for rank in range(world)]
        batches = [b for mine in split for b in mine]
        assert {tuple(b["input_ids"].shape) for b in batches} == {(rows, 32)}
        # Every row of the step once, each rank's last micro-batch filled up with empty rows.
        assert sum(map(live_rows, batches)) == len(whole["input_ids"])
        assert [len(mine) for mine in split] == [-(-sum(map(live_rows, mine)) // rows) for mine in split]
        totals, loss, grads = step(batches)
        assert totals == whole_totals and loss == pytest.approx(whole_loss, abs=1e-5), world
        assert grads.keys() == whole_grads.keys()
        for name in grads:
            assert torch.allclose(grads[name], whole_grads[name], atol=1e-5, rtol=1e-4), (world, name)


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


def _rank_worker(rank, world, port, s):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    pretrain(s)


def _choose_worker(rank, world, port, directory, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from workflow.train import distributed
    from workflow.train.engine import choose_checkpoint

    env = distributed.setup("cpu")
    if rank == 1:  # this rank's read fails (a flaky mount): it must not fall back to an older step on its own
        ckpt.load_checkpoint = lambda path, map_location="cpu": (_ for _ in ()).throw(OSError("stale file handle"))
    try:
        choose_checkpoint(directory, env)
        outcome = "loaded"
    except UserError as error:
        outcome = str(error)
    Path(results, f"rank{rank}").write_text(outcome)
    distributed.cleanup()


def test_when_one_rank_cannot_read_the_chosen_checkpoint_every_rank_stops(tmp_path):
    for step in (1, 2):
        ckpt.save_checkpoint(tmp_path / "checkpoints", step, {"step": step}, keep=3)
    torch.multiprocessing.spawn(_choose_worker, nprocs=2, args=(2, _free_port(), tmp_path / "checkpoints", tmp_path))
    chosen = tmp_path / "checkpoints" / "step_00000002.pt"
    assert (tmp_path / "rank0").read_text() == f"{chosen}: 1 rank(s) cannot read the checkpoint rank 0 chose"
    assert (tmp_path / "rank1").read_text() == f"{chosen}: 1 rank(s) cannot read the checkpoint rank 0 chose " \
                                               "(stale file handle)"


@pytest.fixture(scope="module")
def packed_data(tmp_path_factory):
    """The `data` fixture's kind of shards, many of them short, packed up to 3 per row."""
    root = tmp_path_factory.mktemp("packed_data")
    write_synthetic_shards(root / "hdf5", vocab_size=64, seq_length=32, max_predictions=5, n_training_shards=2,
                           n_test_shards=1, sequences_per_shard=256, seed=0, short_seq_prob=0.7,
                           max_sequences_per_pack=3)
    return root


@pytest.mark.parametrize("layout", ["unpacked", "packed"])
def test_a_run_checkpointed_on_2_ranks_continues_on_1_then_4_like_an_uninterrupted_run(request, layout, tmp_path):
    data = request.getfixturevalue("packed_data" if layout == "packed" else "data")
    config_path = bert_config(tmp_path / "config.json", dropout=0.0)  # dropout masks depend on the rank layout
    common = dict(total_steps=8, global_batch_size=16, checkpoint_every=100, log_every=1, eval_max_sequences=32,
                  bert_config=config_path)
    straight = settings(data, tmp_path / "straight", micro_batch_size=4, **common)
    pretrain(straight)

    elastic = tmp_path / "elastic"
    torch.multiprocessing.spawn(_rank_worker, nprocs=2, args=(2, _free_port(), settings(
        data, elastic, micro_batch_size=4, max_steps=3, **common)))
    pretrain(settings(data, elastic, micro_batch_size=8, max_steps=6, **common))  # 1 rank, another micro-batch
    torch.multiprocessing.spawn(_rank_worker, nprocs=4, args=(4, _free_port(), settings(
        data, elastic, micro_batch_size=4, **common)))

    state, _ = ckpt.load_latest_checkpoint(elastic / "run" / "checkpoints")
    assert (state["step"], state["consumed"], len(state["rng"])) == (8, 8 * 16, 4)
    _, expected = load_pretrained(straight.out_model)
    _, got = load_pretrained(elastic / "model")
    for name in expected:  # equal up to fp32 reduction order (gloo sums, other micro-batch splits)
        assert torch.allclose(got[name], expected[name], atol=1e-5, rtol=1e-4), name
    # Same sequences, same losses, step by step; the runs' steps 1-3, 4-6 and 7-8 came from 2, 1 and 4 ranks.
    # (Equal to within fp32 summation order over other splits: a comparison of rounded values fails at their edges.)
    losses = [(m["step"], m["loss"]) for m in read_metrics(elastic / "metrics.jsonl")]
    assert losses == [(m["step"], pytest.approx(m["loss"], abs=1e-5)) for m in read_metrics(straight.out_metrics)]
    assert [m["step"] for m in read_metrics(elastic / "metrics.jsonl")] == list(range(1, 9))
    summary = json.loads((elastic / "summary.json").read_text())
    real = sum(m["real_tokens"] for m in read_metrics(elastic / "metrics.jsonl"))
    assert summary["packed"] == (layout == "packed") and summary["real_tokens_per_s"] > 0
    assert real == sum(m["real_tokens"] for m in read_metrics(straight.out_metrics))  # the same tokens, once each


def test_a_change_of_the_math_refuses_to_resume_and_deletes_nothing(data, tmp_path, capsys):
    s = settings(data, tmp_path / "out", total_steps=20, max_steps=2, checkpoint_every=1, eval_max_sequences=16)
    pretrain(s)
    before = sorted(p.name for p in (Path(s.run_dir) / "checkpoints").iterdir())
    changed = replace(s, learning_rate=2e-2, seed=8, max_steps=4, micro_batch_size=8)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run(main, command(changed)[3:])
    assert exit_info.value.code == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert error == [f"error: {s.run_dir}: its checkpoints belong to a run with other settings "
                     "(pretrain.phase1.learning_rate 0.03 -> 0.02; seed 7 -> 8); "
                     f"to start over, move or delete {s.run_dir} (nothing was deleted)"]
    assert sorted(p.name for p in (Path(s.run_dir) / "checkpoints").iterdir()) == before
    # A change that keeps the math (micro-batch size, max_steps, cadence) resumes.
    pretrain(replace(s, max_steps=4, micro_batch_size=8, log_every=2))
    assert [m["step"] for m in read_metrics(s.out_metrics)] == [2, 4]  # log_every 10 before, 2 now


def test_bf16_and_fp16_autocast_on_cpu_train_with_losses_close_to_fp32(data, tmp_path, monkeypatch):
    import workflow.train.pretrain as pretrain_module

    runs = {}
    for precision in ("fp32", "bf16", "fp16"):
        # fp16 is refused off CUDA (no speed-up there): pretend the device allows it; the rest runs for real.
        monkeypatch.setattr(pretrain_module, "resolve_precision", lambda chosen, device, key: chosen)
        s = settings(data, tmp_path / precision, total_steps=20, log_every=5, precision=precision,
                     eval_max_sequences=16)
        summary = pretrain(s)
        state, _ = ckpt.load_latest_checkpoint(Path(s.run_dir) / "checkpoints")
        runs[precision] = [m["loss"] for m in read_metrics(s.out_metrics)]
        assert summary["precision"] == precision and np.isfinite(runs[precision]).all()
        assert bool(state["scaler"]) == (precision == "fp16")  # fp16's GradScaler state is checkpointed
    fp32 = runs["fp32"]
    for precision in ("bf16", "fp16"):
        assert abs(runs[precision][0] - fp32[0]) < 0.01 * fp32[0]  # same weights and data: only rounding differs
        assert all(abs(b - f) < 0.05 * f for b, f in zip(runs[precision], fp32)), (precision, runs[precision], fp32)


# ---------------------------------------------------------------- launching: torchrun, srun, the rules


def test_rank_and_world_come_from_torchrun_or_from_a_slurm_step_only():
    from workflow.slurm.launch import local_command
    from workflow.train.distributed import read_environment

    assert read_environment({}) == (0, 1, 0)
    assert read_environment({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == (3, 4, 1)
    step = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_LOCALID": "1", "SLURM_JOB_ID": "77", "MASTER_ADDR": "node1"}
    assert read_environment(step) == (1, 2, 1) and step["MASTER_PORT"] == "15077"
    # A batch script carries SLURM_PROCID=0 and SLURM_NTASKS=2 but is one process: it must launch, not join.
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}
    assert read_environment(batch) == (0, 1, 0)
    # (the srun line of a batch step: tests/test_slurm.py, test_launcher_gives_every_rank_its_own_gpu_...)
    assert local_command(["python", "x.py"], {"SNAKEBERT_LOCAL_RANKS": "1"}) == ["python", "x.py"]
    assert local_command(["python", "x.py"], {"SNAKEBERT_LOCAL_RANKS": "2"})[-4:] == ["--nproc-per-node=2", "--no-python",
                                                                                   "python", "x.py"]


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
                             "--wrap", f"{sys.executable} -m workflow.slurm.launch -- {sys.executable} -c \"{script}\""],
                            cwd=REPO, env=environment(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr + (tmp_path / "out").read_text(errors="replace")
    lines = sorted(line for line in (tmp_path / "out").read_text().splitlines() if len(line.split()) == 3)
    assert lines == ["0 2 3", "1 2 3"]


def test_snakemake_runs_phase1_then_phase2_from_phase1s_export_and_reruns_only_for_the_math(data, tmp_path):
    import shutil

    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    for name in ("Snakefile", "rules", "workflow", "envs", "config.yaml", "config.schema.yaml"):
        (work / name).symlink_to(REPO / name)
    write_synthetic_shards(work / "data" / "hdf5_seq32", seq_length=32, max_predictions=5, sequences_per_shard=64)
    write_synthetic_shards(work / "data" / "hdf5_seq64", seq_length=64, max_predictions=8, sequences_per_shard=32)
    shutil.copyfile(work / "data" / "hdf5_seq32" / "vocab.txt", work / "data" / "vocab.txt")
    bert_config(work / "bert_config.json")
    test_config = ("encode: {phase1: {max_seq_length: 32, max_predictions_per_seq: 5},"
                   " phase2: {max_seq_length: 64, max_predictions_per_seq: 8}}\n"
                   "model: {preset: tiny, bert_config: bert_config.json}\n"
                   "pretrain: {checkpoint_every: 2, log_every: 1, precision: auto, eval_max_sequences: 16,\n"
                   "  phase1: {learning_rate: 0.01, warmup_proportion: 0.1, total_steps: 4, global_batch_size: 16,"
                   " micro_batch_size: 8},\n"
                   "  phase2: {learning_rate: 0.01, warmup_proportion: 0.1, total_steps: 6, max_steps: 3,"
                   " global_batch_size: 8, micro_batch_size: 4}}\n")
    (work / "test.yaml").write_text(test_config)
    env = environment(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")

    def snakemake(*extra, configfile="test.yaml"):
        return subprocess.run(["snakemake", "--cores", "2", "--configfile", configfile, "--allowed-rules", "pretrain_phase",
                               *extra, "--", "results/pretrain/phase2/model"], cwd=work, env=env,
                              capture_output=True, text=True, timeout=300)

    result = snakemake()
    assert result.returncode == 0, result.stderr[-3000:]
    first = json.loads((work / "results/pretrain/phase1/summary.json").read_text())
    second = json.loads((work / "results/pretrain/phase2/summary.json").read_text())
    assert (first["steps"], first["seq_length"], first["accumulation_steps"]) == (4, 32, 2)
    assert (second["steps"], second["seq_length"], second["total_steps"]) == (3, 64, 6)
    assert second["test_sequences"] == 16
    assert [m["step"] for m in read_metrics(work / "results/pretrain/phase2/metrics.jsonl")] == [1, 2, 3]
    log = (work / "logs/pretrain/phase2/pretrain.log").read_text()
    assert "initialised from results/pretrain/phase1/model" in log
    assert "missing" not in log  # phase 1's export matched the model exactly: nothing missing, nothing extra
    assert "LAMB moments carried over from results/pretrain/phase1/optimizer_state.pt" in log
    assert (work / "runs/pretrain/phase1/checkpoints/step_00000004.pt").exists()
    # Phase 2 carries phase 1's moments but counts its own steps (schedule and bias correction restart).
    state, _ = ckpt.load_latest_checkpoint(work / "runs/pretrain/phase2/checkpoints")
    assert state["step"] == 3 and state["scheduler"]["last_epoch"] == 3
    assert all(group["step"] == 3 for group in state["optimizer"]["param_groups"])

    # Cadence and micro-batch edits change no output: nothing to do. A phase-1 learning rate reruns both phases.
    (work / "cadence.yaml").write_text(test_config.replace("checkpoint_every: 2, log_every: 1",
                                                           "checkpoint_every: 3, log_every: 2, keep_checkpoints: 5")
                                       .replace("micro_batch_size: 8}", "micro_batch_size: 4}"))
    planned = snakemake("--dry-run", configfile="cadence.yaml")
    assert planned.returncode == 0 and "Nothing to be done" in planned.stdout + planned.stderr, planned.stdout
    (work / "lr.yaml").write_text(test_config.replace("phase1: {learning_rate: 0.01", "phase1: {learning_rate: 0.02"))
    planned = snakemake("--dry-run", configfile="lr.yaml")
    assert re.search(r"^pretrain_phase\s+2$", planned.stdout, re.MULTILINE), planned.stdout


def write_manifest(directory, masked_lm_prob):
    """manifest.json as workflow.data.hdf5_dir writes it, for the training shards of `directory`."""
    from workflow.data.hdf5_dir import sha256

    shards = [{"path": f"training/{Path(x.path).name}", "n_instances": x.n, "n_rows": x.rows, "sha256": sha256(
        Path(x.path))} for x in list_shards(directory, "training")]
    (Path(directory) / "manifest.json").write_text(json.dumps(
        {"format": "unpacked", "settings": {"masked_lm_prob": masked_lm_prob}, "shards": shards}))


@pytest.mark.parametrize("change", ["shards regenerated", "manifest settings", "vocab", "optimizer", "data order"])
def test_a_resume_on_other_data_or_optimizer_refuses_with_one_error_line(tmp_path, capsys, monkeypatch, change):
    shards = tmp_path / "data"
    write_synthetic_shards(shards / "hdf5", n_training_shards=2, sequences_per_shard=32, seed=1)
    if change == "manifest settings":
        write_manifest(shards / "hdf5", 0.15)
    s = settings(shards, tmp_path / "out", total_steps=20, max_steps=1, checkpoint_every=1, eval_max_sequences=8)
    pretrain(s)
    before = sorted(p.name for p in (Path(s.run_dir) / "checkpoints").iterdir())
    if change == "vocab":  # same size, other tokens
        vocab = Path(s.vocab)
        vocab.write_text(vocab.read_text().replace("w1\n", "w1000\n"))
        expected = r"vocab [0-9a-f]{16} -> [0-9a-f]{16}"
    elif change == "optimizer":  # as when apex is installed between two runs
        import workflow.train.pretrain as pretrain_module

        make = pretrain_module.make_optimizer
        monkeypatch.setattr(pretrain_module, "make_optimizer", lambda *a, **k: (make(*a, **k)[0], "apex.FusedLAMB"))
        expected = r"optimizer torch\.Lamb -> apex\.FusedLAMB"
    elif change == "data order":  # a new version's order: the same data would come in another order
        import workflow.train.pretrain as pretrain_module

        expected = rf"data order {re.escape(pretrain_module.ORDER)} -> another order"
        monkeypatch.setattr(pretrain_module, "ORDER", "another order")
    else:  # the same counts, other masking: other content
        write_synthetic_shards(shards / "hdf5", n_training_shards=2, sequences_per_shard=32, seed=2)
        expected = (r"training data 2 shards, 64 sequences, sha256 (\w{16}) -> "
                    r"2 shards, 64 sequences, sha256 (?!\1)\w{16}")
        if change == "manifest settings":
            write_manifest(shards / "hdf5", 0.2)
            expected += r"; training data settings\.masked_lm_prob 0\.15 -> 0\.2"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run(main, command(replace(s, max_steps=2))[3:])
    assert exit_info.value.code == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and re.fullmatch(
        rf"error: {re.escape(s.run_dir)}: its checkpoints belong to a run with other settings \({expected}\); to start "
        rf"over, move or delete {re.escape(s.run_dir)} \(nothing was deleted\)", error[0]), error
    assert sorted(p.name for p in (Path(s.run_dir) / "checkpoints").iterdir()) == before


def test_a_phase_runs_outside_snakemake_from_the_config_file_validated_as_the_workflow_does(data, tmp_path, capsys):
    s = settings(data, tmp_path / "out", total_steps=2, checkpoint_every=2, eval_max_sequences=16)
    config = {"seed": s.seed, "model": {"preset": "tiny", "bert_config": s.model.bert_config},
              "vocab": {"lowercase": False},
              "pretrain": {"loader_workers": 0, "phase1": config_of(s)["pretrain"]["phase1"]}}
    configfile = tmp_path / "config.yaml"
    configfile.write_text(json.dumps(config))  # YAML is a superset of JSON
    arguments = [arg for arg in command(s)[3:] if arg != "--config"]
    arguments.remove(json.dumps(config_of(s)))
    run(main, [*arguments, "--configfile", str(configfile)])
    summary = json.loads(Path(s.out_summary).read_text())
    assert summary["steps"] == 2 and summary["global_batch_size"] == s.phase.global_batch_size
    assert json.loads((Path(s.out_model) / "tokenizer_config.json").read_text())["do_lower_case"] is False
    # The schema's defaults filled in (pretrain.lamb, precision), and a bad key named as Snakemake names it.
    assert summary["precision"] == "fp32" and summary["optimizer"] == "torch.Lamb"
    configfile.write_text(json.dumps({**config, "pretrain": {**config["pretrain"], "warmup": 3}}))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run(main, [*arguments, "--configfile", str(configfile)])
    assert exit_info.value.code == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: config: unknown key 'pretrain.warmup' (every key is listed in config.schema.yaml)"]


def test_phase2_starts_from_an_adamw_phase1_and_a_switch_of_optimizer_refuses_to_resume(data, tmp_path):
    config = config_of(settings(data, tmp_path / "p1"))
    config["pretrain"].update(optimizer="adamw", adamw={"weight_decay": 0.02, "beta1": 0.9, "beta2": 0.98,
                                                        "eps": 1e-8, "max_grad_norm": 0.5, "fused": True})
    s = TrainSettings.from_config(config, "phase1", **{k: getattr(settings(data, tmp_path / "p1"), k) for k in (
        "data_dir", "vocab", "run_dir", "out_model", "out_metrics", "out_summary")})
    o = s.pretrain.optimizer
    assert (o.name, o.weight_decay, o.beta2, o.eps, o.max_grad_norm) == ("adamw", 0.02, 0.98, 1e-8, 0.5)
    s = replace(s, bert_config=settings(data, tmp_path / "p1").model.bert_config, device="cpu", threads=1,
                total_steps=20, max_steps=2, checkpoint_every=1, eval_max_sequences=16,
                out_optimizer=str(tmp_path / "p1" / "optimizer_state.pt"))
    assert pretrain(s)["optimizer"] == "torch.AdamW"
    phase2 = settings(data, tmp_path / "p2", phase="phase2", init_from=s.out_model, init_optimizer=s.out_optimizer,
                      bert_config=None, total_steps=4, max_steps=2, eval_max_sequences=16)
    summary = pretrain(phase2)
    assert summary["optimizer"] == "torch.Lamb" and summary["steps"] == 2
    with pytest.raises(UserError, match=r"its checkpoints belong to a run with other settings \(optimizer "
                                        r"torch\.AdamW -> torch\.Lamb\)"):
        lamb = settings(data, tmp_path / "p1").pretrain.optimizer
        pretrain(replace(dataclasses.replace(s, pretrain=dataclasses.replace(s.pretrain, optimizer=lamb)), max_steps=4))


def test_a_key_set_for_the_optimizer_not_chosen_is_one_error_naming_it(data, tmp_path, capsys):
    config = validate_config({"pretrain": {"optimizer": "adamw", "lamb": {"weight_decay": 0.02}}})
    paths = {k: getattr(settings(data, tmp_path), k) for k in ("data_dir", "vocab", "run_dir", "out_model",
                                                                  "out_metrics", "out_summary")}
    with pytest.raises(UserError, match=r"^config pretrain\.lamb\.weight_decay: 0\.02 is set, but pretrain\.optimizer "
                                        r"is adamw, which reads pretrain\.adamw; set pretrain\.adamw\.weight_decay "
                                        r"instead, or pretrain\.optimizer: lamb$"):
        TrainSettings.from_config(config, "phase1", **paths)
    config["pretrain"]["lamb"]["weight_decay"] = 0.01  # the default: nothing set that AdamW would ignore
    assert TrainSettings.from_config(config, "phase1", **paths).pretrain.optimizer.name == "adamw"
