"""Float8 training (workflow/train/float8.py): refused by name where it cannot run; the filter converts the
encoder's matmuls of a tiny BERT and leaves its embeddings, decoder and small classifier alone."""
import pytest
import torch
from torch import nn

from workflow.train.float8 import convert_to_float8, float8_error, float8_module_filter
from workflow.train.models.bert import BertConfig, BertForPreTraining
from workflow.train.models.modernbert import ModernBertConfig, ModernBertForMaskedLM


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


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="float8 matmuls need a CUDA GPU of compute capability 8.9 or newer")
def test_a_float8_bert_trains_a_step_on_the_gpu_close_to_bf16():
    """Loss of a float8 BERT (hidden 256) within 5% of the same model's in bf16 autocast, finite gradients."""
    pytest.importorskip("torchao.float8")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=1024, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=1024)
    reference = BertForPreTraining(config).cuda()
    model = BertForPreTraining(config).cuda()
    model.load_state_dict(reference.state_dict())
    assert float8_error(torch.device("cuda")) is None
    convert_to_float8(model)
    input_ids = torch.randint(0, 1024, (16, 128), device="cuda")
    batch = (input_ids, torch.zeros_like(input_ids), torch.ones_like(input_ids),
             torch.arange(0, 128, 8, device="cuda").expand(16, -1))
    labels = torch.randint(0, 1024, (16, 16), device="cuda")
    losses = []
    for network in (reference, model):
        with torch.autocast("cuda", torch.bfloat16):
            mlm_logits, _ = network(*batch)
        loss = nn.functional.cross_entropy(mlm_logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in network.parameters() if p.grad is not None)
        losses.append(float(loss))
    assert abs(losses[1] - losses[0]) < 0.05 * losses[0], losses
