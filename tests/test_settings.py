"""Settings are read once from the validated config into typed objects whose only defaults are the schema's."""
import dataclasses

import pytest
import yaml

from workflow.cli import UserError
from workflow.config import PHASES, SCHEMA, pretrain_config_error, schema_defaults, validate_config


def test_the_phases_are_the_schemas_phase_sections_in_order():
    properties = yaml.safe_load(SCHEMA.read_text())["properties"]
    for section, definition in (("pretrain", "phase_training"), ("encode", "phase_data")):
        phases = [name for name, value in properties[section]["properties"].items()
                  if value.get("$ref") == f"#/definitions/{definition}"]
        assert tuple(phases) == PHASES
    assert properties["scaling"]["properties"]["phases"]["items"]["enum"] == list(PHASES)


def _schema_keys(properties: dict) -> set:
    """Every key name under `properties`, nested sections and definitions included."""
    keys = set()
    for name, value in properties.items():
        keys.add(name)
        keys |= _schema_keys(value.get("properties", {}))
    return keys


def test_no_setting_of_a_config_key_has_a_default_of_its_own_the_schemas_are_the_only_ones():
    from workflow.train.models.family import ModelSettings
    from workflow.train.pretrain import TrainSettings
    from workflow.train.settings import OptimizerSettings, PhaseSettings, PretrainSettings

    schema = yaml.safe_load(SCHEMA.read_text())
    config_keys = _schema_keys(schema["properties"]) | _schema_keys(schema["definitions"]["phase_training"]
                                                                    ["properties"])
    for section in (PhaseSettings, OptimizerSettings, PretrainSettings, ModelSettings):
        defaulted = [field.name for field in dataclasses.fields(section)
                     if field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING]
        assert defaulted == [], section
    pretrain = schema["properties"]["pretrain"]["properties"]
    assert _names(PretrainSettings) - {"optimizer"} <= set(pretrain)
    assert _names(PhaseSettings) - {"name"} <= set(schema["definitions"]["phase_training"]["properties"])
    assert _names(OptimizerSettings) - {"name"} <= set().union(*(pretrain[name]["properties"]
                                                                   for name in pretrain["optimizer"]["enum"]))
    job_values = [field.name for field in dataclasses.fields(TrainSettings) if field.default is not dataclasses.MISSING]
    assert job_values and not set(job_values) & config_keys


def _names(settings_class) -> set:
    return {field.name for field in dataclasses.fields(settings_class)}


def test_settings_built_without_a_config_take_the_schemas_defaults():
    from workflow.train.pretrain import TrainSettings

    paths = dict(data_dir="d", vocab="v", run_dir="r", out_model="m", out_metrics="x", out_summary="s")
    defaults = validate_config({})
    for phase in PHASES:
        s = TrainSettings.from_config({}, phase, **paths)
        assert s.seed == defaults["seed"] and s.model.family == defaults["model"]["family"]
        assert {key: getattr(s.phase, key) for key in defaults["pretrain"][phase]} == defaults["pretrain"][phase]
        assert (s.pretrain.eval_every, s.pretrain.eval_max_sequences) == (
            defaults["pretrain"]["eval_every"], defaults["pretrain"]["eval_max_sequences"])
        optimizer = defaults["pretrain"][defaults["pretrain"]["optimizer"]]
        assert {key: getattr(s.pretrain.optimizer, key) for key in optimizer} == optimizer
    assert schema_defaults("model") == defaults["model"]


def test_the_jobs_cross_key_check_is_the_snakefiles_function():
    from workflow.train.pretrain import TrainSettings

    config = validate_config({"pretrain": {"phase2": {"learning_rate": 1e-3, "warmup_proportion": 0.1,
                                                      "total_steps": 10, "max_steps": 20, "global_batch_size": 8,
                                                      "micro_batch_size": 4}}})
    error = pretrain_config_error(config["pretrain"])
    assert error == "config key 'pretrain.phase2.max_steps': 20 exceeds pretrain.phase2.total_steps (10)"
    with pytest.raises(UserError) as raised:
        TrainSettings.from_config(config, "phase1", data_dir="d", vocab="v", run_dir="r", out_model="m",
                                  out_metrics="x", out_summary="s")
    assert str(raised.value) == error
    smk = (SCHEMA.parent / "rules" / "common.smk").read_text()
    assert "pretrain_config_error(config[\"pretrain\"])" in smk and "schedule_config_error" not in smk


def test_the_encode_settings_read_every_key_from_the_validated_section_and_repeat_no_default():
    from workflow.data.masking_rule import ENCODE_KEYS, settings_of_config

    encode = schema_defaults("encode")
    for phase in PHASES:
        settings = settings_of_config(encode, phase)
        assert {key: getattr(settings, key) for key in ENCODE_KEYS} == {key: encode[key] for key in ENCODE_KEYS}
        assert settings.max_seq_length == encode[phase]["max_seq_length"]
    del encode["dupe_factor"]  # a section that skipped validation is not completed by a number repeated in Python
    with pytest.raises(KeyError, match="dupe_factor"):
        settings_of_config(encode, PHASES[0])
