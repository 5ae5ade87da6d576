"""The GPU modes of benchmarks/train_step.py and benchmarks/modernbert_step.py, rehearsed on CPU: HF's class and every
variant of ours (eager, compiled, compiled + float8's skip line) in one table per run, with the training loss, the
largest micro-batch search and the optimizer per global batch (benchmarks/gpu_measure.py); packed rows take the
unpadded varlen path a GPU run times, and without a GPU the default run says it skipped."""
import re
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nested._internal.nested_tensor as nested_internals


from workflow.train.models import kit
from benchmarks.gpu_measure import Device, largest_micro_batch, optimizer_table
from benchmarks.train_step import configured_phases, instances, ours_step, row_batches
from tests.conftest import REPO
from workflow.data.pack import PackSettings, pack_arrays
from workflow.train.optim.lamb import Lamb, param_groups
from workflow.train.models.bert import BertConfig, BertForPreTraining
from workflow.train.models.kit import pretraining_loss, unpad
from workflow.train.precision import autocast
from workflow.train.pretrain import forward

SCRIPT = REPO / "benchmarks" / "train_step.py"
MODERNBERT_SCRIPT = REPO / "benchmarks" / "modernbert_step.py"
STEPS, MICRO, VOCAB = 1, {"phase1": 8, "phase2": 4}, 1024  # a small vocab: the same code, a fraction of the time
PHASES = {"phase1": (128, 20), "phase2": (512, 80)}
REHEARSAL = ["--device", "cpu", "--threads", "1", "--steps", str(STEPS), "--warmup", "0", "--compile", "--float8",
             "--find-max-micro-batch", "hf,eager", "--max-micro-batch-cap", "8", "--optimizer-repeats", "1"]
FLOAT8_SKIP = ("skipped ours compiled+float8: config pretrain.float8: float8 training needs a CUDA GPU (the model is "
               "on cpu); set pretrain.float8: false")
TABLE_ROW = re.compile(r"^\| (HF [^|]+?|ours [^|]+?) \| ([0-9,]+|skipped)" + r" \| ([^|]*)" * 4 + r" \|$", re.M)


