"""Command-line overrides (`snakemake --config 'train={"gpus": 8}'`) reach the schema with the types it wants."""
import copy
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

from pretrain_bench.config_types import coerce_command_line_types, fill_defaults_and_validate, load_schema  # noqa: E402

SCHEMA = ROOT / "schemas" / "config.schema.yaml"


def command_line(value: str):
    """What Snakemake's --config parser makes of a nested value: YAML's BaseLoader, every scalar a string."""
    return yaml.load(value, Loader=yaml.loader.BaseLoader)


def test_nested_overrides_get_schema_types():
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    config["train"].update(command_line('{"gpus": 8, "lr": 1e-3, "global_batch_size": null, '
                                        '"activation_checkpointing": true, "memory_fit": "strict"}'))
    config["benchmark"]["matrix"].update(command_line('{"gpus": [1, 8]}'))
    config["name"] = "123"  # a string key stays a string even when it spells a number
    assert config["train"]["gpus"] == "8"
    coerce_command_line_types(config, SCHEMA)
    assert config["train"]["gpus"] == 8 and config["train"]["lr"] == 1e-3
    assert config["train"]["global_batch_size"] is None and config["train"]["activation_checkpointing"] is True
    assert config["train"]["memory_fit"] == "strict" and config["name"] == "123"
    assert config["benchmark"]["matrix"]["gpus"] == [1, 8]
    jsonschema.validate(config, yaml.safe_load(SCHEMA.read_text()))


def test_values_of_the_wrong_kind_are_left_for_the_schema_to_reject():
    config = {"train": {"gpus": "eight", "allow_reshape": "1", "max_steps": "true"}}
    coerce_command_line_types(config, SCHEMA)
    # not numbers or booleans: untouched, so validation names the key and the bad value
    assert config["train"] == {"gpus": "eight", "allow_reshape": "1", "max_steps": "true"}


def test_defaults_and_errors_are_those_of_snakemakes_validate():
    from snakemake.utils import validate

    from pretrain_bench.config_types import fill_defaults_and_validate, load_schema

    for overlay in ({}, yaml.safe_load((ROOT / "config" / "tiny-cpu.yaml").read_text())):
        config = yaml.safe_load((ROOT / "config.yaml").read_text())
        for key, value in overlay.items():
            config[key] = {**config[key], **value} if isinstance(value, dict) else value
        del config["train"]["max_steps"], config["evaluate"]["device"]  # keys with schema defaults
        theirs = copy.deepcopy(config)
        validate(theirs, str(SCHEMA))
        assert fill_defaults_and_validate(config, load_schema(SCHEMA)) == theirs
        assert "max_steps" in config["train"] and "device" in config["evaluate"]

    config["train"]["gpus"] = "eight"
    with pytest.raises(jsonschema.ValidationError, match="'eight' is not of type 'integer'"):
        fill_defaults_and_validate(config, load_schema(SCHEMA))


def test_settings_built_in_code_take_the_schemas_defaults():
    """The schema is the one place defaults are written: settings made without a config equal those read from a
    minimal config that validation filled in."""
    from pretrain_bench.bench_matrix import BenchSettings
    from pretrain_bench.evaluation import EvalSettings, GenerationSettings
    from pretrain_bench.settings import TrainSettings

    config = {"name": "t", "corpus": {"sources": [{"uri": "builtin://python-stdlib"}]}, "tokenizer": {},
              "shards": {}, "model": {"preset": "tiny"}, "train": {}, "evaluate": {"generation": {}}, "report": {},
              "benchmark": {}}
    fill_defaults_and_validate(config, load_schema(ROOT / "schemas" / "config.schema.yaml"))
    assert TrainSettings.from_config(config["train"]) == TrainSettings()
    evaluate = config["evaluate"]
    assert GenerationSettings(**evaluate["generation"]) == GenerationSettings()
    built = EvalSettings(max_tokens=evaluate["max_tokens"], batch_size=evaluate["batch_size"],
                         device=evaluate["device"] or config["train"]["device"], precision=evaluate["precision"],
                         prompts=tuple(evaluate["prompts"]))
    assert built == EvalSettings()
    assert BenchSettings.from_config(config) == BenchSettings.from_config({**config, "benchmark": {}})
