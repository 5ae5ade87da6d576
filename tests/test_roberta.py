"""The RoBERTa family (RoBERTa and XLM-R): Hugging Face parity (both model types, eager and sdpa, padding, gradients),
positions offset past the padding index, packed rows = each sequence alone on both attention paths, HF loading our
export and our loading HF's own save."""
import json

import numpy as np
import pytest
import torch

from tests.test_model import NESTED_WARNING, as_batch, encoded_instances, packed_attention, randomise, run_batch  # noqa: F401
from workflow.cli import UserError
from workflow.data.pack import pack_arrays
from workflow.train.models.roberta import (RobertaConfig, RobertaForMaskedLM, load_pretrained, roberta_position_ids,
                                           save_pretrained)

transformers = pytest.importorskip("transformers")

HF_CLASSES = {"roberta": ("RobertaConfig", "RobertaForMaskedLM"),
              "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaForMaskedLM")}
PAD = 1


def small_config(model_type="roberta", **overrides) -> RobertaConfig:
    return RobertaConfig(**{**dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=64, max_position_embeddings=40, model_type=model_type),
                            **overrides})


def hf_model(config: RobertaConfig, implementation: str = "sdpa"):
    config_class, model_class = (getattr(transformers, name) for name in HF_CLASSES[config.model_type])
    fields = {k: v for k, v in config.to_dict().items() if k != "model_type"}
    return model_class(config_class(**fields, attn_implementation=implementation)).eval()


def ours_and_hf(config: RobertaConfig, implementation: str = "sdpa"):
    torch.manual_seed(0)
    ours = randomise(RobertaForMaskedLM(config)).eval()
    hf = hf_model(config, implementation)
    hf.load_state_dict(with_tied_aliases(ours.state_dict()), strict=True)
    return ours, hf


def with_tied_aliases(state: dict) -> dict:
    return {**state, "lm_head.decoder.weight": state["roberta.embeddings.word_embeddings.weight"],
            "lm_head.decoder.bias": state["lm_head.bias"]}


