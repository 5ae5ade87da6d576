"""mlm_loss (workflow/train/models/fused_loss.py) equals pretraining_loss's MLM half, ignores label -1, and is finite
on an all-ignored batch; on CUDA, liger's fused path equals the reference within bf16's rounding."""
import ast
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from workflow.train.models import fused_loss
from workflow.train.models.fused_loss import fused_mlm_loss_reason, mlm_loss, reference_mlm_loss
from workflow.train.models.kit import pretraining_loss


def head_inputs(rows=12, hidden_size=16, vocab=40, ignored=(1, 5, 6), device="cpu", dtype=torch.float32, seed=0):
    """(hidden [N, H], decoder weight [V, H], decoder bias [V], labels [N]) as leaf tensors, `ignored` rows at -1."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, hidden_size, generator=generator)
    weight = torch.randn(vocab, hidden_size, generator=generator) * 2 / hidden_size ** 0.5  # logits' std ~2
    bias = torch.randn(vocab, generator=generator) * 0.1
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    labels[list(ignored)] = -1
    leaves = [t.to(device, dtype).requires_grad_() for t in (hidden, weight, bias)]
    return (*leaves, labels.to(device))


def loss_and_grads(loss_fn, hidden, weight, bias, labels):
    loss, correct = loss_fn(hidden, weight, bias, labels)
    grads = torch.autograd.grad(loss, (hidden, weight, bias))
    return loss.detach(), correct, grads


def test_mlm_loss_on_cpu_equals_pretraining_loss_with_the_same_gradients():
    hidden, weight, bias, labels = head_inputs()
    assert fused_mlm_loss_reason(hidden.device) is not None  # CPU: the reference path
    loss, correct, grads = loss_and_grads(mlm_loss, hidden, weight, bias, labels)

    def kit_mlm(hidden, weight, bias, labels):
        terms = pretraining_loss(F.linear(hidden, weight, bias), None, labels, torch.full((1,), -1))
        return terms["mlm_loss"], terms["mlm_correct"]

    want_loss, want_correct, want_grads = loss_and_grads(kit_mlm, hidden, weight, bias, labels)
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-6)
    assert int(correct) == int(want_correct)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_ignored_rows_change_neither_the_loss_nor_get_a_gradient():
    hidden, weight, bias, labels = head_inputs(ignored=(1, 5, 6))
    loss, correct, (hidden_grad, _, _) = loss_and_grads(mlm_loss, hidden, weight, bias, labels)
    kept = labels != -1
    sub_hidden = hidden.detach()[kept].requires_grad_()
    sub_loss, sub_correct, (sub_grad, _, _) = loss_and_grads(mlm_loss, sub_hidden, weight, bias, labels[kept])
    torch.testing.assert_close(loss, sub_loss, rtol=0, atol=1e-6)
    assert int(correct) == int(sub_correct)
    assert not hidden_grad[~kept].any()
    torch.testing.assert_close(hidden_grad[kept], sub_grad, rtol=0, atol=1e-6)


def test_an_all_ignored_batch_has_zero_loss_and_zero_gradients_not_nan():
    hidden, weight, bias, labels = head_inputs(rows=4, ignored=(0, 1, 2, 3))
    loss, correct, grads = loss_and_grads(mlm_loss, hidden, weight, bias, labels)
    assert float(loss) == 0.0 and int(correct) == 0
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_the_accuracy_counts_the_labelled_rows_the_argmax_predicts():
    hidden, weight, bias, labels = head_inputs(ignored=(0,))
    predicted = F.linear(hidden, weight, bias).argmax(-1)
    labels = predicted.clone()
    labels[[0]] = -1  # an ignored row is never counted
    labels[[1, 2]] = (predicted[[1, 2]] + 1) % weight.shape[0]  # two wrong
    _, correct = mlm_loss(hidden, weight, bias, labels)
    assert int(correct) == len(labels) - 3


def test_no_bias_is_a_decoder_without_bias():
    hidden, weight, _, labels = head_inputs()
    loss, correct = mlm_loss(hidden, weight, None, labels)
    want = F.cross_entropy(hidden @ weight.T, labels, ignore_index=-1)
    torch.testing.assert_close(loss, want, rtol=0, atol=1e-6)


def liger_parameters() -> set[str]:
    """The parameters of liger's liger_fused_linear_cross_entropy, read from its source (importing it needs Triton)."""
    spec = importlib.util.find_spec("liger_kernel")
    if spec is None:
        pytest.skip("liger-kernel is not installed")
    source = Path(spec.submodule_search_locations[0], "transformers", "functional.py").read_text(encoding="utf-8")
    function = next(node for node in ast.parse(source).body
                    if isinstance(node, ast.FunctionDef) and node.name == "liger_fused_linear_cross_entropy")
    return {argument.arg for argument in function.args.args}


def stand_in_liger(input, weight, target, bias=None, **options):
    """liger_fused_linear_cross_entropy's contract in torch: the loss summed over the rows whose target is not
    ignore_index (reduction "sum"), and each row's argmax (-1 where ignored) as predicted_tokens."""
    assert {"input", "weight", "target", "bias", *options} <= liger_parameters(), options
    assert options["reduction"] == "sum" and options["return_predicted_tokens"]
    logits = F.linear(input, weight, bias).float()
    ignored = target == options["ignore_index"]
    loss = F.cross_entropy(logits, target, ignore_index=options["ignore_index"], reduction="sum")
    return types.SimpleNamespace(loss=loss, predicted_tokens=torch.where(ignored, -1, logits.argmax(-1)))


