"""Settings are read once from the validated config into typed objects whose only defaults are the schema's."""
import yaml

from workflow.config import PHASES, SCHEMA


def test_the_phases_are_the_schemas_phase_sections_in_order():
    properties = yaml.safe_load(SCHEMA.read_text())["properties"]
    for section, definition in (("pretrain", "phase_training"), ("encode", "phase_data")):
        phases = [name for name, value in properties[section]["properties"].items()
                  if value.get("$ref") == f"#/definitions/{definition}"]
        assert tuple(phases) == PHASES
    assert properties["scaling"]["properties"]["phases"]["items"]["enum"] == list(PHASES)
