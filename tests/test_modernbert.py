"""The ModernBERT family: Hugging Face parity (eager and sdpa, both thetas, sequences shorter and longer than the
window, padding), packed rows = each sequence alone on both attention paths (dense masks; the unpadded varlen path
through its CPU stand-in), HF loading our weights and config, both config eras, FLOPs, weight-decay groups."""
import json
import re

import pytest
import torch
import torch.nn.functional as F


from workflow.train.models import kit
import workflow.train.models.modernbert as modernbert
from workflow.train.models.flash_varlen import flash_varlen
from workflow.cli import UserError
from workflow.train.optim.lamb import param_groups
from workflow.train.models.bert import BertConfig, BertForPreTraining
from workflow.train.models.modernbert import (ModernBertConfig, ModernBertForMaskedLM, ModernBertModel, attended_pairs,
                                       flops_per_sequence, host_indices)
from workflow.train.optim.optimizers import make_optimizer

transformers = pytest.importorskip("transformers")

WINDOW = 8  # local_attention: a local layer sees 4 tokens each side; the long sequences below cross it


def small_config(**overrides) -> ModernBertConfig:
    # Local theta far from the global one: a swapped or shared theta shows in the logits.
    return ModernBertConfig(**{**dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                      num_attention_heads=2, local_attention=WINDOW, global_rope_theta=160000.0,
                                      local_rope_theta=10.0, max_position_embeddings=128, pad_token_id=0,
                                      eos_token_id=2, bos_token_id=1, cls_token_id=1, sep_token_id=2), **overrides})


def ours_and_hf(config: ModernBertConfig, implementation: str):
    torch.manual_seed(0)
    ours = ModernBertForMaskedLM(config).eval()
    hf = transformers.ModernBertForMaskedLM(
        transformers.ModernBertConfig(**config.to_dict(), attn_implementation=implementation)).eval()
    hf.load_state_dict(with_tied_decoder(ours.state_dict()), strict=True)
    return ours, hf


def with_tied_decoder(state: dict) -> dict:
    return {**state, "decoder.weight": state["model.embeddings.tok_embeddings.weight"]}


