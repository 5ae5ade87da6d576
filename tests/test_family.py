"""model.family: each family builds, continues and exports its own model; a key that does not apply is refused."""
import json

import pytest
import torch

from workflow.cli import UserError
from workflow.data.vocab import train_bpe
from workflow.train.models.family import ModelSettings, family

TEXT = ("The river flows north through the valley. Its water feeds the old mill, which ground wheat for the town. "
        "In winter the river freezes and the children skate on it. ") * 40


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    directory = tmp_path_factory.mktemp("family")
    (directory / "shard_0.txt").write_text(TEXT.replace(". ", ".\n"), encoding="utf-8")
    train_bpe([directory / "shard_0.txt"], directory / "tokenizer.json", size=400)
    return directory / "tokenizer.json"


def tiny(**architecture) -> ModelSettings:
    return ModelSettings.from_config({"family": "modernbert", "preset": "modernbert-tiny",
                                      "architecture": {"num_hidden_layers": 3, **architecture}})


def test_a_modernbert_preset_takes_the_vocabs_size_and_special_ids(tokenizer_json):
    from workflow.data.tokenizer import Vocabulary

    vocab = Vocabulary.load(tokenizer_json)
    config, _ = family("modernbert").build(tiny(local_attention=16), str(tokenizer_json), vocab.size, 128)
    assert config.vocab_size == (vocab.size + 7) // 8 * 8
    assert (config.pad_token_id, config.cls_token_id, config.sep_token_id) == (vocab.pad, vocab.cls, vocab.sep)
    assert (config.num_hidden_layers, config.local_attention) == (3, 16)


