"""cluster_check's own pieces, without a cluster: packed rows read back as the same instances unpacked (the
reference its packed-vs-unpacked loss check relies on), and a disagreement stops it with one error line.
(The whole check on 2 nodes: tests/test_slurm.py.)"""
import numpy as np
import pytest
import torch

from tests.test_pack import encoded, read  # noqa: F401  (the fixture: encoded shards of generated text)
from workflow.cli import UserError
from workflow.data.hdf5 import read_encoded
from workflow.data.pack import pack_shard
from workflow.slurm.cluster_check import report, unpacked
from workflow.train.pretraining_data import make_batch


@pytest.mark.parametrize("length", [128, 512])
def test_packed_rows_unpack_to_the_rows_of_the_same_instances(encoded, tmp_path, length):  # noqa: F811
    original, _ = read_encoded(encoded[length])
    pack_shard(encoded[length], tmp_path / "packed.hdf5", 3)
    packed, _ = read(tmp_path / "packed.hdf5")
    batch = make_batch(packed, np.arange(len(packed["input_ids"])))
    got = unpacked(batch)
    instances = batch["instance_index"][batch["next_sentence_labels"] >= 0]
    assert len(instances) == len(original["input_ids"]) > len(packed["input_ids"])
    expected = make_batch(original, instances.numpy())
    # prediction slots: the packed rows' width W may differ from the encoded P; the slots past both are empty
    width = min(got["masked_lm_positions"].shape[1], expected["masked_lm_positions"].shape[1])
    for key, value in expected.items():
        if key.startswith("masked_lm"):
            empty = -1 if key == "masked_lm_labels" else 0
            assert (got[key][:, width:] == empty).all() and (value[:, width:] == empty).all(), key
            got[key], value = got[key][:, :width], value[:, :width]
        assert torch.equal(got[key], value), key


def test_packed_and_unpacked_losses_that_disagree_stop_the_check_naming_the_way_out(capsys):
    rank = {"rank": 0, "host": "node1", "gpu": None, "cuda_visible_devices": "0,1", "device": "cpu", "cores": [0]}
    result = {"ranks": [rank], "world_size": 1, "allreduce_mb": 8, "allreduce_bus_gbps": None, "preset": "tiny",
              "seq_length": 128, "precision": "fp32", "optimizer": "torch.Lamb", "sequences_per_second": 10.0,
              "steps": 4, "checkpoint_bytes": 10**7, "checkpoint_write_s": 0.1,
              "packed_vs_unpacked": [{"packed": True, "relative_difference": 3e-3}]}
    with pytest.raises(UserError, match="differ by 3.00e-03 .*encode.packing.enabled: false"):
        report(result)
    assert "relative difference up to 3.00e-03 (must be <= 0.0001)" in capsys.readouterr().err
    report({**result, "packed_vs_unpacked": [{"packed": True, "relative_difference": 2e-6}]})
