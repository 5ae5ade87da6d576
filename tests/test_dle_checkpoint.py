"""NVIDIA DLE checkpoints in and out: every tensor mapped, the logits of DLE's forward after the import (DLE's GELU
of either version), a byte-equal round trip, DLE's padded vocabulary, refusals in one line, and phase 1 started
from a DLE file.

The DLE parameter names and the reference forward below are written from DLE's own model,
NVIDIA/DeepLearningExamples PyTorch/LanguageModeling/BERT/modeling.py (BertForPreTraining: LinearActivation
`dense_act` in BertIntermediate, BertPooler and BertPredictionHeadTransform; BertLayerNorm weight/bias; the decoder
tied to the word embeddings), independently of workflow/train/models/dle_checkpoint.py's mapping. DLE's "gelu" at the two
commits read (DLE_GELU):
    1d4211fe9d94550d7bc72bb9b0ac4f576533ca52 (before 2022): ACT2FN {gelu, bias_gelu, bias_tanh, relu, swish}; with a
        bias, LinearActivation runs "gelu" as bias_gelu(bias, y): x = bias + y; x * 0.5 * (1.0 + erf(x / 1.41421));
    a9e2c1d5fbf304ce4642d5b6a2f0e61cfcf1d482 (since 2022): ACT2FN {gelu, tanh, relu, swish}; gelu(x) =
        F.gelu(x, approximate=True), the tanh form 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))."""
import argparse
import json
import logging
import math

import pytest
import torch
import torch.nn.functional as F

from workflow.data.synthetic_shards import write_synthetic_shards
from tests.test_pretrain import settings
from workflow.cli import UserError, run
from workflow.data.vocab import Normalization
from workflow.train.models import dle_checkpoint
from workflow.train.models.dle_checkpoint import load_dle_checkpoint, save_dle_checkpoint
from workflow.train.models.bert import BertConfig, BertForPreTraining, load_pretrained, save_pretrained
from workflow.train.models.family import ModelSettings, family
from workflow.train.pretrain import pretrain


def build_model(preset, bert_config, init_from, vocab_size, seq_length, vocab=None):
    """The BERT family's model as the phase builds it."""
    settings = ModelSettings.from_config({"family": "bert", "preset": preset, "bert_config": bert_config,
                                          "init_from": init_from})
    return family("bert").build(settings, vocab, vocab_size, seq_length)


TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64)


def dle_shapes(vocab_rows: int, hidden=32, layers=2, intermediate=64, positions=64, types=2) -> dict:
    """DLE's BertForPreTraining.state_dict() names and shapes (modeling.py), vocab rows already padded."""
    h, i = hidden, intermediate
    shapes = {"bert.embeddings.word_embeddings.weight": (vocab_rows, h),
              "bert.embeddings.position_embeddings.weight": (positions, h),
              "bert.embeddings.token_type_embeddings.weight": (types, h),
              "bert.embeddings.LayerNorm.weight": (h,), "bert.embeddings.LayerNorm.bias": (h,)}
    for n in range(layers):
        layer = f"bert.encoder.layer.{n}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            shapes.update({layer + name + ".weight": (h, h), layer + name + ".bias": (h,)})
        shapes.update({layer + "attention.output.LayerNorm.weight": (h,), layer + "attention.output.LayerNorm.bias": (h,),
                       layer + "intermediate.dense_act.weight": (i, h), layer + "intermediate.dense_act.bias": (i,),
                       layer + "output.dense.weight": (h, i), layer + "output.dense.bias": (h,),
                       layer + "output.LayerNorm.weight": (h,), layer + "output.LayerNorm.bias": (h,)})
    shapes.update({"bert.pooler.dense_act.weight": (h, h), "bert.pooler.dense_act.bias": (h,),
                   "cls.predictions.bias": (vocab_rows,),
                   "cls.predictions.transform.dense_act.weight": (h, h),
                   "cls.predictions.transform.dense_act.bias": (h,),
                   "cls.predictions.transform.LayerNorm.weight": (h,), "cls.predictions.transform.LayerNorm.bias": (h,),
                   "cls.predictions.decoder.weight": (vocab_rows, h),
                   "cls.seq_relationship.weight": (2, h), "cls.seq_relationship.bias": (2,)})
    return shapes