def hf_logits(directory, input_ids, attention_mask):
    from transformers import AutoModelForMaskedLM

    hf = AutoModelForMaskedLM.from_pretrained(directory, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(input_ids=input_ids, attention_mask=attention_mask).logits


def test_the_export_loads_in_hf_and_gives_our_logits(tokenizer_json, tmp_path):
    from workflow.data.tokenizer import Vocabulary

    torch.manual_seed(0)
    size = Vocabulary.load(tokenizer_json).size
    modernbert = family("modernbert")
    config, model = modernbert.build(tiny(local_attention=8), str(tokenizer_json), size, 128)
    modernbert.export(model, config, str(tokenizer_json), tmp_path / "model", None, False, "tanh")
    written = json.loads((tmp_path / "model" / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == ("modernbert", ["ModernBertForMaskedLM"])
    input_ids = torch.randint(5, size, (2, 20))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 14:] = 0
    with torch.no_grad():
        ours = model.eval()(input_ids, attention_mask=attention_mask)[0]
    theirs = hf_logits(tmp_path / "model", input_ids, attention_mask)
    real = attention_mask.bool()
    assert (ours[real] - theirs[real]).abs().max() < 1e-5

    from transformers import pipeline

    fill = pipeline("fill-mask", model=str(tmp_path / "model"), device="cpu")
    assert len(fill("The river [MASK] north.", top_k=3)) == 3


def test_continuing_an_hf_modernbert_directory_with_padded_rows_loads_every_weight(tokenizer_json, tmp_path):
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    from workflow.data.tokenizer import Vocabulary, save_tokenizer

    vocab = Vocabulary.load(tokenizer_json)
    hf_config = ModernBertConfig(vocab_size=vocab.size + 64, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                 num_attention_heads=2, local_attention=8, max_position_embeddings=256,
                                 pad_token_id=vocab.pad, cls_token_id=vocab.cls, sep_token_id=vocab.sep,
                                 bos_token_id=vocab.cls, eos_token_id=vocab.sep)
    torch.manual_seed(1)
    ModernBertForMaskedLM(hf_config).save_pretrained(tmp_path / "hf")
    save_tokenizer(tokenizer_json, tmp_path / "hf")
    settings = ModelSettings.from_config({"family": "modernbert", "preset": None, "init_from": str(tmp_path / "hf")})
    config, model = family("modernbert").build(settings, str(tokenizer_json), vocab.size, 128)
    assert (config.hidden_size, config.num_hidden_layers, config.local_attention) == (64, 4, 8)
    input_ids = torch.randint(5, vocab.size, (1, 30))
    with torch.no_grad():
        ours = model.eval()(input_ids, attention_mask=torch.ones_like(input_ids))[0]
    assert (ours - hf_logits(tmp_path / "hf", input_ids, torch.ones_like(input_ids))).abs().max() < 1e-5


@pytest.mark.parametrize("model, message", [
    ({"family": "modernbert", "preset": "bert-base"}, "model.preset: 'bert-base' is not a modernbert preset"),
    ({"family": "bert", "preset": "modernbert-base"}, "model.family: modernbert"),
    ({"family": "modernbert", "bert_config": "bert_config.json"}, "model.bert_config"),
    ({"family": "modernbert", "dle_gelu": "erf"}, "model.dle_gelu"),
    ({"family": "gpt"}, "model.family: 'gpt'"),
])
def test_a_model_key_that_does_not_apply_is_one_error_line(model, message):
    with pytest.raises(UserError, match=message.replace(".", r"\.").replace("(", r"\(")):
        ModelSettings.from_config(model)


def test_an_unknown_architecture_key_and_a_bert_directory_are_refused(tokenizer_json, tmp_path):
    with pytest.raises(UserError, match="model.architecture: window_size not a key of a modernbert config"):
        family("modernbert").build(tiny(window_size=8), str(tokenizer_json), 400, 128)
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    settings = ModelSettings.from_config({"family": "modernbert", "init_from": str(tmp_path / "bert")})
    with pytest.raises(UserError, match="a 'bert' model, not a ModernBERT one"):
        family("modernbert").build(settings, str(tokenizer_json), 400, 128)


def test_modernbert_refuses_next_sentence_data():
    family("modernbert").check_objective("full_sentences")
    with pytest.raises(UserError, match="encode.objective nsp: model.family modernbert has no next-sentence head"):
        family("modernbert").check_objective("nsp")


def test_the_bert_familys_preset_is_as_before():
    from workflow.train.models.bert import BertConfig

    config, model = family("bert").build(ModelSettings.from_config({"preset": "tiny"}), None, 100, 128)
    assert config == BertConfig.preset("tiny", vocab_size=104)
    assert family("bert").fingerprint(config) == {"model": config.to_dict()}


def test_the_preset_table_names_each_models_presets():
    from workflow.train.models import bert as model, modernbert
    from workflow.train.models.family import PRESETS

    assert set(PRESETS["bert"]) == set(model._PRESETS)
    assert set(PRESETS["modernbert"]) == set(modernbert._PRESETS)


@pytest.mark.parametrize("model, objective, message", [
    ({"family": "modernbert", "preset": "modernbert-tiny"}, "nsp", "encode.objective nsp: model.family modernbert"),
    ({"family": "modernbert", "architecture": {"hidden_size": 64}, "init_from": "x"}, "full_sentences",
     "model.architecture {'hidden_size': 64}: the model comes from x"),
    ({"family": "bert", "preset": None}, "nsp", None),
    ({"family": "bert", "theta": 320000.0}, "nsp", "config pretrain.phase2.global_rope_theta: BERT has learned"),
    ({"family": "modernbert", "theta": 320000.0}, "full_sentences", None),
])
def test_the_snakefiles_model_check(model, objective, message):
    from workflow.train.models.family import model_config_error

    theta = model.pop("theta", None)
    error = model_config_error({"model": model, "encode": {"objective": objective},
                                "pretrain": {"phase1": {}, "phase2": {"global_rope_theta": theta} if theta else {}}})
    if message is None:
        assert error is None
    else:
        assert message in error and "\n" not in error
