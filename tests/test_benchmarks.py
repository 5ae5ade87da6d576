"""benchmarks/train_step.py's --gpu mode, run on CPU: every side of both phases is timed on the instances it says,
packed rows take the unpadded varlen path a GPU run times, and without a GPU the default run says it skipped."""
import re
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nested._internal.nested_tensor as nested_internals


from workflow.train.models import kit
from benchmarks.train_step import Device, configured_phases, instances, ours_step, row_batches
from tests.conftest import REPO
from workflow.data.pack import PackSettings, pack_arrays
from workflow.train.optim.lamb import Lamb, param_groups
from workflow.train.models.bert import BertConfig, BertForPreTraining
from workflow.train.models.kit import pretraining_loss, unpad
from workflow.train.precision import autocast
from workflow.train.pretrain import forward

SCRIPT = REPO / "benchmarks" / "train_step.py"
STEPS, MICRO, VOCAB = 2, {"phase1": 8, "phase2": 4}, 1024  # a small vocab: the same code, a fraction of the time
PHASES = {"phase1": (128, 20), "phase2": (512, 80)}
SIDES = ("HF padded", "ours padded", "ours packed", "ours packed, nested SDPA")
SIDE_LINE = re.compile(r"^  (phase[12]) \| (.+?) +\| fill ([0-9.]+) \| +(\d+) micro-batches \| +(\S+) seq/s \| "
                       r"+([0-9,]+) real tokens/s \| MFU (\S+) \|", re.M)


def expected_fills(phase):
    """(fill padded, fill packed, padded rows, packed rows) of the phase's instances, packed as the stage packs."""
    seq, predictions = PHASES[phase]
    arrays = instances(BertConfig.preset("tiny", vocab_size=VOCAB), seq, predictions, STEPS * MICRO[phase])
    settings = PackSettings()
    packed = pack_arrays(arrays, settings.max_sequences_per_pack, algorithm=settings.algorithm)
    real = np.count_nonzero(arrays["input_mask"])
    return real / arrays["input_mask"].size, real / packed["input_mask"].size, len(arrays["input_mask"]), len(
        packed["input_mask"])


def test_gpu_mode_on_cpu_times_hf_and_ours_padded_and_packed_on_the_same_instances_in_both_phases():
    result = subprocess.run([sys.executable, str(SCRIPT), "--gpu", "--device", "cpu", "--preset", "tiny",
                             "--vocab", str(VOCAB), "--steps", str(STEPS), "--warmup", "1",
                             "--gpu-micro-batch1", str(MICRO["phase1"]),
                             "--gpu-micro-batch2", str(MICRO["phase2"])], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = SIDE_LINE.findall(result.stdout)
    assert sorted((phase, side) for phase, side, *_ in lines) == sorted(
        (phase, side) for phase in PHASES for side in SIDES), result.stdout
    for phase, side, fill, batches, seq_per_s, tokens_per_s, mfu in lines:
        fill_padded, fill_packed, padded_rows, packed_rows = expected_fills(phase)
        assert fill_packed > fill_padded
        packed_side = side.startswith("ours packed")
        expected_fill, rows = (fill_packed, packed_rows) if packed_side else (fill_padded, padded_rows)
        assert fill == f"{expected_fill:.4f}", (phase, side)
        assert int(batches) == -(-rows // MICRO[phase]), (phase, side)
        assert float(seq_per_s) > 0 and int(tokens_per_s.replace(",", "")) > 0
        assert mfu == "n/a"  # the MFU peak is a GPU figure
    for phase, (seq, _) in PHASES.items():  # every micro-batch of one shape, the last filled up with empty rows
        assert len(re.findall(rf"^  {phase} \|.* \| shapes \[\({MICRO[phase]}, {seq}\)\]$", result.stdout, re.M)) == 4
    for phase in PHASES:
        assert re.search(rf"^  {phase}: ours over HF .*: padded \d+\.\d+x, packed \(unpadded varlen\) \d+\.\d+x "
                         rf"\(through nested SDPA \d+\.\d+x\)$",
                         result.stdout, re.M), result.stdout


def test_gpu_mode_times_the_micro_batches_the_config_file_sets():
    assert configured_phases(REPO / "config.yaml") == [("phase1", 128, 20, 64), ("phase2", 512, 80, 16)]
    assert configured_phases(REPO / "config.yaml", 8, None)[0][3] == 8  # an explicit size overrides


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the default run would be the real benchmark")
def test_gpu_mode_without_a_gpu_says_it_skipped_and_exits_0():
    result = subprocess.run([sys.executable, str(SCRIPT), "--gpu"], capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout) == (0, "no CUDA device: GPU benchmark skipped\n"), result.stderr[-3000:]


def packed_batch(config):
    arrays = pack_arrays(instances(config, 128, 20, 12, seed=3), 3)
    return row_batches(arrays, len(arrays["input_ids"]), "cpu")[0]


def test_packed_rows_on_the_cpu_rehearsal_take_the_varlen_path_and_match_the_row_path_in_bf16():
    config = BertConfig.preset("tiny", vocab_size=30528)
    torch.manual_seed(0)
    model = BertForPreTraining(config).eval()  # no dropout: both paths compute the same function
    batch = packed_batch(config)
    device = Device("cpu")

    def loss():
        with autocast(device.torch, "bf16"):
            mlm, nsp, labels = forward(model, batch)
            return pretraining_loss(mlm, nsp, labels, batch["next_sentence_labels"])["loss"].item()

    varlen_call = kit.VarlenAttention.__call__
    with mock.patch.object(kit.VarlenAttention, "__call__", autospec=True, side_effect=varlen_call) as varlen:
        row_path = loss()
        assert varlen.call_count == 0
        with device.packed_path():
            varlen_path = loss()
        assert varlen.call_count == config.num_hidden_layers
    assert kit.VARLEN_DEVICE_TYPES == ("cuda",)  # restored
    assert varlen_path == pytest.approx(row_path, rel=2e-2)  # bf16 rounding only

    # A full training step of the benchmark, on that path: LAMB moves every weight the loss reaches.
    model.train()
    optimizer = Lamb(param_groups(model), lr=1e-3)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with device.packed_path():
        ours_step(model, optimizer, batch, lambda: autocast(device.torch, "bf16"))
    unchanged = [name for name, p in model.named_parameters() if torch.equal(p, before[name])]
    assert unchanged == [], unchanged


def test_varlen_attention_hands_sdpa_both_sequence_length_extremes_so_cuda_never_reads_them_back():
    mask = torch.tensor([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]])  # sequences of 3, 2 and 4 tokens
    unpadded = unpad(mask)
    attention = kit.VarlenAttention(unpadded.offsets, unpadded.min_seqlen, unpadded.max_seqlen)
    nested = attention._nested(torch.randn(len(unpadded.tokens), 2, 4))
    # CUDA's SDPA asks a nested tensor for both; computing one reads the lengths back from the device (a sync).
    with mock.patch.object(nested_internals, "_get_sdpa_extreme_seqlen", side_effect=AssertionError("device sync")):
        assert (nested._get_min_seqlen(), nested._get_max_seqlen()) == (0, 6)  # fixed: 0 and the row length