@pytest.mark.parametrize("ignored", [(1, 5, 6), tuple(range(12))], ids=["some-ignored", "all-ignored"])
def test_the_liger_path_turns_its_summed_loss_and_predictions_into_the_mean_and_the_count(monkeypatch, ignored):
    """The glue of the CUDA path, on CPU: liger's call as its source declares it, with a stand-in of its kernel."""
    inputs = head_inputs(ignored=ignored)
    want_loss, want_correct, want_grads = loss_and_grads(reference_mlm_loss, *inputs)
    monkeypatch.setattr(fused_loss, "fused_mlm_loss_reason", lambda device: None)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional",
                        types.SimpleNamespace(liger_fused_linear_cross_entropy=stand_in_liger))
    loss, correct, grads = loss_and_grads(mlm_loss, *inputs)
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-6)
    assert int(correct) == int(want_correct)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="liger-kernel's fused path runs on CUDA")
@pytest.mark.parametrize("ignored", [(1, 5, 6, 200), tuple(range(512))], ids=["some-ignored", "all-ignored"])
def test_the_fused_cuda_path_equals_the_reference_in_bf16(ignored):
    """bf16 inputs at BERT's vocab: the loss within 1e-2 relative, each gradient within 2e-2 relative (norm of the
    difference over the norm: bf16 keeps 8 bits), the argmax count within 1% of the rows (bf16 near-ties)."""
    reason = fused_mlm_loss_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    inputs = head_inputs(rows=512, hidden_size=256, vocab=30528, ignored=ignored, device="cuda",
                         dtype=torch.bfloat16)
    loss, correct, grads = loss_and_grads(mlm_loss, *inputs)
    want_loss, want_correct, want_grads = loss_and_grads(reference_mlm_loss, *inputs)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss.float(), want_loss.float(), rtol=1e-2, atol=1e-6)
    assert abs(int(correct) - int(want_correct)) <= 5
    for got, want in zip(grads, want_grads):
        assert got.dtype == want.dtype and torch.isfinite(got).all()
        if len(ignored) == 512:
            assert not got.any()
        else:
            assert relative_error(got, want) < 2e-2


def simple_liger(calls: list):
    """liger_fused_linear_cross_entropy's contract (the summed loss, each row's argmax), recording its calls."""

    def liger_fused_linear_cross_entropy(input, weight, target, bias=None, ignore_index=-100, reduction="mean",
                                         accum_dtype=None, return_predicted_tokens=False):
        calls.append(tuple(input.shape))
        logits = F.linear(input, weight, bias).float()
        loss = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
        return types.SimpleNamespace(loss=loss, predicted_tokens=torch.where(target == ignore_index, -1,
                                                                               logits.argmax(-1)))

    return liger_fused_linear_cross_entropy


def family_model_and_batch(name: str):
    """A tiny model of the family and a packed training batch through its host_indices."""
    from tests.test_flash_varlen import CONFIG as BERT_CONFIG, packed_rows
    from tests.test_modernbert import packed_batch, small_config, training_batch
    from workflow.train.models.bert import BertForPreTraining
    from workflow.train.models.kit import host_indices
    from workflow.train.models.modernbert import ModernBertForMaskedLM

    torch.manual_seed(0)
    if name == "bert":
        model, batch = BertForPreTraining(BERT_CONFIG), host_indices(packed_rows())
    elif name == "roberta":
        from workflow.train.models.roberta import RobertaConfig, RobertaForMaskedLM

        config = RobertaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=48, max_position_embeddings=34)
        model, batch = RobertaForMaskedLM(config), host_indices(packed_rows())
    else:
        model, batch = ModernBertForMaskedLM(small_config()), training_batch(*packed_batch())
    batch.setdefault("next_sentence_labels", (batch["cls_positions"] > 0).long())  # a label per sequence slot
    return model, batch, name == "bert"


@pytest.mark.parametrize("name", ["bert", "modernbert", "roberta"])
def test_training_takes_the_fused_loss_from_the_heads_hidden_states_as_the_logits_path_does(name, monkeypatch):
    """PretrainingTask.loss with the fused loss (liger's contract stood in on CPU) gives the logits path's loss,
    accuracy and gradients: the head's hidden states and the tied decoder (mlm_decoder) are the logits' inputs."""
    from workflow.train.pretrain import PretrainingTask

    model, batch, nsp = family_model_and_batch(name)
    counts = PretrainingTask(None, batch["input_ids"].shape[1], nsp).count(batch)
    totals = {key: value.float() for key, value in counts.items()}

    def loss_and_grads(fused: bool):
        model.zero_grad()
        torch.manual_seed(1)  # the same dropout masks on both paths
        out = PretrainingTask(None, batch["input_ids"].shape[1], nsp, fused_loss=fused).loss(model, batch, totals)
        out["loss"].backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want, want_grads = loss_and_grads(False)
    calls = []
    monkeypatch.setattr(fused_loss, "fused_mlm_loss_reason", lambda device: None)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional",
                        types.SimpleNamespace(liger_fused_linear_cross_entropy=simple_liger(calls)))
    got, got_grads = loss_and_grads(True)
    hidden = model.config.hidden_size
    assert calls == [(batch["masked_lm_index"].numel(), hidden)]  # every slot's hidden state, never [N, V] logits
    torch.testing.assert_close(got["mlm_loss"], want["mlm_loss"], rtol=0, atol=1e-6)
    assert int(got["mlm_correct"]) == int(want["mlm_correct"]) and int(got["mlm_count"]) == int(want["mlm_count"])
    assert got_grads.keys() == want_grads.keys()
    for key in want_grads:
        torch.testing.assert_close(got_grads[key], want_grads[key], rtol=0, atol=1e-6)
