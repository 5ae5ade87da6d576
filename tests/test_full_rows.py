"""Full rows on any corpus: with `max_sequences_per_pack: auto` a packed row holds as many instances as fit, so rows
of short documents (~12 tokens at 1,024, ~95 at 8,192, as Wikipedia's leads) are >= 95% full, where a fixed cap of
16 leaves rows of 8,192 a fifth full; the slot count is the row length's, one shape whatever the data."""
import numpy as np
import pytest
import torch

from tests.test_encode import read_all
from workflow.cli import UserError
from workflow.data.encode import EncodeSettings, encode_shard
from workflow.data.masking_rule import derived_max_predictions
from workflow.data.pack import AUTO, PackSettings, sequence_slots
from workflow.data.synthetic_shards import made_up_vocab
from workflow.train.masking import LoadTimeMasker
from workflow.train.models.family import family
from workflow.train.pretraining_data import make_batch


def assert_tight(offsets, capacity: int) -> bool:
    """kit.unpad's offsets: the runs (sequences and padding runs, none empty), then empty sequences up to the next
    power of two of their count (at most `capacity`): the flash kernels' grid and dQ buffer follow that count."""
    sizes = torch.diff(offsets)
    runs = int((sizes > 0).sum())
    assert bool((sizes[:runs] > 0).all()) and not bool(sizes[runs:].any())
    assert len(sizes) == min(capacity, 1 << (runs - 1).bit_length())
    return True


def short_documents(directory, n_documents: int, mean_tokens: int, seed: int = 0):
    """(vocab.txt, tokenized shard) of `n_documents` one-sentence documents of ~`mean_tokens` tokens (log-normal,
    as text lengths are), in made-up words."""
    vocab = made_up_vocab(300)
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, np.rint(rng.lognormal(np.log(mean_tokens) - 0.125, 0.5, n_documents))).astype(np.int64)
    ids = rng.integers(len(vocab) - 200, len(vocab), int(lengths.sum())).astype(np.uint16)  # no special token
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    np.savez(directory / "shard.npz", ids=ids, sentence_offsets=offsets, document_offsets=np.arange(n_documents + 1))
    return directory / "vocab.txt", directory / "shard.npz"


def recipe_settings(length: int) -> EncodeSettings:
    """ModernBERT's recipe (recipes/modernbert-base.yaml): documents, masks drawn by the loader at 30% per token."""
    return EncodeSettings(max_seq_length=length, masked_lm_prob=0.3, masking="dynamic", objective="documents",
                          masking_rule="per_token", dupe_factor=1,
                          max_predictions_per_seq=derived_max_predictions(length, "per_token", (0.3, 0.15)))


@pytest.mark.parametrize("length, mean_tokens", [(1024, 10), (8192, 93)])  # + [CLS] and [SEP]: 12 and 95
def test_rows_of_short_documents_are_at_least_95_percent_full_with_auto_slots(tmp_path, length, mean_tokens):
    vocab, tokenized = short_documents(tmp_path, 3000, mean_tokens)
    fill = {}
    for cap in (16, AUTO):
        encode_shard(tokenized, vocab, tmp_path / f"{cap}.hdf5", recipe_settings(length), 5, "training", 0, "none",
                     PackSettings(cap))
        packed, attributes = read_all(tmp_path / f"{cap}.hdf5")
        fill[cap] = attributes["fill"]
        assert attributes["n_instances"] == 3000
        assert packed["input_mask"].astype(bool).sum() == attributes["n_real_tokens"]
    slots = length // 3
    assert attributes["max_sequences_per_pack"] == slots and packed["cls_positions"].shape[1] == slots
    assert packed["input_mask"].dtype == np.int16  # slot numbers past 127
    assert fill[AUTO] >= 0.95, fill
    assert fill[16] < 0.95 if length == 8192 else True, fill  # what a fixed cap leaves there


def test_the_slot_count_is_the_row_lengths_and_a_bad_one_is_a_one_line_error_naming_the_key():
    assert [sequence_slots(AUTO, length) for length in (128, 512, 1024, 8192)] == [42, 170, 341, 2730]
    assert sequence_slots(3, 8192) == sequence_slots("3", 8192) == 3
    for bad in (0, -1, "all", 2.5, None):
        with pytest.raises(UserError, match=rf"^encode packing.max_sequences_per_pack {bad}: must be at least 1, or "
                                            rf"auto$"):
            sequence_slots(bad, 128)


def test_the_loader_masks_and_unpads_rows_of_thousands_of_slots_sequence_by_sequence(tmp_path):
    """Rows of 8,192 with 2,730 slots (int16 sequence numbers): the load-time masker draws 30% of their text, and the
    varlen offsets of a batch are the packed sequences, in order."""
    vocab, tokenized = short_documents(tmp_path, 3000, 30)
    encode_shard(tokenized, vocab, tmp_path / "p.hdf5", recipe_settings(8192), 5, "training", 0, "none",
                 PackSettings(AUTO))
    packed, _ = read_all(tmp_path / "p.hdf5")
    assert (packed["sequence_lengths"] > 0).sum(axis=1).max() > 127  # sequence numbers past int8
    masked = LoadTimeMasker.of_shard(str(tmp_path / "p.hdf5"), 7)(packed, 0, 0, np.arange(len(packed["input_ids"])))
    text = int(packed["input_mask"].astype(bool).sum()) - 2 * int((packed["sequence_lengths"] > 0).sum())
    predicted = int((masked["masked_lm_positions"] > 0).sum())
    assert abs(predicted / text - 0.3) < 4 * np.sqrt(0.3 * 0.7 / text)
    batch = family("modernbert").host_indices(make_batch(masked, slice(None)))
    # The layout (kit.unpad): each row's sequences in order, then its padding run, then empty sequences up to the
    # next power of two; the runs that start at a real token are the packed sequences, row-major.
    offsets = batch["cu_seqlens"]
    assert_tight(offsets, len(packed["input_ids"]) * (2730 + 1))
    starts, runs = offsets[:-1], torch.diff(offsets)
    real = (runs > 0) & (batch["attention_mask"].flatten()[starts.clamp(max=offsets[-1] - 1)] > 0)
    lengths = packed["sequence_lengths"][packed["sequence_lengths"] > 0]
    np.testing.assert_array_equal(runs[real].numpy(), lengths)
    assert batch["cls_positions"].shape == (len(packed["input_ids"]), 2730)