def dle_state(vocab_rows: int, seed=0) -> dict:
    """A random DLE-named state dict (LayerNorm weights near 1), the decoder tied as DLE's state_dict() gives it."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in dle_shapes(vocab_rows).items():
        value = torch.randn(shape, generator=generator) * 0.2
        state[name] = value + 1 if name.endswith("LayerNorm.weight") else value
    state["cls.predictions.decoder.weight"] = state["bert.embeddings.word_embeddings.weight"]
    return state


def write_dle(path, state, **extra):
    torch.save({"model": state, "optimizer": {"state": {}, "param_groups": []}, "epoch": 1, **extra}, path)
    return path


def write_bert_config(path, vocab_size, hidden_act="gelu"):
    """A DLE bert_config.json (no layer_norm_eps: DLE's is 1e-12, ours by default)."""
    path.write_text(json.dumps({"vocab_size": vocab_size, "hidden_act": hidden_act, "hidden_dropout_prob": 0.1,
                                "attention_probs_dropout_prob": 0.1, "initializer_range": 0.02,
                                "type_vocab_size": 2, **TINY}))
    return path


DLE_GELU = {  # DLE's "gelu" at the two commits of the module doc, on x = bias + y
    "erf": lambda x: x * 0.5 * (1.0 + torch.erf(x / 1.41421)),
    "tanh": lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))}


def dle_forward(s: dict, input_ids, token_type_ids, heads=2, gelu="erf"):
    """DLE's BertForPreTraining forward (modeling.py, no padding, eval mode) on its own names, its "gelu" the `gelu`
    form: (mlm [B, L, V], nsp)."""
    def layer_norm(x, name):
        return F.layer_norm(x, x.shape[-1:], s[name + ".weight"], s[name + ".bias"], eps=1e-12)

    def linear(x, name):
        return x @ s[name + ".weight"].T + s[name + ".bias"]

    gelu = DLE_GELU[gelu]
    positions = torch.arange(input_ids.shape[1])
    x = layer_norm(s["bert.embeddings.word_embeddings.weight"][input_ids]
                   + s["bert.embeddings.position_embeddings.weight"][positions]
                   + s["bert.embeddings.token_type_embeddings.weight"][token_type_ids], "bert.embeddings.LayerNorm")
    batch, length, hidden = x.shape
    size = hidden // heads
    n = 0
    while f"bert.encoder.layer.{n}.output.dense.weight" in s:
        layer = f"bert.encoder.layer.{n}."
        q, k, v = (linear(x, layer + f"attention.self.{p}").view(batch, length, heads, size).transpose(1, 2)
                   for p in ("query", "key", "value"))
        context = (torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(size), -1) @ v).transpose(1, 2).reshape(x.shape)
        x = layer_norm(linear(context, layer + "attention.output.dense") + x, layer + "attention.output.LayerNorm")
        x = layer_norm(linear(gelu(linear(x, layer + "intermediate.dense_act")), layer + "output.dense") + x,
                       layer + "output.LayerNorm")
        n += 1
    pooled = torch.tanh(linear(x[:, 0], "bert.pooler.dense_act"))
    transformed = layer_norm(gelu(linear(x, "cls.predictions.transform.dense_act")),
                             "cls.predictions.transform.LayerNorm")
    mlm = transformed @ s["cls.predictions.decoder.weight"].T + s["cls.predictions.bias"]
    return mlm, linear(pooled, "cls.seq_relationship")


