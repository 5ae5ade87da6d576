"""The family registry is the one list of families: the schema's enums, each model module's presets and the model
types of HF directories all agree with it, and a key of one family is refused by the others in one line."""
import importlib
from pathlib import Path

import pytest
import yaml

from workflow.cli import UserError
from workflow.train.models.family import FAMILIES, PRESETS, ModelSettings, directory_family, family

SCHEMA = Path(__file__).resolve().parent.parent / "config.schema.yaml"


@pytest.fixture(scope="module")
def model_schema():
    with open(SCHEMA, encoding="utf-8") as handle:
        return yaml.safe_load(handle)["properties"]["model"]["properties"]


def test_the_schemas_family_and_preset_enums_are_the_registrys(model_schema):
    assert model_schema["family"]["enum"] == list(FAMILIES)
    assert model_schema["preset"]["enum"] == [None, *(preset for presets in PRESETS.values() for preset in presets)]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_familys_presets_are_its_model_modules(name):
    module = importlib.import_module(family(name).module_name)
    assert set(PRESETS[name]) == set(module._PRESETS)
    assert ModelSettings.from_config({"family": name}).preset_name == PRESETS[name][0]


@pytest.mark.parametrize("name, model_type", [(name, model_type) for name, each in FAMILIES.items()
                                              for model_type in each.model_types])
def test_an_hf_directory_finds_its_family_by_model_type(name, model_type, tmp_path):
    (tmp_path / "config.json").write_text(f'{{"model_type": "{model_type}"}}')
    assert directory_family(tmp_path) is family(name)


def test_the_roberta_familys_model_types_are_its_modules():
    from workflow.train.models.roberta import MODEL_TYPES

    assert family("roberta").model_types == tuple(MODEL_TYPES)


@pytest.mark.parametrize("model, message", [
    ({"family": "roberta", "preset": "bert-base"},
     "'bert-base' is not a roberta preset (one of roberta-base, roberta-large, roberta-tiny); a BERT preset needs "
     "model.family: bert"),
    ({"family": "bert", "preset": "roberta-base"}, "a RoBERTa preset needs model.family: roberta"),
    ({"family": "roberta", "bert_config": "bert_config.json"}, "model.bert_config: a BERT config file does not apply "
                                                               "to model.family: roberta"),
    ({"family": "roberta", "dle_gelu": "erf"}, "model.dle_gelu: NVIDIA DLE checkpoints are read by model.family: bert"),
    ({"family": "roberta", "init_from": "config.schema.yaml"}, "model.family roberta starts from a Hugging Face "
                                                               "RoBERTa directory"),
    ({"family": "roberta", "theta": 1e6}, "RoBERTa has learned positions, no rotary theta; it applies to "
                                          "model.family: modernbert"),
])
def test_a_key_of_another_family_is_one_line_naming_who_takes_it(model, message):
    theta = model.pop("theta", None)
    with pytest.raises(UserError, match=message.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")):
        ModelSettings.from_config(model, global_rope_theta=theta)


@pytest.mark.parametrize("name", [name for name, each in FAMILIES.items() if "nsp" not in each.objectives])
def test_a_family_without_a_next_sentence_head_refuses_nsp_data(name):
    family(name).check_objective("documents")
    with pytest.raises(UserError, match=f"encode.objective nsp: model.family {name} has no next-sentence head"):
        family(name).check_objective("nsp")


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_has_the_fine_tuning_heads_of_squad_glue_and_the_tasks_and_all_plans_them(name):
    from workflow.train.models.family import model_config_error
    from workflow.train.models.heads import KINDS

    assert family(name).heads == KINDS and family(name).head_parts is not None
    config = {"model": {"family": name}, "encode": {"objective": "full_sentences"}, "pretrain": {},
              "squad": {"enabled": True, "init_from": None}, "glue": {"tasks": ["SST-2"], "init_from": None},
              "tasks": {"ner": {}}}
    assert model_config_error(config) is None
