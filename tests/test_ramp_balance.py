"""Every rank runs the same number of micro-batches in a step, ramped steps included: a rank with fewer rows ends
with all-padding micro-batches (no label, no live sequence), and the step's sequences, their order and its loss
normalisers are those of the step read as one batch (workflow.train.pretraining_data.micro_batches)."""
import pytest
import torch

from workflow.data.synthetic_shards import write_synthetic_shards
from workflow.train.optim.schedules import BatchRamp
from workflow.train.pretraining_data import PretrainingSequences, list_shards

ROWS = 2  # rows per micro-batch: small, so that ranks' parts differ in micro-batches without balancing


@pytest.fixture(scope="module", params=[False, True], ids=["unpacked", "packed"])
def sequences(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp("data")
    write_synthetic_shards(directory, n_training_shards=2, sequences_per_shard=60, seed=5, short_seq_prob=0.7,
                           max_sequences_per_pack=3 if request.param else None)
    order = PretrainingSequences(list_shards(directory, "training"), seed=2, chunk_rows=8)
    yield order
    order.close()


def live_instances(batches: list[dict]) -> list[int]:
    """The sequences the micro-batches train on, in order (packed: their instance index; unpacked rows carry none:
    each live row's masked labels identify it)."""
    if "instance_index" in batches[0]:
        return [i for b in batches for i in b["instance_index"].flatten().tolist() if i >= 0]
    return [tuple(row) for b in batches for row, live in zip(b["masked_lm_labels"].tolist(),
                                                              (b["next_sentence_labels"] >= 0).tolist()) if live]


@pytest.mark.parametrize("world", range(1, 9))
def test_every_rank_runs_the_same_number_of_micro_batches_in_each_ramped_step(sequences, world):
    ramp = BatchRamp(global_batch_size=40, start_size=5, sequences=120)
    unbalanced = False
    for step in range(ramp.ramp_steps + 1):
        start, count = ramp.sequences_before(step), ramp.batch_at(step)
        split = [sequences.micro_batches(start, count, rank, world, ROWS) for rank in range(world)]
        assert len({len(mine) for mine in split}) == 1, (step, [len(mine) for mine in split])
        # The same sequences in the same order as the step read whole, with the same loss normalisers.
        whole = sequences.read(start, count)
        assert live_instances([b for mine in split for b in mine]) == live_instances([whole])
        assert sum(int((b["masked_lm_labels"] >= 0).sum()) for mine in split for b in mine) == int(
            (whole["masked_lm_labels"] >= 0).sum())
        # The filled-up micro-batches: all padding (no label, no live sequence).
        for mine in split:
            rows_with_labels = [bool((b["masked_lm_labels"] >= 0).any()) for b in mine]
            unbalanced |= not all(rows_with_labels)
            assert rows_with_labels == sorted(rows_with_labels, reverse=True)  # padding ones last
    if world > 1:
        assert unbalanced  # some rank had fewer rows: the case balanced
