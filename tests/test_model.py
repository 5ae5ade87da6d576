"""The BERT model: Hugging Face parity of exported weights, import round trip, config files, padding, packed rows
(each sequence as if alone, on both packed-attention paths)."""
import json

import numpy as np
import pytest
import torch


from workflow.train.models import kit
from workflow.cli import UserError
from workflow.data.features import load_tokenizer
from workflow.data.pack import pack_arrays
from workflow.data.vocab import Normalization
from workflow.train.models.bert import (BertConfig, BertForPreTraining, BertModel, encoder_state_dict,
                                        load_pretrained, save_pretrained)
from workflow.train.models.kit import load_weights, pretraining_loss, row_attention

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


def every_position(input_ids):
    """masked_lm_positions [B, L] naming every token: our MLM logits in HF's prediction_logits shape."""
    return torch.arange(input_ids.shape[1]).expand_as(input_ids)


def randomise(model):
    """Non-trivial values everywhere (biases and LayerNorms too), so parity is not vacuous."""
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_pytorch_tanh"])  # the exact GELU; its tanh form (DLE's since 2022)
def test_exported_weights_give_identical_logits_in_hf_bert_for_pretraining(tmp_path, hidden_act):
    torch.manual_seed(0)
    config = tiny_config(hidden_act=hidden_act)
    ours = randomise(BertForPreTraining(config)).eval()
    save_pretrained(ours, config, write_vocab(tmp_path / "vocab.txt"), tmp_path / "model")
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["config.json", "model.safetensors", "vocab.txt"]
    assert json.loads((tmp_path / "model" / "config.json").read_text())["hidden_act"] == hidden_act

    hf = transformers.BertForPreTraining.from_pretrained(tmp_path / "model", attn_implementation="sdpa").eval()
    input_ids, token_type_ids, attention_mask, positions = example_inputs()
    with torch.no_grad():
        mlm, nsp = ours(input_ids, token_type_ids, attention_mask, positions)
        reference = hf(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask)
        mlm_all, _ = ours(input_ids, token_type_ids, attention_mask, every_position(input_ids))
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
        mlm, nsp = ours(input_ids, token_type_ids, attention_mask, every_position(input_ids))
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


# ---------------------------------------------------------------- packed rows

def encoded_instances(n=9, length=32, predictions=5, vocab=64, seed=4) -> dict:
    """NVIDIA-schema arrays of `n` instances of random lengths (one full), as workflow.data.encode writes them."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(6, length // 2, n)
    sizes[0] = length
    arrays = {name: np.zeros((n, length), dtype) for name, dtype in
              (("input_ids", np.int32), ("input_mask", np.int8), ("segment_ids", np.int8))}
    arrays["masked_lm_positions"] = np.zeros((n, predictions), np.int32)
    arrays["masked_lm_ids"] = np.zeros((n, predictions), np.int32)
    arrays["next_sentence_labels"] = rng.integers(0, 2, n).astype(np.int8)
    for i, size in enumerate(sizes):
        arrays["input_ids"][i, :size] = rng.integers(5, vocab, size)
        arrays["input_ids"][i, 0] = 2
        arrays["input_mask"][i, :size] = 1
        arrays["segment_ids"][i, size // 2 : size] = 1
        k = rng.integers(1, predictions + 1)
        arrays["masked_lm_positions"][i, :k] = np.sort(rng.choice(np.arange(1, size), k, replace=False))
        arrays["masked_lm_ids"][i, :k] = rng.integers(5, vocab, k)
    return arrays


def as_batch(arrays: dict) -> dict:
    """Model inputs and labels of NVIDIA-schema or packed arrays (-1 labels where nothing is predicted)."""
    tensor = {name: torch.from_numpy(array.astype(np.int64)) for name, array in arrays.items()}
    batch = {"input_ids": tensor["input_ids"], "token_type_ids": tensor["segment_ids"],
             "attention_mask": tensor["input_mask"], "masked_lm_positions": tensor["masked_lm_positions"],
             "masked_lm_labels": torch.where(tensor["masked_lm_positions"] > 0, tensor["masked_lm_ids"], -1),
             "next_sentence_labels": tensor["next_sentence_labels"]}
    if "cls_positions" in arrays:
        batch.update(position_ids=tensor["position_ids"], cls_positions=tensor["cls_positions"])
    return batch


def run_batch(model, batch):
    inputs = {k: v for k, v in batch.items() if k not in ("masked_lm_labels", "next_sentence_labels")}
    mlm, nsp = model(**inputs)
    return mlm, nsp, pretraining_loss(mlm, nsp, batch["masked_lm_labels"], batch["next_sentence_labels"])


# SDPA's CPU fallback for nested tensors builds a prototype strided nested tensor internally.
NESTED_WARNING = "ignore:The PyTorch API of nested tensors is in prototype stage"


@pytest.fixture(params=["block_diagonal", "varlen"])
def packed_attention(request, monkeypatch):
    """Both packed-attention paths run on CPU: the rows' block-diagonal mask, and unpadded variable-length."""
    monkeypatch.setattr(kit, "VARLEN_DEVICE_TYPES", ("cpu",) if request.param == "varlen" else ())
    return request.param


