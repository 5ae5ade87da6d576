"""Float8 training (workflow/train/float8.py): refused by name where it cannot run; the filter converts the
encoder's matmuls of a tiny BERT and leaves its embeddings, decoder and small classifier alone; a converted model
trains like bf16 and compiles to one graph, for real on a float8 GPU or on the CPU (torch's float8 matmul runs there
too, without the speed; the job still refuses float8 on a CPU)."""
import copy

import pytest
import torch
from torch import nn

from workflow.train.float8 import convert_to_float8, float8_error, float8_module_filter
from workflow.train.models.bert import BertConfig, BertForPreTraining
from workflow.train.models.modernbert import ModernBertConfig, ModernBertForMaskedLM
from workflow.train.precision import autocast


def tiny_bert():
    return BertForPreTraining(BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64))


def tiny_modernbert():
    # intermediate_size 40: the feed-forward's Wo (40 -> 32) is not a multiple of 16, its Wi (32 -> 2 x 40) is.
    return ModernBertForMaskedLM(ModernBertConfig(vocab_size=40, hidden_size=32, intermediate_size=40,
                                                  num_hidden_layers=2, num_attention_heads=2, pad_token_id=0,
                                                  eos_token_id=1, bos_token_id=2, cls_token_id=2, sep_token_id=1))


# Per family: the tiny model and the nn.Linear layers the filter must leave alone.
FAMILIES = {"bert": (tiny_bert, {"cls.seq_relationship"}),  # 2 outputs
            "modernbert": (tiny_modernbert, {"model.layers.0.mlp.Wo", "model.layers.1.mlp.Wo"})}


def test_float8_is_refused_on_cpu_naming_the_key():
    error = float8_error(torch.device("cpu"))
    assert error.startswith("config pretrain.float8:") and "CUDA" in error and "\n" not in error


def test_float8_is_refused_on_a_gpu_older_than_ada_naming_the_key_and_its_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    error = float8_error(torch.device("cuda", 0))
    assert error.startswith("config pretrain.float8:") and "8.9" in error and "8.0" in error


def test_float8_is_refused_without_torchao_naming_the_package(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(__import__("sys").modules, "torchao", None)  # import torchao raises ImportError
    error = float8_error(torch.device("cuda", 0))
    assert error.startswith("config pretrain.float8:") and "pip install torchao==" in error


def converted_names(model: nn.Module) -> set[str]:
    return {name for name, module in model.named_modules() if float8_module_filter(module, name)}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_filter_picks_every_linear_but_those_with_dims_not_multiples_of_16(family):
    build, skipped = FAMILIES[family]
    model = build()
    linears = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    assert converted_names(model) == linears - skipped and skipped < linears
    assert not any("embeddings" in name or "decoder" in name for name in linears)  # tied: F.linear, no module


def test_the_filter_skips_embeddings_and_an_untied_decoder_by_name():
    assert float8_module_filter(nn.Linear(32, 32), "bert.encoder.layer.0.intermediate.dense")
    assert not float8_module_filter(nn.Linear(32, 32), "cls.predictions.decoder")  # HF's BERT: an nn.Linear
    assert not float8_module_filter(nn.Linear(32, 32), "bert.embeddings.projection")
    assert not float8_module_filter(nn.Embedding(40, 32), "bert.embeddings.word_embeddings")


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_to_float8_swaps_exactly_the_picked_linears_and_keeps_parameters_and_state_dict_keys(family):
    float8_linear = pytest.importorskip("torchao.float8.float8_linear").Float8Linear
    build, skipped = FAMILIES[family]
    model = build()
    picked, keys, parameters = converted_names(model), set(model.state_dict()), list(model.parameters())
    assert convert_to_float8(model) is model
    assert all(a is b for a, b in zip(model.parameters(), parameters, strict=True))  # an optimizer built before holds
    modules = dict(model.named_modules())
    assert {name for name, module in modules.items() if isinstance(module, float8_linear)} == picked
    assert all(type(modules[name]) is nn.Linear for name in skipped)
    assert set(model.state_dict()) == keys


def float8_device() -> torch.device:
    """Where float8 trains for real here: a CUDA GPU with float8 tensor cores, else the CPU (torch's float8 matmul
    `_scaled_mm` runs there too: the same conversion, casts and scales, without the speed)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        return torch.device("cuda")
    return torch.device("cpu")


def training_pair(family: str):
    """(bf16 model, its float8 copy, a packed micro-batch as the loader hands it), on float8_device()."""
    from tests.test_compile import FAMILIES as COMPILE_FAMILIES, micro_batch

    build, host_indices = COMPILE_FAMILIES[family]  # hidden 32, feed-forward 48: both multiples of 16
    torch.manual_seed(0)
    device = float8_device()
    reference = build().to(device).train()
    model = copy.deepcopy(reference)
    convert_to_float8(model)
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v
             for k, v in host_indices(micro_batch(1, packed=False)).items()}
    return reference, model, batch


def bf16_loss(model, batch):
    from workflow.train.pretrain import pretraining_forward

    with autocast(batch["input_ids"].device, "bf16"):
        return pretraining_forward(model, batch)["loss"].float()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_float8_model_trains_like_bf16_on_the_training_forward(family):
    """The training forward (pretraining_forward on the loader's batch) of a float8 copy: its first loss within 1%
    of the bf16 model's, finite gradients, and 12 AdamW steps on one batch bring both down alike (within 3%; seen
    on CPU: at most 0.07% and 0.25%)."""
    pytest.importorskip("torchao.float8")
    reference, model, batch = training_pair(family)
    curves = []
    for network in (reference, model):
        optimizer = torch.optim.AdamW(network.parameters(), lr=3e-3)
        losses = []
        for _ in range(12):
            loss = bf16_loss(network, batch)
            loss.backward()
            assert all(torch.isfinite(p.grad).all() for p in network.parameters() if p.grad is not None)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        curves.append(losses)
    (bf16_first, *_, bf16_last), (float8_first, *_, float8_last) = curves
    assert abs(float8_first - bf16_first) < 0.01 * bf16_first, curves
    assert bf16_last < 0.8 * bf16_first and abs(float8_last - bf16_last) < 0.03 * bf16_last, curves


@pytest.mark.parametrize("family", FAMILIES)
def test_a_compiled_float8_model_is_one_graph_without_a_break_and_equals_eager_float8(family):
    """torch.compile over the float8 copy (aot_eager: the graph inductor would get; float8_device's kernels): one
    graph, no break, the loss of the eager float8 model (bf16 rounding)."""
    pytest.importorskip("torchao.float8")
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    _, model, batch = training_pair(family)
    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, dynamic=False)
    eager, traced = float(bf16_loss(model, batch)), float(bf16_loss(compiled, batch))
    torch._dynamo.reset()
    assert counter.frame_count == 1 and dict(counters["graph_break"]) == {}
    assert traced == pytest.approx(eager, rel=1e-2)
