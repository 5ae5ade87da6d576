"""The GPU projections' measured half (benchmarks/activation_memory.py) and benchmarks/bert_projection.py: the bytes a
CPU forward keeps are those a CUDA one keeps, they grow linearly with the tokens on the GPU's path, and the
projection's hours follow its FLOPs."""
import re

import pytest
import torch

from benchmarks import bert_projection
from benchmarks.activation_memory import (USABLE, activation_fit, cuda_dropout, fused_loss_bytes, saved_bytes,
                                          saved_storages)
from workflow.train.models.bert import BertConfig, BertForPreTraining
from workflow.train.models.modernbert import ModernBertConfig, ModernBertForMaskedLM


def kept_bytes(run) -> int:
    """Bytes of the storages autograd saves while `run()` builds its graph."""
    with saved_storages() as storages:
        run()
    return sum(storages.values())


def tiny_bert():
    torch.manual_seed(0)
    return BertForPreTraining(BertConfig.preset("tiny", vocab_size=512)).train()


def tiny_modernbert():
    torch.manual_seed(0)
    config = ModernBertConfig.preset("modernbert-tiny", vocab_size=512, pad_token_id=0, cls_token_id=1,
                                     sep_token_id=2, bos_token_id=1, eos_token_id=2)
    return ModernBertForMaskedLM(config).train()


def test_dropout_keeps_cudas_bool_mask_under_cuda_dropout():
    """CPU's F.dropout keeps its scaled noise in the input's dtype; under cuda_dropout the forward keeps what CUDA's
    native_dropout keeps, a bool a value, and still drops about p of them."""
    x = torch.randn(64, 256, requires_grad=True)
    assert kept_bytes(lambda: torch.nn.functional.dropout(x, 0.1, True)) == x.numel() * 4
    with cuda_dropout():
        kept = kept_bytes(lambda: torch.nn.functional.dropout(x, 0.1, True))
        dropped = float((torch.nn.functional.dropout(x, 0.1, True) == 0).float().mean())
    assert kept == x.numel()
    assert abs(dropped - 0.1) < 0.01
    assert torch.nn.functional.dropout(x, 0.1, True).grad_fn.name() == "MulBackward0"  # restored


def test_the_fit_finds_the_bf16_weight_copy_and_a_flat_per_token_cost_on_the_dense_path():
    """On the CPU's dense path the fit's constant is autocast's bf16 copy of the weights (2 bytes a parameter of
    every matrix: the tied decoder casts the embeddings too), and its per-token cost predicts a fourth length's saved
    bytes once the dense path's quadratic term is added back."""
    model = tiny_modernbert()
    rows = 2
    _, (constant, per_token, quadratic) = activation_fit(model, (40, 80, 160), rows, 0.3)
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    assert abs(constant - 2 * matrices) / (2 * matrices) < 0.05
    assert quadratic > 0  # the dense attention's probabilities
    predicted = constant + per_token * rows * 320 + quadratic * rows * 320 * 320
    assert abs(saved_bytes(model, rows, 320, 0.3) - predicted) / predicted < 0.01


@pytest.mark.parametrize("make_model", [tiny_bert, tiny_modernbert], ids=["bert", "modernbert"])
def test_on_the_gpu_path_the_kept_bytes_grow_linearly_and_the_fused_loss_keeps_no_logits(make_model):
    """Rows laid end to end through flash_varlen keep nothing quadratic in the row's length: the fit over three
    lengths predicts a fourth to 0.5%. The fused loss's bytes are its gradients' (fused_loss_bytes), not the logits':
    below the logits path by at least the fp32 log-probabilities of the predictions less those gradients."""
    model = make_model()
    rows, masking = 2, 0.3
    _, (constant, per_token, quadratic) = activation_fit(model, (40, 80, 160), rows, masking, fused_loss=True,
                                                         varlen=True)
    assert abs(quadratic) * 320 < 1e-3 * per_token
    predicted = constant + per_token * rows * 320
    assert abs(saved_bytes(model, rows, 320, masking, fused_loss=True, varlen=True) - predicted) / predicted < 0.005
    through_logits = saved_bytes(model, rows, 320, masking, varlen=True)
    fused = saved_bytes(model, rows, 320, masking, fused_loss=True, varlen=True)
    predictions, hidden = rows * round(masking * 320), model.config.hidden_size
    weight, bias = model.mlm_decoder()
    log_probabilities = predictions * model.config.vocab_size * 4
    liger = fused_loss_bytes(torch.empty(predictions, hidden), weight, bias)
    assert through_logits - fused >= log_probabilities - liger


def test_bert_projection_prints_hours_that_follow_flops_and_rows_that_fit(capsys):
    """benchmarks/bert_projection.py on the tiny preset and one GPU (no all-reduce): each phase's hours are its FLOPs
    at the MFU, so half the MFU takes twice the hours, and the GPU-hours are the hours; the most rows that fit leave
    the GPU's usable memory between that many rows' projected peak and one row more's."""
    bert_projection.main(["--preset", "tiny", "--vocab", "512", "--measure", "40", "80", "160", "--mfu", "0.002",
                          "0.004", "--nodes", "1", "--gpus-per-node", "1"])
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (phase\d) \| [\d,]+ x [\d,]+ \| .* \| [\d,]+ \| ([\d.,]+) \| ([\d,]+) \|$", out, re.M)
    assert [phase for phase, _, _ in rows] == ["phase1", "phase1", "phase2", "phase2"]
    hours = [float(h.replace(",", "")) for _, h, _ in rows]
    assert hours[0] > 1 and hours[2] > 1
    assert hours[0] / hours[1] == pytest.approx(2.0, rel=0.01)
    assert hours[2] / hours[3] == pytest.approx(2.0, rel=0.01)
    assert [int(gpu_hours.replace(",", "")) for _, _, gpu_hours in rows] == [round(h) for h in hours]
    per_slot = float(re.search(r"and ([\d.]+) KB a token slot", out).group(1)) * 1e3
    static = float(re.search(r"= ([\d.]+) GiB, and", out).group(1)) * 2**30
    most_40 = int(re.search(r"^\| phase1 \| \d+ x 128 \| .* \| (\d+) / \d+ / \d+ \|$", out, re.M).group(1))
    usable = 40e9 * USABLE
    assert static + per_slot * most_40 * 128 <= usable * 1.01
    assert static + per_slot * (most_40 + 1) * 128 > usable * 0.99