def logits(config, state, gelu):
    """(our logits, DLE's logits of the `gelu` form, DLE's of the other form) of one batch: each (mlm, nsp)."""
    model = BertForPreTraining(config).eval()
    ours = dle_checkpoint.from_dle(state, "state")
    result = model.load_state_dict(ours, strict=False)
    assert (result.missing_keys, result.unexpected_keys) == ([], [])  # every tensor mapped, none left over
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 64, (3, 16), generator=generator)
    token_type_ids = (torch.arange(16) >= 8).long().expand(3, -1)
    with torch.no_grad():
        got = model(input_ids, token_type_ids, torch.ones_like(input_ids), torch.arange(16).expand(3, -1))
    other = {"tanh": "erf", "erf": "tanh"}[gelu]
    return got, dle_forward(state, input_ids, token_type_ids, gelu=gelu), dle_forward(state, input_ids,
                                                                                        token_type_ids, gelu=other)


PARITY = 2e-5  # float32, two layers deep, on logits of up to ~4.3: ~5e-6 of the largest (measured: 3e-6 to 8e-6)


@pytest.mark.parametrize("gelu, hidden_act", [("tanh", "gelu_pytorch_tanh"), ("erf", "gelu")])
def test_an_imported_dle_checkpoint_gives_the_logits_of_dles_gelu_of_either_version(tmp_path, gelu, hidden_act):
    state = dle_state(64)
    config, _ = load_dle_checkpoint(write_dle(tmp_path / "ckpt_8601.pt", state),
                                    write_bert_config(tmp_path / "bert_config.json", 61), gelu=gelu)
    assert config.vocab_size == 64  # the checkpoint's rows: DLE padded 61 to a multiple of 8
    assert config.hidden_act == hidden_act
    (mlm, nsp), (expected_mlm, expected_nsp), (wrong_mlm, _) = logits(config, state, gelu)
    torch.testing.assert_close(mlm, expected_mlm, rtol=0, atol=PARITY)
    torch.testing.assert_close(nsp, expected_nsp, rtol=0, atol=PARITY)
    assert (mlm - wrong_mlm).abs().max() > 20 * PARITY  # the other version's GELU: the test can tell them apart


def test_dle_2020s_bias_gelu_is_read_as_the_erf_form_whatever_the_key(tmp_path):
    state = dle_state(64, seed=2)
    config, _ = load_dle_checkpoint(write_dle(tmp_path / "x.pt", state),
                                    write_bert_config(tmp_path / "c.json", 64, "bias_gelu"), gelu="tanh")
    assert config.hidden_act == "gelu"
    (mlm, _), (expected_mlm, _), _ = logits(config, state, "erf")
    torch.testing.assert_close(mlm, expected_mlm, rtol=0, atol=PARITY)


def test_a_state_dict_saved_from_ddp_is_read_without_its_module_prefix(tmp_path):
    state = dle_state(64)
    path = write_dle(tmp_path / "ddp.pt", {f"module.{k}": v for k, v in state.items()})
    _, ours = load_dle_checkpoint(path, write_bert_config(tmp_path / "c.json", 64), gelu="tanh")
    assert ours.keys() == dle_checkpoint.from_dle(state, "state").keys()
    assert torch.equal(ours["bert.pooler.dense.weight"], state["bert.pooler.dense_act.weight"])


def test_an_activation_dle_does_not_have_is_refused_in_one_line_naming_it(tmp_path):
    config = write_bert_config(tmp_path / "c.json", 64, "mish")
    with pytest.raises(UserError) as error:
        load_dle_checkpoint(write_dle(tmp_path / "x.pt", dle_state(64)), config, gelu="tanh")
    assert str(error.value) == (f"{config}: hidden_act 'mish' is not an activation of DLE's BERT (one of gelu, "
                                "bias_gelu, relu, swish, tanh)")