@pytest.mark.filterwarnings(NESTED_WARNING)
def test_each_sequence_of_a_packed_row_gives_the_logits_and_losses_it_gives_alone(packed_attention):
    torch.manual_seed(0)
    model = randomise(BertForPreTraining(tiny_config())).eval()
    arrays = encoded_instances()
    packed = pack_arrays(arrays, max_sequences_per_pack=3, masked_lm_prob=1.0)
    assert len(packed["input_ids"]) < len(arrays["input_ids"]) and (packed["sequence_lengths"] > 0).sum(1).max() == 3
    with torch.no_grad():
        mlm, nsp, loss = run_batch(model, as_batch(packed))
        _, _, unpacked_loss = run_batch(model, as_batch(arrays))
        for row, slot in zip(*np.nonzero(packed["instance_index"] >= 0)):
            i = packed["instance_index"][row, slot]
            start, size = packed["cls_positions"][row, slot], packed["sequence_lengths"][row, slot]
            alone = {name: array[i : i + 1, :size] if name in ("input_ids", "input_mask", "segment_ids")
                     else array[i : i + 1] for name, array in arrays.items()}
            alone_mlm, alone_nsp, _ = run_batch(model, as_batch(alone))
            n_predicted = (arrays["masked_lm_positions"][i] > 0).sum()
            positions = packed["masked_lm_positions"][row]
            mine = (positions > 0) & (positions >= start) & (positions < start + size)
            assert mine.sum() == n_predicted
            assert torch.allclose(mlm[row][torch.from_numpy(mine)], alone_mlm[0, :n_predicted], atol=1e-5, rtol=0)
            assert torch.allclose(nsp[row, slot], alone_nsp[0], atol=1e-5, rtol=0)
    for name in ("loss", "mlm_loss", "nsp_loss"):
        assert torch.allclose(loss[name], unpacked_loss[name], atol=1e-5, rtol=0), name
    for name in ("mlm_count", "nsp_count", "mlm_correct", "nsp_correct"):
        assert loss[name] == unpacked_loss[name], name
    assert loss["nsp_count"] == len(arrays["input_ids"])


@pytest.mark.filterwarnings(NESTED_WARNING)
@pytest.mark.parametrize("slots, n, length", [(3, 9, 32), ("auto", 40, 128)])  # auto: 42 slots, up to 7 taken
def test_packed_rows_give_the_gradients_of_the_same_instances_unpacked(packed_attention, slots, n, length):
    torch.manual_seed(0)
    config = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                         max_position_embeddings=max(64, length))
    arrays = encoded_instances(n=n, length=length, seed=5)
    gradients = []
    for batch in (as_batch(pack_arrays(arrays, slots, masked_lm_prob=1.0)), as_batch(arrays)):
        torch.manual_seed(0)
        model = randomise(BertForPreTraining(config)).train()
        run_batch(model, batch)[2]["loss"].backward()
        gradients.append({name: p.grad for name, p in model.named_parameters()})
    for name, gradient in gradients[0].items():
        assert torch.allclose(gradient, gradients[1][name], atol=1e-5, rtol=0), name