def padded_batch(length: int = 17, seed: int = 1):
    """Rows of HF's kind: the padding id at the padded places, the mask 0 there."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 64, (3, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, length * 2 // 3:] = 0
    attention_mask[2, length // 3:] = 0
    return input_ids.masked_fill(attention_mask == 0, PAD), attention_mask


# ---------------------------------------------------------------- Hugging Face parity


@pytest.mark.parametrize("model_type", ["roberta", "xlm-roberta"])
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_logits_equal_hfs_roberta_and_xlm_roberta_at_every_real_token(model_type, implementation):
    ours, hf = ours_and_hf(small_config(model_type), implementation)
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        expected = hf(input_ids=input_ids, attention_mask=attention_mask).logits
        got, nsp_logits = ours(input_ids, None, attention_mask)
    real = attention_mask.bool()
    assert nsp_logits is None and got.shape == expected.shape
    assert (got - expected)[real].abs().max() < 1e-5


def test_gradients_equal_hfs():
    ours, hf = ours_and_hf(small_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    input_ids, attention_mask = padded_batch()
    real = attention_mask.bool()
    ours(input_ids, None, attention_mask)[0][real].logsumexp(-1).sum().backward()
    hf(input_ids=input_ids, attention_mask=attention_mask).logits[real].logsumexp(-1).sum().backward()
    hf_parameters = dict(hf.named_parameters())
    for name, parameter in ours.named_parameters():
        assert torch.allclose(parameter.grad, hf_parameters[name].grad, atol=1e-5, rtol=1e-4), name


def test_positions_start_past_the_padding_index_as_hfs_do():
    input_ids, attention_mask = padded_batch(length=6)
    from transformers.models.roberta.modeling_roberta import RobertaEmbeddings

    expected = RobertaEmbeddings.create_position_ids_from_input_ids(input_ids, PAD)
    assert torch.equal(roberta_position_ids(input_ids, None, None, PAD), expected)
    # the data half pads with id 0 (<s> here): the mask, not the id, says what is padding
    assert torch.equal(roberta_position_ids(input_ids.masked_fill(attention_mask == 0, 0), attention_mask, None, PAD),
                       expected)
    assert roberta_position_ids(input_ids, None, None, PAD)[0].tolist() == [2, 3, 4, 5, 6, 7]


def test_token_type_ids_are_ignored_and_the_padding_position_row_stays_zero():
    config = small_config()
    model = RobertaForMaskedLM(config).eval()
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        assert torch.equal(model(input_ids, torch.ones_like(input_ids), attention_mask)[0],
                           model(input_ids, None, attention_mask)[0])
    assert not model.roberta.embeddings.position_embeddings.weight[PAD].any()
    model(input_ids, None, attention_mask)[0].sum().backward()
    assert not model.roberta.embeddings.position_embeddings.weight.grad[PAD].any()


def test_the_head_runs_at_the_prediction_slots_as_at_every_position():
    model = randomise(RobertaForMaskedLM(small_config())).eval()
    input_ids, attention_mask = padded_batch()
    positions = torch.tensor([[1, 3, 0], [2, 5, 0], [1, 0, 0]])
    valid = positions > 0
    with torch.no_grad():
        every = model(input_ids, None, attention_mask)[0]
        at_slots = model(input_ids, None, attention_mask, positions)[0]
        at_valid = model(input_ids, None, attention_mask, positions, masked_lm_valid=valid)[0]
    expected = torch.gather(every, 1, positions.unsqueeze(-1).expand(-1, -1, every.shape[-1]))
    assert torch.allclose(at_slots, expected, atol=1e-6) and torch.allclose(at_valid, expected[valid], atol=1e-6)


# ---------------------------------------------------------------- packed rows


def packed_prediction_order(packed: dict) -> list[int]:
    """The real prediction slots of packed rows (row-major) ordered as the same instances' slots unpacked: by
    (instance, position in it)."""
    keys = []
    for row, positions in enumerate(packed["masked_lm_positions"]):
        starts, lengths = packed["cls_positions"][row], packed["sequence_lengths"][row]
        for position in positions[positions > 0]:
            slot = np.flatnonzero((starts <= position) & (position < starts + lengths) & (lengths > 0))[0]
            keys.append((packed["instance_index"][row, slot], position - starts[slot]))
    return sorted(range(len(keys)), key=keys.__getitem__)


@pytest.mark.filterwarnings(NESTED_WARNING)
def test_packed_rows_give_each_prediction_the_logits_of_its_sequence_alone(packed_attention):
    torch.manual_seed(0)
    model = randomise(RobertaForMaskedLM(small_config())).eval()
    arrays = encoded_instances()
    packed = pack_arrays(arrays, max_sequences_per_pack=3, masked_lm_prob=1.0)
    logits = []
    with torch.no_grad():
        for batch in (as_batch(packed), as_batch(arrays)):
            inputs = {k: v for k, v in batch.items() if k not in ("masked_lm_labels", "next_sentence_labels")}
            logits.append(model(**inputs, masked_lm_valid=batch["masked_lm_labels"] >= 0)[0])
        loss = run_batch(model, as_batch(packed))[2]
    assert torch.allclose(logits[0][packed_prediction_order(packed)], logits[1], atol=1e-5, rtol=0)
    assert loss["nsp_count"] == 0


# ---------------------------------------------------------------- Hugging Face directories


@pytest.mark.parametrize("model_type", ["roberta", "xlm-roberta"])
def test_hf_loads_our_export_with_its_own_class_and_gives_our_logits(model_type, tmp_path):
    ours, _ = ours_and_hf(small_config(model_type))
    save_pretrained(ours, ours.config, None, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == model_type
    model_class = getattr(transformers, HF_CLASSES[model_type][1])
    assert written["architectures"] == [model_class.__name__]
    loaded = model_class.from_pretrained(tmp_path).eval()
    auto = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    assert type(auto) is model_class
    input_ids, attention_mask = padded_batch()
    real = attention_mask.bool()
    with torch.no_grad():
        expected = ours(input_ids, None, attention_mask)[0]
        for model in (loaded, auto):
            assert (model(input_ids=input_ids, attention_mask=attention_mask).logits - expected)[real].abs().max() < 1e-5


@pytest.mark.parametrize("model_type", ["roberta", "xlm-roberta"])
def test_we_load_hfs_own_save_keeping_its_model_type(model_type, tmp_path):
    hf = hf_model(small_config(model_type))
    hf.save_pretrained(tmp_path)
    config, state = load_pretrained(tmp_path)
    assert config.model_type == model_type and config == small_config(model_type)
    ours = RobertaForMaskedLM(config).eval()
    ours.load_state_dict(state, strict=True)
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        difference = ours(input_ids, None, attention_mask)[0] - hf(input_ids=input_ids,
                                                                   attention_mask=attention_mask).logits
    assert difference[attention_mask.bool()].abs().max() < 1e-5


def test_a_directory_of_another_model_type_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(UserError, match="a 'bert' model, not a RoBERTa or XLM-R one"):
        load_pretrained(tmp_path)


def test_presets_have_the_published_sizes_and_positions():
    base, large = RobertaConfig.preset("roberta-base"), RobertaConfig.preset("roberta-large")
    assert (base.hidden_size, base.num_hidden_layers, base.max_position_embeddings, base.positions) == (768, 12, 514,
                                                                                                        512)
    assert (large.hidden_size, large.num_hidden_layers, large.intermediate_size) == (1024, 24, 4096)
    parameters = sum(p.numel() for p in RobertaForMaskedLM(RobertaConfig.preset("roberta-tiny")).parameters())
    assert parameters < 10_000_000