def test_dle_to_ours_to_dle_is_byte_equal_per_tensor(tmp_path):
    state = dle_state(64, seed=3)
    bert_config = write_bert_config(tmp_path / "bert_config.json", 61)
    for gelu in ("tanh", "erf"):  # DLE's "gelu" read as either form is written back as DLE's "gelu"
        config, ours = load_dle_checkpoint(write_dle(tmp_path / "in.pt", state), bert_config, gelu=gelu)
        model = BertForPreTraining(config)
        model.load_state_dict(ours, strict=False)
        save_dle_checkpoint(model, tmp_path / "out.pt", gelu=gelu)
        back = torch.load(tmp_path / "out.pt", weights_only=True)["model"]
        assert set(back) == set(state)
        for name, tensor in state.items():
            assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
            assert back[name].numpy().tobytes() == tensor.numpy().tobytes(), name
        written = json.loads((tmp_path / "out.json").read_text())  # DLE's --config_file
        assert written == {**config.to_dict(), "hidden_act": "gelu"}


def test_an_export_of_an_unpadded_vocab_loads_into_dles_padded_model_with_no_missing_key(tmp_path):
    config = BertConfig(vocab_size=61, **TINY)
    torch.manual_seed(0)
    model = BertForPreTraining(config)
    (tmp_path / "vocab.txt").write_text("\n".join(f"t{i}" for i in range(61)) + "\n")
    save_pretrained(model, config, tmp_path / "vocab.txt", tmp_path / "model", normalization=Normalization())
    save_dle_checkpoint(model, tmp_path / "model" / "dle_checkpoint.pt", gelu="erf")
    exported = torch.load(tmp_path / "model" / "dle_checkpoint.pt", weights_only=True)["model"]
    # What DLE's run_squad.py builds from the exported config.json: vocab_size padded from 61 to 64.
    assert json.loads((tmp_path / "model" / "config.json").read_text())["vocab_size"] == 61
    assert {k: tuple(v.shape) for k, v in exported.items()} == dle_shapes(64)
    words = exported["bert.embeddings.word_embeddings.weight"]
    assert torch.equal(words[:61], model.bert.embeddings.word_embeddings.weight) and not words[61:].any()
    assert not exported["cls.predictions.bias"][61:].any()


def test_layer_norm_gamma_beta_of_older_checkpoints_are_read(tmp_path):
    state = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
             for k, v in dle_state(64).items()}
    config, ours = load_dle_checkpoint(write_dle(tmp_path / "old.pt", state),
                                       write_bert_config(tmp_path / "c.json", 64), gelu="tanh")
    assert torch.equal(ours["bert.encoder.layer.1.output.LayerNorm.weight"],
                       state["bert.encoder.layer.1.output.LayerNorm.gamma"])
    assert not BertForPreTraining(config).load_state_dict(ours, strict=False).missing_keys


def test_tensors_that_map_to_nothing_are_listed_in_one_error(tmp_path):
    state = {**dle_state(64), "bert.encoder.layer.0.attention.self.rotary.weight": torch.zeros(2),
             "adapter.down.weight": torch.zeros(2)}
    with pytest.raises(UserError) as error:
        load_dle_checkpoint(write_dle(tmp_path / "x.pt", state), write_bert_config(tmp_path / "c.json", 64),
                            gelu="tanh")
    assert str(error.value) == (
        f"{tmp_path / 'x.pt'}: 2 tensors map to no BERT parameter (another architecture, or not the config "
        f"{tmp_path / 'c.json'}?): adapter.down.weight, bert.encoder.layer.0.attention.self.rotary.weight")


@pytest.mark.parametrize("json_vocab, message", [
    (40, "64 word embedding rows, but {c} says vocab_size 40 (DLE pads it to 40): the config of another model"),
    (None, "a DLE checkpoint holds weights only: give the bert_config.json it was trained with "
     "(config model.bert_config)")])
def test_a_dle_checkpoint_without_its_own_config_is_refused_in_one_line(tmp_path, json_vocab, message):
    path = write_dle(tmp_path / "x.pt", dle_state(64))
    config = write_bert_config(tmp_path / "c.json", json_vocab) if json_vocab else None
    with pytest.raises(UserError) as error:
        load_dle_checkpoint(path, config, gelu="tanh")
    assert str(error.value) == f"{path}: " + message.format(c=config)