def padded_batch(length: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 97, (3, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, length * 2 // 3:] = 0
    attention_mask[2, length // 3:] = 0
    return input_ids.masked_fill(attention_mask == 0, 0), attention_mask


# ---------------------------------------------------------------- Hugging Face parity


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("length", [WINDOW // 2 + 1, 33])  # within the window, and four windows long
def test_logits_equal_hf_modernbert_at_every_real_token(implementation, length):
    ours, hf = ours_and_hf(small_config(), implementation)
    input_ids, attention_mask = padded_batch(length)
    with torch.no_grad():
        expected = hf(input_ids=input_ids, attention_mask=attention_mask).logits
        got, nsp_logits = ours(input_ids, None, attention_mask)
    real = attention_mask.bool()
    assert nsp_logits is None and got.shape == expected.shape
    assert (got - expected)[real].abs().max() < 1e-5


def test_both_rotary_thetas_reach_the_logits():
    ours, _ = ours_and_hf(small_config(), "sdpa")
    _, swapped = ours_and_hf(small_config(global_rope_theta=10.0, local_rope_theta=160000.0), "sdpa")
    swapped.load_state_dict(with_tied_decoder(ours.state_dict()))
    input_ids, attention_mask = padded_batch(33)
    with torch.no_grad():
        assert (ours(input_ids, None, attention_mask)[0] - swapped(input_ids, attention_mask=attention_mask).logits
                ).abs().max() > 1e-3


def test_gradients_equal_hf_modernbert():
    ours, hf = ours_and_hf(small_config(), "sdpa")
    input_ids, attention_mask = padded_batch(33)
    real = attention_mask.bool()
    ours(input_ids, None, attention_mask)[0][real].logsumexp(-1).sum().backward()
    hf(input_ids=input_ids, attention_mask=attention_mask).logits[real].logsumexp(-1).sum().backward()
    hf_grads = dict(hf.named_parameters())
    for name, parameter in ours.named_parameters():
        assert torch.allclose(parameter.grad, hf_grads[name].grad, atol=1e-5, rtol=1e-4), name


def test_parameter_names_are_hfs_and_hf_loads_our_export_with_from_pretrained(tmp_path):
    from safetensors.torch import save_file

    ours, hf = ours_and_hf(small_config(), "sdpa")
    assert set(ours.state_dict()) == set(hf.state_dict()) - {"decoder.weight"}
    save_file({k: v.contiguous() for k, v in ours.state_dict().items()}, str(tmp_path / "model.safetensors"))
    ours.config.to_json(tmp_path / "config.json")
    loaded = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    input_ids, attention_mask = padded_batch(33)
    with torch.no_grad():
        difference = ours(input_ids, None, attention_mask)[0] - loaded(input_ids=input_ids,
                                                                       attention_mask=attention_mask).logits
    assert difference[attention_mask.bool()].abs().max() < 1e-5


# ---------------------------------------------------------------- packed rows, unpadded path


@pytest.fixture
def unpadded_on_cpu(monkeypatch):
    """Every batch takes the unpadded (CUDA) path on CPU, in fp32, through the varlen op's CPU reference."""
    monkeypatch.setattr(kit, "VARLEN_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(modernbert, "VARLEN_DTYPES", (torch.float16, torch.bfloat16, torch.float32))


SEQUENCES = [(0, 0, 3), (0, 3, 12), (0, 15, 20), (1, 0, 33), (2, 0, 7), (2, 7, 9), (2, 16, 13)]  # (row, start, len)


def packed_batch(length: int = 40):
    """Rows holding the SEQUENCES (row, start, length), each token's sequence number as its mask, positions from 0."""
    generator = torch.Generator().manual_seed(2)
    input_ids = torch.zeros(3, length, dtype=torch.long)
    attention_mask, position_ids = torch.zeros_like(input_ids), torch.zeros_like(input_ids)
    number = [0, 0, 0]
    for row, start, size in SEQUENCES:
        number[row] += 1
        input_ids[row, start:start + size] = torch.randint(3, 97, (size,), generator=generator)
        attention_mask[row, start:start + size] = number[row]
        position_ids[row, start:start + size] = torch.arange(size)
    cls_positions = torch.tensor([[0, 3, 15], [0, 0, 0], [0, 7, 16]])
    return input_ids, attention_mask, position_ids, cls_positions


def each_alone(model, input_ids):
    """Logits of each of SEQUENCES run alone as a row of its own, through `model` (ours or HF's)."""
    alone = []
    for row, start, size in SEQUENCES:
        ids = input_ids[row:row + 1, start:start + size]
        with torch.no_grad():
            out = model(ids, None, None)[0] if isinstance(model, ModernBertForMaskedLM) else model(input_ids=ids).logits
        alone.append(out[0])
    return alone


@pytest.mark.parametrize("path", ["rows", "unpadded"])
def test_packed_rows_give_each_sequence_the_logits_it_has_alone(request, path):
    if path == "unpadded":
        request.getfixturevalue("unpadded_on_cpu")
    ours, hf = ours_and_hf(small_config(), "eager")
    input_ids, attention_mask, position_ids, cls_positions = packed_batch()
    with torch.no_grad():
        packed = ModernBertForMaskedLM.forward(ours, input_ids, None, attention_mask, None, position_ids,
                                               cls_positions)[0]
    for (row, start, size), own, reference in zip(SEQUENCES, each_alone(ours, input_ids), each_alone(hf, input_ids)):
        assert (packed[row, start:start + size] - own).abs().max() < 1e-5
        assert (own - reference).abs().max() < 1e-5


def training_batch(input_ids, attention_mask, position_ids=None, cls_positions=None):
    """What the loader hands the model: prediction slots and labels (every third real token), through host_indices."""
    real = attention_mask > 0
    slots = [row.nonzero().squeeze(1)[::3] for row in real]
    width = max(len(s) for s in slots)
    positions = torch.zeros(len(slots), width, dtype=torch.long)
    labels = torch.full((len(slots), width), -1)
    for row, s in enumerate(slots):
        positions[row, :len(s)] = s
        labels[row, :len(s)] = input_ids[row, s]
    batch = {"input_ids": input_ids, "token_type_ids": torch.zeros_like(input_ids), "attention_mask": attention_mask,
             "masked_lm_positions": positions, "masked_lm_labels": labels}
    if cls_positions is not None:
        batch.update(position_ids=position_ids, cls_positions=cls_positions)
    return host_indices(batch)


def mlm_loss(model, batch, **inputs):
    logits, _ = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
                      batch["masked_lm_positions"], batch.get("position_ids"), batch.get("cls_positions"), **inputs)
    loss = F.cross_entropy(logits, batch["masked_lm_targets"], ignore_index=-1)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    return logits.detach(), grads


@pytest.mark.parametrize("packed", [True, False])
def test_the_unpadded_varlen_path_trains_as_the_dense_masks_do(monkeypatch, packed):
    torch.manual_seed(0)
    model = ModernBertForMaskedLM(small_config())
    batch = training_batch(*packed_batch()) if packed else training_batch(*padded_batch(33))
    dense = mlm_loss(model, batch, masked_lm_index=batch["masked_lm_index"], mask_needed=batch["mask_needed"])
    calls = []
    monkeypatch.setattr(kit, "VARLEN_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(modernbert, "VARLEN_DTYPES", (torch.float32,))
    monkeypatch.setattr(modernbert, "flash_varlen", lambda *a: calls.append(a[-1]) or flash_varlen(*a))
    unpadded = mlm_loss(model, batch, masked_lm_index=batch["masked_lm_index"],
                        unpadded=kit.unpadded_of(batch), mask_needed=batch["mask_needed"])
    assert calls == [None if kind == "full_attention" else WINDOW // 2 for kind in model.config.layer_types]
    assert (unpadded[0] - dense[0]).abs().max() < 1e-5
    for name in dense[1]:
        assert torch.allclose(unpadded[1][name], dense[1][name], atol=1e-6, rtol=1e-4), name


def test_an_all_padding_micro_batch_keeps_the_static_shapes_on_the_unpadded_path(unpadded_on_cpu):
    model = ModernBertForMaskedLM(small_config())
    zeros = torch.zeros(2, 16, dtype=torch.long)
    batch = host_indices({"input_ids": zeros, "attention_mask": zeros, "masked_lm_positions": zeros[:, :3],
                          "masked_lm_labels": torch.full((2, 3), -1)})
    assert batch["max_seqlen"] == 16 and batch["cu_seqlens"].tolist() == [0, 16, 32]
    logits, _ = model(zeros, None, zeros, zeros[:, :3], masked_lm_index=batch["masked_lm_index"],
                      unpadded=kit.unpadded_of(batch), mask_needed=batch["mask_needed"])
    assert logits.shape == (6, 97) and torch.isfinite(logits).all()


def test_attention_dropout_applies_on_the_unpadded_path(unpadded_on_cpu):
    model = ModernBertModel(small_config(attention_dropout=0.5))
    ids = torch.randint(5, 90, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        evaluated, trained = model.eval()(ids), model.train()(ids)
    assert not torch.allclose(evaluated, trained) and torch.isfinite(trained).all()


# ---------------------------------------------------------------- config


def test_config_round_trips_through_both_key_eras_and_hfs_reading(tmp_path):
    config = small_config(global_attn_every_n_layers=2, num_hidden_layers=5)
    config.to_json(tmp_path / "config.json")
    written = json.loads((tmp_path / "config.json").read_text())
    assert ModernBertConfig.from_json(tmp_path / "config.json") == config
    legacy = {k: v for k, v in written.items() if k not in ("layer_types", "rope_parameters")}  # what 4.48 writes
    modern = {k: v for k, v in written.items() if k not in ("global_rope_theta", "local_rope_theta",
                                                            "global_attn_every_n_layers")}  # what 5.x writes
    assert ModernBertConfig.from_dict(legacy) == ModernBertConfig.from_dict(modern) == config
    for data in (written, legacy, modern):
        hf = transformers.ModernBertConfig.from_dict(data)
        assert hf.layer_types == config.layer_types == ["full_attention", "sliding_attention"] * 2 + ["full_attention"]
        assert (hf.rope_parameters["full_attention"]["rope_theta"],
                hf.rope_parameters["sliding_attention"]["rope_theta"]) == (160000.0, 10.0)
        assert hf.sliding_window == config.sliding_window == WINDOW // 2
        assert ModernBertConfig.from_dict(hf.to_dict()) == config


def test_a_config_this_family_cannot_express_is_refused_in_one_line():
    with pytest.raises(UserError, match=r"^modernbert config: layer_types .* are not one global layer every N layers"):
        ModernBertConfig.from_dict({"num_hidden_layers": 3,
                                    "layer_types": ["sliding_attention", "full_attention", "full_attention"]})
    with pytest.raises(UserError, match=r"^modernbert config: rope_parameters.full_attention.rope_type 'yarn'"):
        ModernBertConfig.from_dict({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1.0}}})
    with pytest.raises(UserError, match=r"^config model.preset: unknown preset 'modernbert-huge'"):
        ModernBertConfig.preset("modernbert-huge")


def test_presets_have_the_published_sizes():
    sizes = {name: (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.intermediate_size, c.local_attention,
                    c.global_attn_every_n_layers)
             for name in ("modernbert-base", "modernbert-large", "modernbert-tiny")
             for c in [ModernBertConfig.preset(name)]}
    assert sizes["modernbert-base"] == (22, 768, 12, 1152, 128, 3)
    assert sizes["modernbert-large"] == (28, 1024, 16, 2624, 128, 3)
    assert ModernBertConfig.preset("modernbert-tiny", vocab_size=64, pad_token_id=3).vocab_size == 64


# ---------------------------------------------------------------- FLOPs, weight decay


def test_flops_count_the_glu_and_the_local_window_by_hand():
    config = ModernBertConfig(vocab_size=10, hidden_size=4, intermediate_size=6, num_hidden_layers=2,
                              num_attention_heads=1, local_attention=4, global_attn_every_n_layers=2, pad_token_id=0)
    # h=4, i=6, L=6, 2 predictions: per token and layer 2·(3·16 + 16) + 2·(2·24 + 24) = 272 (GLU: 3 h x i matmuls);
    # the global layer's 36 pairs and the local layer's 24 (3+4+5+5+4+3 keys within 2 each side) at 4·h FLOPs each;
    # the head 2·(2·16 + 2·4·10) = 224.
    assert attended_pairs(6, 2) == 24 and attended_pairs(6, None) == 36 == attended_pairs(6, 5)
    assert flops_per_sequence(config, 6, 2) == 3 * (2 * 6 * 272 + 16 * 36 + 16 * 24 + 224)
    for length, reach in ((1, 0), (9, 3), (40, 4), (5, 10)):
        index = torch.arange(length)
        assert attended_pairs(length, reach) == int(((index[:, None] - index).abs() <= reach).sum())


def test_weight_decay_groups_are_nvidias_split_for_bert_and_exempt_modernberts_norms_and_biases():
    bert = BertForPreTraining(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, max_position_embeddings=64))
    nvidia = [n for n, _ in bert.named_parameters() if n.rsplit(".", 1)[-1] == "bias" or "LayerNorm" in n]  # NVIDIA's
    names = {id(p): name for name, p in bert.named_parameters()}
    decayed, exempt = param_groups(bert, 0.01)
    assert (decayed["weight_decay"], exempt["weight_decay"]) == (0.01, 0.0)
    assert [names[id(p)] for p in exempt["params"]] == nvidia
    assert [names[id(p)] for p in decayed["params"]] == [n for n in names.values() if n not in nvidia]
    model = ModernBertForMaskedLM(small_config(norm_bias=True))
    decayed, exempt = (set(map(id, g["params"])) for g in param_groups(model, 1e-5))
    names = {id(p): name for name, p in model.named_parameters()}
    assert sorted(names[i] for i in exempt) == sorted(n for n in names.values() if "norm" in n or n.endswith("bias"))
    assert "model.embeddings.tok_embeddings.weight" in {names[i] for i in decayed}  # ModernBERT's recipe decays them
    optimizer, _ = make_optimizer("adamw", model, lr=8e-4, weight_decay=1e-5)  # the engine's AdamW: the same split
    assert [set(map(id, g["params"])) for g in optimizer.param_groups] == [decayed, exempt]


# ---------------------------------------------------------------- the benchmark


def test_the_step_benchmark_times_ours_and_hf_on_the_same_weights_and_batch(capsys):
    from benchmarks.modernbert_step import main

    main(["--repeats", "1", "--warmup", "0", "--seq", "16", "--micro-batch", "2", "--vocab", "128",
          "--base-layers", "1"])
    lines = capsys.readouterr().out.splitlines()
    for model in ("tiny", "base-small (1 layers)"):
        table = lines[next(i for i, line in enumerate(lines) if line.startswith(model)) + 2:][:3]
        assert [line.split()[0] for line in table] == ["ours", "hf", "hf"]
        losses = {re.search(r" (\d+\.\d{4})  +n/a ", line).group(1) for line in table}  # loss, then MFU on CPU
        assert len(losses) == 1, table  # the same model and batch: one loss on every side
    main(["--gpu"])  # no CUDA device here: said, and nothing run
    assert capsys.readouterr().out == "no CUDA device: GPU benchmark skipped\n"


def test_the_head_runs_at_the_prediction_slots_as_berts_does():
    torch.manual_seed(0)
    model = ModernBertForMaskedLM(small_config()).eval()
    input_ids, attention_mask = padded_batch(33)
    batch = training_batch(input_ids, attention_mask)
    positions, valid = batch["masked_lm_positions"], batch["masked_lm_labels"] >= 0
    with torch.no_grad():
        every = model(input_ids, None, attention_mask)[0]
        at_slots = model(input_ids, None, attention_mask, positions)[0]
        at_valid = model(input_ids, None, attention_mask, positions, masked_lm_valid=valid)[0]
        at_index = model(input_ids, None, attention_mask, positions, masked_lm_index=batch["masked_lm_index"],
                         mask_needed=batch["mask_needed"])[0]
    expected = torch.gather(every, 1, positions.unsqueeze(-1).expand(-1, -1, every.shape[-1]))
    assert at_slots.shape == (*positions.shape, 97) and torch.allclose(at_slots, expected, atol=1e-6)
    assert torch.allclose(at_valid, expected[valid], atol=1e-6)
    assert torch.allclose(at_index, at_slots.flatten(0, 1), atol=1e-6)


def test_weights_start_as_hfs_initialisation_draws_them():
    config = ModernBertConfig.preset("modernbert-tiny", vocab_size=512, pad_token_id=0, num_hidden_layers=8)
    torch.manual_seed(0)
    model = ModernBertForMaskedLM(config)
    std_in, std_out = config.initializer_range, config.initializer_range / (2 * config.num_hidden_layers) ** 0.5
    for name, parameter in model.named_parameters():
        if "norm" in name:
            assert torch.equal(parameter, torch.ones_like(parameter)), name
        elif name == "decoder.bias":
            assert not parameter.any()
        else:
            std = std_out if name.endswith("Wo.weight") or name == "head.dense.weight" else std_in
            assert parameter.abs().max() <= config.initializer_cutoff_factor * std + 1e-9, name
            assert 0.7 * std < parameter.std() < 1.0 * std, name  # a normal cut at 2 std keeps ~0.88 of its std