def rehearsal(script, *args) -> str:
    """The GPU mode's stdout, run on CPU at tiny sizes; it must exit 0 within a minute's CPU time."""
    result = subprocess.run([sys.executable, str(script), "--gpu", *REHEARSAL, *args], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def variant_rows(stdout: str) -> dict:
    """{side: (real tokens/s, MFU, peak memory, largest micro-batch, note)} of every table in `stdout`, per table."""
    return [{side: rest for side, *rest in TABLE_ROW.findall(block)} for block in stdout.split("\n### ")[1:]]


def expected_fills(phase):
    """(fill padded, fill packed) of the phase's instances, packed as the stage packs."""
    seq, predictions = PHASES[phase]
    arrays = instances(BertConfig.preset("tiny", vocab_size=VOCAB), seq, predictions, STEPS * MICRO[phase])
    settings = PackSettings()
    packed = pack_arrays(arrays, settings.max_sequences_per_pack, algorithm=settings.algorithm)
    real = np.count_nonzero(arrays["input_mask"])
    return real / arrays["input_mask"].size, real / packed["input_mask"].size


def assert_every_variant_measured(tables: list[dict], hf_sides: list[str]) -> None:
    for rows in tables:
        assert list(rows) == [*hf_sides, "ours eager", "ours compiled", "ours compiled+float8"], rows
        for side in [*hf_sides, "ours eager", "ours compiled"]:
            tokens_per_s, mfu, memory, largest, note = rows[side]
            assert int(tokens_per_s.replace(",", "")) > 0 and mfu == "n/a" and memory.endswith("GiB RSS"), side
            # HF and eager searched (CPU: no out-of-memory, so the cap stops it); compiled ones recompile per size
            assert largest == (">= 8 (cap 8)" if side != "ours compiled" else "not searched"), side
        assert "graphs compiled while timed: 0" in rows["ours compiled"][4]  # compiled in the warm-up
        assert rows["ours compiled+float8"][0] == "skipped" and "needs a CUDA GPU" in rows["ours compiled+float8"][4]


def optimizer_rows(stdout: str) -> list[tuple[str, str, str, str]]:
    return re.findall(r"^\| ((?:Lamb|LAMB|apex|optimi)[^|]*?) \| ([^|]+?) \| (\d+) \| ([^|]*?) ?\|$", stdout, re.M)


def test_gpu_mode_on_cpu_prints_hf_and_every_variant_with_the_training_loss_in_both_phases():
    stdout = rehearsal(SCRIPT, "--preset", "tiny", "--vocab", str(VOCAB), "--gpu-micro-batch1", str(MICRO["phase1"]),
                       "--gpu-micro-batch2", str(MICRO["phase2"]))
    tables = variant_rows(stdout)
    assert len(tables) == 2 and stdout.count(FLOAT8_SKIP) == 2, stdout
    assert_every_variant_measured(tables, ["HF BertForPreTraining"])
    for phase in PHASES:
        fill_padded, fill_packed = expected_fills(phase)
        assert f"(fill {fill_packed:.3f} vs padded {fill_padded:.3f})" in stdout, phase
    assert stdout.count("PretrainingTask.loss, fused_loss: reference logits (liger-kernel's fused linear "
                        "cross-entropy runs on CUDA only") == 2
    # LAMB once per global batch: config.yaml's global_batch_size / micro-batch micro-batches
    optimizers = optimizer_rows(stdout)
    assert [(name, count) for name, _, count, _ in optimizers] == [
        ("Lamb (torch _foreach, ours)", "8192"), ("LAMB per-parameter loop (tests/test_lamb.py)", "8192"),
        ("apex FusedLAMB", "8192")] * 2, stdout  # 65,536 / 8 and 32,768 / 4
    for name, ms, _, share in optimizers:
        if name == "apex FusedLAMB":
            assert ms.startswith("not run: apex FusedLAMB runs on CUDA only") and share == ""
        else:
            assert float(ms) > 0 and share.endswith("%")


def test_modernbert_gpu_mode_on_cpu_prints_hf_and_every_variant_with_the_training_loss():
    stdout = rehearsal(MODERNBERT_SCRIPT, "--preset", "modernbert-tiny", "--gpu-seq", "128", "--micro-batch", "2",
                       "--vocab", "1024")
    tables = variant_rows(stdout)
    assert len(tables) == 1 and stdout.count(FLOAT8_SKIP) == 1, stdout
    assert_every_variant_measured(tables, ["HF ModernBertForMaskedLM", "HF ModernBertForMaskedLM (sparse_prediction)"])
    assert "summed_mlm_loss: reference logits (liger-kernel's fused linear cross-entropy runs on CUDA only" in stdout
    # the recipe's global batch, 4,718,592 tokens, in micro-batches of 2 x 128
    optimizers = optimizer_rows(stdout)
    assert [(name, count) for name, _, count, _ in optimizers] == [
        ("optimi.StableAdamW (foreach, decouple_lr)", "18432"), ("optimi.StableAdamW (for-loop, decouple_lr)", "18432")]


def test_largest_micro_batch_doubles_until_out_of_memory_and_reports_the_last_that_ran():
    tried = []

    def run_once(rows):
        tried.append(rows)
        if rows > 40:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    device = Device("cpu")
    assert largest_micro_batch(run_once, 5, 1000, device) == "40" and tried == [5, 10, 20, 40, 80]
    assert largest_micro_batch(run_once, 80, 1000, device) == "< 80"
    assert largest_micro_batch(lambda rows: None, 4, 16, device) == ">= 16 (cap 16)"
    with pytest.raises(RuntimeError, match="not memory"):
        largest_micro_batch(lambda rows: (_ for _ in ()).throw(RuntimeError("not memory")), 4, 16, device)


def test_the_optimizer_share_is_one_step_over_the_accumulated_micro_batches():
    text = optimizer_table(100.0, 1024, {"fast": 10.0, "absent": "apex is not importable"})
    assert "| fast | 10.00 | 1024 | 0.010% |" in text  # 10 / (1,024 x 100 + 10)
    assert "| absent | not run: apex is not importable | 1024 | |" in text


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


def test_a_side_that_raises_is_a_failed_row_and_the_others_are_still_measured_printed_as_they_end(capsys):
    from benchmarks.gpu_measure import Row, exit_status, side_guard, table

    rows, device = [], Device("cpu")
    with side_guard(rows, "ours eager", device):
        rows.append(Row("ours eager", 1234.0, "n/a", "0.1 GiB RSS"))
    with side_guard(rows, "ours compiled", device):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nsecond line")
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["measured: | ours eager | 1,234 | n/a | 0.1 GiB RSS | not searched |  |",
                       "measured: | ours compiled | failed |  |  |  | failed: OutOfMemoryError: CUDA out of memory. "
                       "Tried to allocate 2.00 GiB |"]
    assert table(rows).splitlines()[2:] == [line.removeprefix("measured: ") for line in printed]
    assert exit_status(rows) == 1 and exit_status(rows[:1]) == 0


def test_a_variant_that_cannot_be_built_fails_its_row_alone_and_the_run_exits_1():
    result = subprocess.run([sys.executable, str(MODERNBERT_SCRIPT), "--gpu", *REHEARSAL, "--preset",
                             "modernbert-tiny", "--gpu-seq", "64", "--micro-batch", "2", "--vocab", "1024",
                             "--compile-mode", "no-such-mode"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stderr[-3000:]
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in result.stdout.splitlines()
            if line.startswith(("| HF", "| ours"))}
    assert rows["ours compiled"].startswith("| ours compiled | failed |")
    assert "failed: RuntimeError: Unrecognized mode=no-such-mode" in rows["ours compiled"]
    for side in ("HF ModernBertForMaskedLM", "ours eager"):
        assert re.match(rf"\| {re.escape(side)} \| [0-9,]+ \|", rows[side]), rows[side]
    assert f"measured: {rows['ours eager']}" in result.stdout  # printed when measured, before the table
    assert "optimi.StableAdamW (foreach, decouple_lr)" in result.stdout  # the run went on to the optimizer
    assert "failed sides: ours compiled" in result.stderr
