"""The fixed held-out evaluation set, the accuracy curve every eval_every steps (resumed like the rest), and the
report's time to target."""
import json

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

from workflow.data.synthetic_shards import write_synthetic_shards
from tests.test_pretrain import _free_port, _rank_worker, bert_config, read_metrics, settings
from workflow.report import report, summary
from workflow.report.target import accuracy_curve, time_to_target
from workflow.train.evaluation import EvaluationSet
from workflow.train.pretrain import pretrain
from workflow.train.pretraining_data import list_shards

EVAL_KEYS = ("test_mlm_accuracy", "test_nsp_accuracy", "test_mlm_loss", "test_nsp_loss", "test_sequences",
             "test_predictions")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Test shards, unpacked and packed (3 shards of 40 sequences each, many packed rows holding several)."""
    root = tmp_path_factory.mktemp("eval_shards")
    for name, pack in (("unpacked", None), ("packed", 3)):
        write_synthetic_shards(root / name, n_test_shards=3, sequences_per_shard=40, seed=3, short_seq_prob=0.7,
                               max_sequences_per_pack=pack)
    return {name: list_shards(root / name, "test") for name in ("unpacked", "packed")}


def _live_sequences(evaluation_set, rank, world):
    """The (shard, row, slot) of every sequence a rank scores, from the batches it is given."""
    found = []
    for index, rows, live in evaluation_set.locate(
            np.array_split(evaluation_set.sequences, [len(evaluation_set.sequences) * r // world
                                                      for r in range(1, world)])[rank]):
        slots = live if live.ndim == 2 else live[:, None]
        found += [(index, int(rows[r]), int(s)) for r, s in zip(*np.nonzero(slots))]
    return found


@pytest.mark.parametrize("layout", ["unpacked", "packed"])
def test_the_evaluation_set_is_one_seeded_choice_whatever_the_world_size(shards, layout):
    chosen = EvaluationSet(shards[layout], 50, seed=4)
    assert np.array_equal(chosen.sequences, EvaluationSet(shards[layout], 50, seed=4).sequences)  # a rerun
    assert chosen.identity == EvaluationSet(shards[layout], 50, seed=4).identity
    other = EvaluationSet(shards[layout], 50, seed=5)
    assert not np.array_equal(chosen.sequences, other.sequences) and other.identity != chosen.identity
    assert len(chosen.sequences) == len(np.unique(chosen.sequences)) == 50
    assert chosen.sequences.min() >= 0 and chosen.sequences.max() < 120
    assert len(np.unique(chosen.sequences // 40)) == 3  # drawn over all shards, not the first ones in file order
    assert np.array_equal(EvaluationSet(shards[layout], None, seed=4).sequences, np.arange(120))
    assert np.array_equal(EvaluationSet(shards[layout], 500, seed=4).sequences, np.arange(120))

    # Two ranks score between them exactly the sequences one rank scores, each once.
    one = _live_sequences(chosen, 0, 1)
    two = _live_sequences(chosen, 0, 2) + _live_sequences(chosen, 1, 2)
    assert len(one) == 50 and sorted(two) == sorted(one)
    batches = [b for rank in (0, 1) for b in chosen.batches(rank, 2, 7)]
    whole = list(chosen.batches(0, 1, 7))
    labels = [b["masked_lm_labels"] for b in batches]
    assert sum(int((b["next_sentence_labels"] >= 0).sum()) for b in batches) == 50
    assert sorted(torch.cat([x[x >= 0] for x in labels]).tolist()) == sorted(
        torch.cat([b["masked_lm_labels"][b["masked_lm_labels"] >= 0] for b in whole]).tolist())


def test_an_unpacked_evaluation_set_reads_the_chosen_rows_of_the_files(shards):
    chosen = EvaluationSet(shards["unpacked"], 10, seed=1)
    import h5py

    expected = []
    for sequence in chosen.sequences:
        with h5py.File(shards["unpacked"][sequence // 40].path) as handle:
            expected.append(handle["input_ids"][sequence % 40])
    got = torch.cat([b["input_ids"] for b in chosen.batches(0, 1, 4)])
    assert np.array_equal(got.numpy(), np.stack(expected))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("curve_data")
    write_synthetic_shards(root / "hdf5", n_training_shards=2, n_test_shards=2, sequences_per_shard=64, seed=0)
    return root


def _curve(path):
    return [(m["step"], *(m[k] for k in EVAL_KEYS)) for m in read_metrics(path) if "test_mlm_accuracy" in m]


def test_a_resumed_run_has_the_uninterrupted_runs_accuracy_curve(data, tmp_path):
    common = dict(total_steps=8, global_batch_size=16, micro_batch_size=8, log_every=3, checkpoint_every=100,
                  eval_every=2, eval_max_sequences=40, eval_seed=9, bert_config=bert_config(tmp_path / "c.json"))
    straight = pretrain(settings(data, tmp_path / "straight", **common))
    pretrain(settings(data, tmp_path / "resumed", max_steps=3, **common))  # stops after step 3's checkpoint
    resumed = pretrain(settings(data, tmp_path / "resumed", **common))

    curve = _curve(tmp_path / "straight" / "metrics.jsonl")
    assert [point[0] for point in curve] == [2, 4, 6, 8]
    assert _curve(tmp_path / "resumed" / "metrics.jsonl") == curve  # bitwise: same steps, same accuracies
    assert [m["step"] for m in read_metrics(tmp_path / "resumed" / "metrics.jsonl")] == [2, 3, 4, 6, 8]
    assert all(point[5] == 40 for point in curve)  # test_sequences: the whole set each time
    # The final evaluation is the curve's last point (the loop's own, not a second one).
    assert tuple(resumed[k] for k in EVAL_KEYS) == tuple(straight[k] for k in EVAL_KEYS) == curve[-1][1:]
    assert resumed["test_set"] == straight["test_set"] == "40 of 128 sequences of 2 test shards, seed 9, " + \
        straight["test_set"].rsplit(", ", 1)[1]
    # Training time at each evaluation: cumulative over both attempts (the checkpoint carries it), rising.
    times = [m["train_time_s"] for m in read_metrics(tmp_path / "resumed" / "metrics.jsonl") if "train_time_s" in m]
    assert times == sorted(times) and 0 < times[-1] <= resumed["train_time_s"]


def test_a_run_on_two_ranks_resumed_on_one_has_the_one_rank_runs_curve(data, tmp_path):
    common = dict(total_steps=6, global_batch_size=16, log_every=1, checkpoint_every=100, eval_every=2,
                  eval_max_sequences=40, bert_config=bert_config(tmp_path / "c.json", dropout=0.0))
    pretrain(settings(data, tmp_path / "straight", micro_batch_size=8, **common))
    torch.multiprocessing.spawn(_rank_worker, nprocs=2, args=(2, _free_port(), settings(
        data, tmp_path / "elastic", micro_batch_size=4, max_steps=3, **common)))
    pretrain(settings(data, tmp_path / "elastic", micro_batch_size=8, **common))
    expected, got = _curve(tmp_path / "straight" / "metrics.jsonl"), _curve(tmp_path / "elastic" / "metrics.jsonl")
    assert [point[0] for point in got] == [point[0] for point in expected] == [2, 4, 6]
    for mine, theirs in zip(got, expected):  # step 2 scored on 2 ranks; the counts are exact, losses to fp32 order
        assert mine == pytest.approx(theirs, abs=1e-5)


def _phase(directory, evaluations, train_time, steps, final=None):
    """A pretraining result directory with metrics lines every 10 steps, held-out results at `evaluations`."""
    directory.mkdir(parents=True)
    lines = []
    for step in range(10, steps + 1, 10):
        line = {"step": step, "loss": 1.0, "mlm_accuracy": 0.5, "seq_per_s": 100.0}
        if step in evaluations:
            line.update(test_mlm_accuracy=evaluations[step][0], train_time_s=evaluations[step][1])
        lines.append(json.dumps(line) + "\n")
    (directory / "metrics.jsonl").write_text("".join(lines))
    (directory / "summary.json").write_text(json.dumps({"steps": steps, "train_time_s": train_time,
                                                        "test_mlm_accuracy": final, "global_batch_size": 32}))
    return directory


@pytest.fixture
def curve_run(tmp_path):
    # Phase 1 tops out at 0.70 (its final evaluation at step 50, not an eval_every step); phase 2 crosses 0.72 between
    # its evaluations at steps 20 (0.715) and 40 (0.73), 200 s of phase 1 and 64 s of phase 2 in.
    phase1 = _phase(tmp_path / "phase1", {20: (0.4, 80.0), 40: (0.65, 160.0)}, 200.0, 50, final=0.70)
    phase2 = _phase(tmp_path / "phase2", {20: (0.715, 30.0), 40: (0.73, 64.0)}, 70.0, 40, final=0.73)
    return [("phase1", phase1), ("phase2", phase2)]


def test_the_time_to_target_is_the_first_evaluation_at_or_above_it(curve_run):
    phases = [(p, summary.read_jsonl(d / "metrics.jsonl"), summary.read_json(d / "summary.json")) for p, d in curve_run]
    curve = accuracy_curve(phases)
    assert [(p["phase"], p["step"], p["run_time_s"], p["test_mlm_accuracy"]) for p in curve] == [
        ("phase1", 20, 80.0, 0.4), ("phase1", 40, 160.0, 0.65), ("phase1", 50, 200.0, 0.70),
        ("phase2", 20, 230.0, 0.715), ("phase2", 40, 264.0, 0.73)]
    assert time_to_target(curve, 0.72)["run_time_s"] == 264.0
    assert time_to_target(curve, 0.65)["run_time_s"] == 160.0  # "at or above"
    assert time_to_target(curve, 0.75) is None


def test_the_report_plots_the_curve_and_the_summary_gives_the_time_to_target(curve_run, tmp_path, capsys):
    figure = report.heldout_figure(curve_run, 0.72)
    by_step, by_time = figure.axes
    assert [line.get_xydata().tolist() for line in by_step.get_lines()] == [
        [[20, 0.4], [40, 0.65], [50, 0.70]], [[20, 0.715], [40, 0.73]], [[0, 0.72], [1, 0.72]]]
    assert [line.get_xydata().tolist() for line in by_time.get_lines()][:2] == [
        [[80, 0.4], [160, 0.65], [200, 0.70]], [[230, 0.715], [264, 0.73]]]
    assert figure._suptitle.get_text() == ("held-out MLM accuracy 0.720 reached after 264.0 s of training "
                                           "(phase2 step 40: 0.7300)")
    assert report.heldout_figure(curve_run, 0.8)._suptitle.get_text() == \
        "held-out MLM accuracy 0.800 not reached (best 0.7300)"
    plt.close("all")

    rows = summary.summarize(dict(curve_run), None, target=0.72)
    table = {(stage, metric): value for stage, metric, value in rows}
    assert (table[("pretrain", "time_to_target_s")], table[("pretrain", "time_to_target_step")]) == (264.0,
                                                                                                     "phase2:40")
    output = tmp_path / "summary.csv"
    output.write_text(summary.to_csv(rows))
    assert "Time to held-out MLM accuracy 0.72: 264.0 s of training (phase2:40)" in summary.render(
        summary.read_summary(output)).splitlines()
    missed = {(s, m): v for s, m, v in summary.summarize(dict(curve_run), None, target=0.9)}
    assert missed[("pretrain", "time_to_target_s")] == "not reached"


def test_a_phase_trained_before_times_were_recorded_gives_its_step_and_no_time(tmp_path):
    old = tmp_path / "phase1"
    old.mkdir()
    (old / "metrics.jsonl").write_text(json.dumps({"step": 10, "loss": 1.0}) + "\n")
    (old / "summary.json").write_text(json.dumps({"steps": 10, "test_mlm_accuracy": 0.75, "global_batch_size": 32}))
    phase2 = _phase(tmp_path / "phase2", {20: (0.76, 30.0)}, 40.0, 20, final=0.76)
    curve = accuracy_curve([(p, summary.read_jsonl(d / "metrics.jsonl"), summary.read_json(d / "summary.json"))
                            for p, d in [("phase1", old), ("phase2", phase2)]])
    assert [(p["phase"], p["step"], p["run_time_s"]) for p in curve] == [("phase1", 10, None), ("phase2", 20, None)]
    rows = {(s, m): v for s, m, v in summary.summarize({"phase1": old, "phase2": phase2}, None, target=0.72)}
    assert (rows[("pretrain", "time_to_target_s")], rows[("pretrain", "time_to_target_step")]) == ("not recorded",
                                                                                                    "phase1:10")
    output = tmp_path / "summary.csv"
    output.write_text(summary.to_csv(list((s, m, v) for (s, m), v in rows.items())))
    assert "Time to held-out MLM accuracy 0.72: at a time not recorded (phase1:10)" in summary.render(
        summary.read_summary(output)).splitlines()
    assert report.heldout_figure([("phase1", old), ("phase2", phase2)], 0.72)._suptitle.get_text() == (
        "held-out MLM accuracy 0.720 reached after an unrecorded time of training (phase1 step 10: 0.7500)")
    plt.close("all")
