"""The BERT model: Hugging Face parity of exported weights, import round trip, config files, padding."""
import json

import pytest
import torch

from workflow.cli import UserError
from workflow.train.model import (BertConfig, BertForPreTraining, BertModel, encoder_state_dict, load_pretrained,
                            load_weights, save_pretrained)

transformers = pytest.importorskip("transformers")


def tiny_config(**overrides):
    return BertConfig(**{**dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=64, max_position_embeddings=64), **overrides})


def write_vocab(path, size=64):
    path.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(size - 5)]))
    return path


def example_inputs(vocab=64, batch=3, length=16):
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(5, vocab, (batch, length), generator=generator)
    token_type_ids = torch.zeros_like(input_ids)
    token_type_ids[:, length // 2:] = 1
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1:, 10:] = 0
    attention_mask[2:, 6:] = 0
    positions = torch.tensor([[1, 3, 5], [2, 4, 0], [1, 0, 0]])
    return input_ids, token_type_ids, attention_mask, positions


def randomise(model):
    """Non-trivial values everywhere (biases and LayerNorms too), so parity is not vacuous."""
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model


def test_exported_weights_give_identical_logits_in_hf_bert_for_pretraining(tmp_path):
    torch.manual_seed(0)
    config = tiny_config()
    ours = randomise(BertForPreTraining(config)).eval()
    save_pretrained(ours, config, write_vocab(tmp_path / "vocab.txt"), tmp_path / "model")
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["config.json", "model.safetensors", "vocab.txt"]

    hf = transformers.BertForPreTraining.from_pretrained(tmp_path / "model", attn_implementation="sdpa").eval()
    input_ids, token_type_ids, attention_mask, positions = example_inputs()
    with torch.no_grad():
        mlm, nsp = ours(input_ids, token_type_ids, attention_mask, positions)
        reference = hf(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask)
        mlm_all, _ = ours(input_ids, token_type_ids, attention_mask)
    expected_mlm = torch.gather(reference.prediction_logits, 1, positions[..., None].expand(-1, -1, 64))
    assert mlm.shape == (3, 3, 64)
    assert torch.allclose(mlm, expected_mlm, atol=1e-5, rtol=0)
    assert torch.allclose(nsp, reference.seq_relationship_logits, atol=1e-5, rtol=0)
    # All positions at once match too (padding rows included: same mask semantics as HF).
    assert torch.allclose(mlm_all, reference.prediction_logits, atol=1e-5, rtol=0)
    # The decoder is tied to the word embeddings on both sides.
    assert torch.equal(hf.cls.predictions.decoder.weight, ours.bert.embeddings.word_embeddings.weight)


def test_import_of_an_hf_directory_round_trips(tmp_path):
    torch.manual_seed(3)
    hf_config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=64, max_position_embeddings=64)
    hf = randomise(transformers.BertForPreTraining(hf_config)).eval()
    hf.save_pretrained(tmp_path / "hf")

    config, state = load_pretrained(tmp_path / "hf")
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (32, 2, 64)
    ours = BertForPreTraining(config).eval()
    missing, unexpected = load_weights(ours, state)
    assert missing == [] and unexpected == []
    input_ids, token_type_ids, attention_mask, _ = example_inputs()
    with torch.no_grad():
        mlm, nsp = ours(input_ids, token_type_ids, attention_mask)
        reference = hf(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask)
    assert torch.allclose(mlm, reference.prediction_logits, atol=1e-5, rtol=0)
    assert torch.allclose(nsp, reference.seq_relationship_logits, atol=1e-5, rtol=0)

    # ours -> directory -> ours is exact, and the encoder alone loads into BertModel.
    save_pretrained(ours, config, None, tmp_path / "again")
    config2, state2 = load_pretrained(tmp_path / "again")
    assert config2 == config
    assert state2.keys() == state.keys()
    assert all(torch.equal(state2[k], ours.state_dict()[k]) for k in state2)
    encoder = BertModel(config)
    encoder.load_state_dict(encoder_state_dict(state2))
    sequence_output, pooled = encoder.eval()(input_ids, token_type_ids, attention_mask)
    assert sequence_output.shape == (3, 16, 32) and pooled.shape == (3, 32)


def test_bert_config_json_uses_google_names_and_round_trips(tmp_path):
    config = BertConfig.preset("bert-large", vocab_size=30528)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (1024, 24, 16)
    config.to_json(tmp_path / "bert_config.json")
    data = json.loads((tmp_path / "bert_config.json").read_text())
    assert data["intermediate_size"] == 4096 and data["hidden_act"] == "gelu" and data["model_type"] == "bert"
    assert BertConfig.from_json(tmp_path / "bert_config.json") == config
    with pytest.raises(UserError, match="unknown preset 'huge'"):
        BertConfig.preset("huge")
    with pytest.raises(UserError, match="not a multiple of num_attention_heads"):
        BertConfig(hidden_size=30, num_attention_heads=4)


def test_padding_does_not_change_the_outputs_of_real_tokens():
    torch.manual_seed(0)
    model = randomise(BertModel(tiny_config())).eval()
    input_ids, token_type_ids, _, _ = example_inputs(batch=1, length=10)
    padded = torch.cat([input_ids, torch.zeros(1, 6, dtype=torch.long)], dim=1)
    padded_types = torch.cat([token_type_ids, torch.zeros(1, 6, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 10, dtype=torch.long), torch.zeros(1, 6, dtype=torch.long)], dim=1)
    with torch.no_grad():
        short, pooled_short = model(input_ids, token_type_ids, torch.ones(1, 10, dtype=torch.long))
        long, pooled_long = model(padded, padded_types, mask)
    assert torch.allclose(short, long[:, :10], atol=1e-5)
    assert torch.allclose(pooled_short, pooled_long, atol=1e-5)