def test_batches_without_padding_attend_without_a_mask():
    full = torch.ones(2, 8, dtype=torch.long)
    assert row_attention(full, packed=False).mask is None
    assert row_attention(full, packed=True).mask is None  # one full-length sequence per row
    padded = full.clone()
    padded[1, 6:] = 0
    assert row_attention(padded, packed=False).mask.shape == (2, 1, 1, 8)
    two = torch.tensor([[1, 1, 1, 2, 2, 0]])
    expected = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                             [0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(row_attention(two, packed=True).mask[0, 0], expected)


# ---------------------------------------------------------------- MLM head at the real prediction slots only

def assert_gradients_close(gradients, expected, rtol):
    """Every parameter's gradient within `rtol` of its norm (1e-9 absolute: the key biases' gradients are
    rounding noise, as softmax ignores them)."""
    assert gradients.keys() == expected.keys()
    for name, gradient in expected.items():
        assert (gradients[name] - gradient).norm() <= rtol * gradient.norm() + 1e-9, name


def dense_and_sparse(model, batch):
    """(logits, loss, gradients) of the MLM head at every slot [B, P, V] and at the real slots only [M, V]."""
    inputs = {k: batch[k] for k in ("input_ids", "token_type_ids", "attention_mask", "masked_lm_positions",
                                    "position_ids", "cls_positions") if k in batch}
    valid = batch["masked_lm_labels"] >= 0
    results = []
    every = batch["masked_lm_labels"]
    for labels, extra in ((every, {}), (every[valid], {"masked_lm_valid": valid})):
        model.zero_grad(set_to_none=True)
        mlm, nsp = model(**inputs, **extra)
        loss = pretraining_loss(mlm, nsp, labels, batch["next_sentence_labels"])
        loss["loss"].backward()
        results.append(((mlm, nsp), loss, {name: p.grad.clone() for name, p in model.named_parameters()}))
    return results


@pytest.mark.filterwarnings(NESTED_WARNING)
@pytest.mark.parametrize("rows, varlen_devices", [("nvidia", ()), ("packed", ()), ("packed", ("cpu",))],
                         ids=["unpadded_rows", "packed_block_diagonal", "packed_varlen"])
def test_the_mlm_head_at_real_slots_only_gives_the_loss_counts_and_gradients_of_every_slot(rows, varlen_devices,
                                                                                            monkeypatch):
    from workflow.train.pretraining_data import make_batch

    monkeypatch.setattr(kit, "VARLEN_DEVICE_TYPES", varlen_devices)
    torch.manual_seed(0)
    model = randomise(BertForPreTraining(tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)))
    arrays = encoded_instances(n=12, seed=6)
    if rows == "nvidia":
        batch = make_batch(arrays, np.arange(12))
    else:
        packed = pack_arrays(arrays, max_sequences_per_pack=3, masked_lm_prob=1.0)
        # Some sequences left out (as at a micro-batch's edge): their tokens, [CLS] slots included, become padding.
        live = packed["instance_index"] >= 0
        live[0, 0] = live[-1, -1] = False
        batch = make_batch(packed, np.arange(len(packed["input_ids"])), live)
        assert (batch["attention_mask"][0] == 0).any() and batch["attention_mask"][0, batch["cls_positions"][0, 0]] == 0
    valid = batch["masked_lm_labels"] >= 0
    assert 0 < valid.sum() < valid.numel()  # empty slots exist, so the two paths do differ in work
    ((dense_logits, dense_nsp), dense, dense_grads), ((sparse_logits, sparse_nsp), sparse, sparse_grads) = \
        dense_and_sparse(model.train(), batch)
    assert sparse_logits.shape == (valid.sum(), 64)
    assert torch.allclose(sparse_logits, dense_logits[valid], rtol=1e-6, atol=1e-6)
    assert torch.allclose(sparse_nsp, dense_nsp, rtol=1e-6, atol=1e-6)  # every [CLS] slot, empty ones included
    for name in ("loss", "mlm_loss", "nsp_loss"):
        assert torch.allclose(sparse[name], dense[name], rtol=1e-6, atol=0), name
    for name in ("mlm_count", "nsp_count", "mlm_correct", "nsp_correct"):
        assert sparse[name] == dense[name], name
    assert sparse["mlm_count"] == valid.sum()
    # Sums over M rows instead of B x P (zero rows included) round differently: equal within 1e-6 of the norm.
    assert_gradients_close(sparse_grads, dense_grads, 1e-6)