def test_a_checkpoint_pickling_more_than_tensors_is_refused_without_unpickling_it(tmp_path):
    torch.save({"model": dle_state(64), "args": argparse.Namespace(seed=1)}, tmp_path / "old.pt")
    with pytest.raises(UserError, match=r"old\.pt: holds pickled Python objects besides tensors"):
        dle_checkpoint.read_dle_state(tmp_path / "old.pt")


def test_continuing_needs_the_checkpoints_vocabulary_padded_or_not(tmp_path):
    path = write_dle(tmp_path / "x.pt", dle_state(64))
    bert_config = str(write_bert_config(tmp_path / "c.json", 61))
    for data_vocab in (61, 64):  # DLE's 61-entry vocab padded to 64 rows, or 64 entries: the same vocab
        config, _ = build_model("tiny", bert_config, str(path), data_vocab, 32)
        assert config.vocab_size == 64
    with pytest.raises(UserError) as error:
        build_model("tiny", bert_config, str(path), 40, 32)
    assert str(error.value) == (f"model.init_from {path}: a vocabulary of 64 entries, the data's has 40: tokenize "
                                "the data with the model's own vocab (vocab.file) or start from random weights "
                                "(model.init_from: null)")


def test_continuing_an_hf_directory_on_data_of_another_vocab_of_the_same_size_is_refused(tmp_path):
    config = BertConfig(vocab_size=64, **TINY)
    (tmp_path / "theirs.txt").write_text("\n".join(f"t{i}" for i in range(64)) + "\n")
    (tmp_path / "ours.txt").write_text("\n".join(f"o{i}" for i in range(64)) + "\n")
    save_pretrained(BertForPreTraining(config), config, tmp_path / "theirs.txt", tmp_path / "model")
    build_model("tiny", None, str(tmp_path / "model"), 64, 32, str(tmp_path / "theirs.txt"))
    with pytest.raises(UserError, match=r"its vocab.txt differs from the data's .*ours.txt: tokenize the data with it "
                                        r"\(vocab.file: .*model/vocab.txt\)"):
        build_model("tiny", None, str(tmp_path / "model"), 64, 32, str(tmp_path / "ours.txt"))


def test_the_import_command_writes_an_hf_directory_with_the_given_vocab_and_casing(tmp_path):
    state = dle_state(64)
    (tmp_path / "vocab.txt").write_text("\n".join(f"T{i}" for i in range(61)) + "\n")
    run(dle_checkpoint.main, ["import", "--checkpoint", str(write_dle(tmp_path / "ckpt.pt", state)), "--bert-config",
                              str(write_bert_config(tmp_path / "c.json", 61)), "--vocab", str(tmp_path / "vocab.txt"),
                              "--no-lowercase", "--output", str(tmp_path / "model")])
    config, ours = load_pretrained(tmp_path / "model")
    assert config.vocab_size == 64
    assert torch.equal(ours["bert.encoder.layer.0.intermediate.dense.weight"],
                       state["bert.encoder.layer.0.intermediate.dense_act.weight"])
    assert json.loads((tmp_path / "model" / "tokenizer_config.json").read_text())["do_lower_case"] is False
    assert (tmp_path / "model" / "vocab.txt").read_text() == (tmp_path / "vocab.txt").read_text()