def test_the_mlm_head_at_real_slots_only_trains_the_same_under_torch_compile():
    """pretrain.compile: the data-dependent slot selection breaks the graph there and still gives eager's loss and
    gradients (CPU inductor, packed rows as the pretraining data is by default)."""
    from workflow.train.pretraining_data import make_batch

    torch.manual_seed(0)
    model = randomise(BertForPreTraining(tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)))
    packed = pack_arrays(encoded_instances(n=12, seed=6), max_sequences_per_pack=3, masked_lm_prob=1.0)
    batch = make_batch(packed, np.arange(len(packed["input_ids"])))
    valid = batch["masked_lm_labels"] >= 0
    results = []
    for step_model in (model, torch.compile(model)):
        model.zero_grad(set_to_none=True)
        mlm, nsp = step_model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
                              batch["masked_lm_positions"], batch["position_ids"], batch["cls_positions"],
                              masked_lm_valid=valid)
        loss = pretraining_loss(mlm, nsp, batch["masked_lm_labels"][valid], batch["next_sentence_labels"])["loss"]
        loss.backward()
        results.append((loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    assert torch.allclose(compiled_loss, eager_loss, rtol=1e-5, atol=0)
    assert_gradients_close(compiled_grads, eager_grads, 1e-5)


@pytest.mark.parametrize("lowercase", [True, False], ids=["uncased", "cased"])
def test_the_exported_directory_loads_with_auto_tokenizer_lowercasing_as_its_vocab(tmp_path, lowercase):
    config = tiny_config()
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "Hello", "cafe", "Café", "##s"])
                     + "\n")
    save_pretrained(BertForPreTraining(config), config, vocab, tmp_path / "model",
                    normalization=Normalization(lowercase))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "model")
    ids = tokenizer("Hello Café hellos", "cafe")["input_ids"]
    expected = [2, 5, 7, 5, 9, 3, 7, 3] if lowercase else [2, 6, 8, 5, 9, 3, 7, 3]
    assert ids == expected
    assert tokenizer.convert_ids_to_tokens(tokenizer.mask_token_id) == "[MASK]"
    assert tokenizer.model_max_length == config.max_position_embeddings


@pytest.mark.parametrize("normalization", [Normalization(True, False, True), Normalization(False, True, False)],
                         ids=["uncased-accents-kept", "cased-accents-stripped-cjk-whole"])
def test_the_exported_tokenizer_normalises_as_the_data_was_tokenized(tmp_path, normalization):
    config = tiny_config()
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "Hello", "cafe", "café", "Cafe",
                                "Café", "中", "国", "中国", "##s"]) + "\n")
    save_pretrained(BertForPreTraining(config), config, vocab, tmp_path / "model", normalization=normalization)
    text = "Hello Café hellos 中国"
    ours = load_tokenizer(vocab, normalization.lowercase, normalization.strip_accents,
                          normalization.tokenize_chinese_chars).encode(text, add_special_tokens=False).ids
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "model")(text, add_special_tokens=False)
    assert theirs["input_ids"] == ours
    assert len(set(ours)) > 3  # the case distinguishes: not all [UNK]