def test_phase1_starts_from_a_dle_checkpoint_and_exports_one(tmp_path, caplog):
    data = write_synthetic_shards(tmp_path / "hdf5", vocab_size=64, seq_length=32, max_predictions=5,
                                  sequences_per_shard=32)
    state = dle_state(64, seed=5)
    path = write_dle(tmp_path / "ckpt_100.pt", state)
    bert_config = str(write_bert_config(tmp_path / "bert_config.json", 64))
    config, model = build_model("tiny", bert_config, str(path), 64, 32)
    back = dle_checkpoint.to_dle(model.state_dict())
    assert all(torch.equal(back[k], v) for k, v in state.items())  # the model starts from DLE's weights
    s = settings(tmp_path, tmp_path / "out", data_dir=str(data), vocab=str(data / "vocab.txt"), total_steps=3,
                 global_batch_size=8, micro_batch_size=8, init_from=str(path), bert_config=bert_config,
                 eval_max_sequences=8)
    with caplog.at_level("INFO"):
        summary = pretrain(s)
    assert summary["steps"] == 3
    assert f"initialised from {path}" in caplog.text and "missing" not in caplog.text
    exported = torch.load(tmp_path / "out" / "model" / "dle_checkpoint.pt", weights_only=True)["model"]
    assert {k: tuple(v.shape) for k, v in exported.items()} == dle_shapes(64)
    assert not torch.equal(exported["bert.encoder.layer.0.intermediate.dense_act.weight"],
                           state["bert.encoder.layer.0.intermediate.dense_act.weight"])  # trained 3 steps
    # DLE's "gelu" read as DLE since 2022 computes it (model.dle_gelu's default): the tanh form, both ways out.
    assert json.loads((tmp_path / "out" / "model" / "config.json").read_text())["hidden_act"] == "gelu_pytorch_tanh"
    assert json.loads((tmp_path / "out" / "model" / "dle_checkpoint.json").read_text())["hidden_act"] == "gelu"


def test_the_export_command_writes_an_hf_directorys_weights_in_dles_names(tmp_path):
    config = BertConfig(vocab_size=64, **TINY)
    model = BertForPreTraining(config)
    save_pretrained(model, config, None, tmp_path / "model")
    run(dle_checkpoint.main, ["export", "--model", str(tmp_path / "model"), "--gelu", "erf", "--output",
                              str(tmp_path / "ckpt.pt")])
    exported = torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"]
    assert {k: tuple(v.shape) for k, v in exported.items()} == dle_shapes(64)
    assert torch.equal(exported["bert.pooler.dense_act.weight"], model.bert.pooler.dense.weight)
    assert json.loads((tmp_path / "ckpt.json").read_text())["hidden_act"] == "gelu"


@pytest.mark.parametrize("hidden_act, gelu, message", [
    ("gelu", "tanh", "DLE since 2022 (model.dle_gelu: tanh, its gelu the tanh form) computes no equal activation: "
     "set model.dle_gelu: erf for DLE before 2022"),
    ("gelu_pytorch_tanh", "erf", "DLE before 2022 (model.dle_gelu: erf, its gelu the erf form) computes no equal "
     "activation: set model.dle_gelu: tanh for DLE since 2022")])
def test_the_export_command_refuses_an_activation_dle_cannot_run_in_one_line(tmp_path, capsys, hidden_act, gelu,
                                                                              message):
    config = BertConfig(vocab_size=64, hidden_act=hidden_act, **TINY)
    save_pretrained(BertForPreTraining(config), config, None, tmp_path / "model")
    with pytest.raises(SystemExit) as exit_status:
        run(dle_checkpoint.main, ["export", "--model", str(tmp_path / "model"), "--gelu", gelu, "--output",
                                  str(tmp_path / "ckpt.pt")])
    assert exit_status.value.code == 1
    assert capsys.readouterr().err == f"error: {tmp_path / 'model'}: hidden_act {hidden_act!r}: {message}\n"
    assert not list(tmp_path.glob("ckpt*"))  # nothing written


def test_an_export_dle_cannot_run_exactly_gets_the_weights_alone_and_a_warning(tmp_path, caplog):
    model = BertForPreTraining(BertConfig(vocab_size=64, **TINY))  # the erf GELU, as our presets
    with caplog.at_level(logging.WARNING):
        dle_checkpoint.save_dle_export(model, tmp_path, gelu="tanh")
    exported = torch.load(tmp_path / "dle_checkpoint.pt", weights_only=True)["model"]
    assert {k: tuple(v.shape) for k, v in exported.items()} == dle_shapes(64)
    assert not (tmp_path / "dle_checkpoint.json").exists()
    assert (f"{tmp_path / 'dle_checkpoint.pt'}: the weights only, no dle_checkpoint.json (DLE would run them with its "
            "own activation): hidden_act 'gelu': DLE since 2022") in caplog.text
