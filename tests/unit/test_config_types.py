"""Command-line overrides (`snakemake --config 'train={"gpus": 8}'`) reach the schema with the types it wants."""
import copy
from pathlib import Path

import jsonschema
import pytest
import yaml

from pretrain_bench.config.schema import coerce_command_line_types, fill_defaults_and_validate, load_schema

ROOT = Path(__file__).resolve().parents[2]

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

    from pretrain_bench.config.schema import fill_defaults_and_validate, load_schema

    for overlay in ({}, yaml.safe_load((ROOT / "config" / "tiny-cpu.yaml").read_text())):
        config = yaml.safe_load((ROOT / "config.yaml").read_text())
        for key, value in overlay.items():
            config[key] = {**config[key], **value} if isinstance(value, dict) else value
        del config["train"]["max_steps"]  # a key with a schema default; config.yaml leaves out evaluate.device
        theirs = copy.deepcopy(config)
        validate(theirs, str(SCHEMA))
        assert fill_defaults_and_validate(config, load_schema(SCHEMA)) == theirs
        assert "max_steps" in config["train"] and "device" in config["evaluate"]

    config["train"]["micro_batch_size"] = "eight"  # (train.gpus takes the string auto)
    with pytest.raises(jsonschema.ValidationError, match="'eight' is not of type 'integer'"):
        fill_defaults_and_validate(config, load_schema(SCHEMA))


def test_settings_built_in_code_take_the_schemas_defaults():
    """The schema is the one place defaults are written: settings made without a config equal those read from a
    minimal config that validation filled in."""
    from pretrain_bench.bench.matrix import BenchSettings
    from pretrain_bench.config.schema import ModelSettings, schema_defaults
    from pretrain_bench.evaluate.evaluation import EvalSettings, GenerationSettings
    from pretrain_bench.train.settings import TrainSettings

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
    bench, defaults = BenchSettings.from_config(config), schema_defaults("benchmark")
    assert {key: getattr(bench, key) for key in defaults if key != "matrix"} == \
        {key: value for key, value in defaults.items() if key != "matrix"}
    assert ModelSettings.from_config(config["model"]) == ModelSettings(preset="tiny")


# Keys config.yaml sets to their schema default on purpose: they define the source articles' experiment, so a reader
# of config.yaml sees them. Every other key it sets departs from the schema's default (or has none).
DEFINES_THE_EXPERIMENT = {
    "model.seq_len", "train.engine", "train.comm_backend", "train.memory_fit",
    "train.micro_batch_size", "train.grad_accum_steps", "train.global_batch_size", "train.max_steps",
    "benchmark.device_memory_gib", "benchmark.assumed_gpu", "report.target_corpus_tokens"}


def test_config_yaml_sets_only_what_defines_the_experiment_and_departs_from_the_schema():
    """The schema is the one home of defaults: config.yaml restates none of them, beyond the keys named above."""
    schema = load_schema(SCHEMA)

    def restated(values: dict, node: dict, prefix: str = "") -> list[str]:
        found = []
        for key, value in values.items():
            sub = node["properties"][key]
            if isinstance(value, dict) and "properties" in sub:
                found += restated(value, sub, f"{prefix}{key}.")
            elif "default" in sub and sub["default"] == value:
                found.append(prefix + key)
        return found

    written = yaml.safe_load((ROOT / "config.yaml").read_text())
    assert set(restated(written, schema)) == DEFINES_THE_EXPERIMENT


def test_the_config_becomes_every_blocks_settings_once_and_is_checked_then():
    from pretrain_bench.config.schema import ConfigError, CorpusSettings
    from pretrain_bench.workflow.experiment import Config, load_config

    config = load_config(ROOT / "config.yaml", ROOT / "config" / "tiny-cpu.yaml")
    settings = Config.from_config(config)
    assert settings.name == "tiny-cpu" and settings.train.gpus == 3 and settings.model.preset == "tiny"
    assert settings.corpus == CorpusSettings.from_config(config["corpus"]) and settings.shards.count == 2
    assert settings.corpus.as_dict() == config["corpus"]  # what rule download_corpus hands its script
    assert list(settings.evaluate.prompts) == config["evaluate"]["prompts"]
    assert settings.benchmark.matrix["gpus"] == [1, 2, 3] and settings.report.peak_tflops is None
    with pytest.raises(ConfigError, match="train.warmup_steps 160 is not below train.max_steps 160"):
        Config.from_config({**config, "train": {**config["train"], "warmup_steps": 160}})
    with pytest.raises(ConfigError, match="benchmark.warmup_steps 8 leaves no timed step"):
        Config.from_config({**config, "benchmark": {**config["benchmark"], "warmup_steps": 8}})


def test_key_groups_are_the_fields_metadata():
    """The groups of train keys (what a resume fingerprints, what a benchmark cell drops, what trains further, what
    train.memory_fit may change) are tags on TrainSettings' fields, and the resume fingerprint they decide is the one
    earlier runs' checkpoints carry."""
    from pretrain_bench.config.schema import ModelSettings, keys_with
    from pretrain_bench.train.checkpoints.run_state import fingerprint_id, resume_fingerprint
    from pretrain_bench.train.plan import PLANNING_KEYS, Plan, RunPaths
    from pretrain_bench.train.settings import (
        CELL_IRRELEVANT_KEYS,
        FIT_KEYS,
        RESUMABLE_KEYS,
        TRAINS_FURTHER_KEYS,
        TrainSettings,
    )
    from support import bare_plan_config

    assert set(RESUMABLE_KEYS) == {
        "max_steps", "max_tokens", "checkpoint_every", "keep_checkpoints", "max_restarts", "warmup_timing_steps",
        "allow_reshape", "gpus", "nodes", "global_batch_size", "rdzv_endpoint", "memory_fit", "nvme_path",
        "collective_timeout_min", "nccl_env", "verify_checkpoints", "phase_timing", "eval_every", "eval_tokens",
        "deepspeed", "compile", "loggers", "tracker_project", "rank_start"}
    assert CELL_IRRELEVANT_KEYS == ("checkpoint_every", "keep_checkpoints", "max_restarts", "allow_reshape",
                                    "eval_every", "eval_tokens", "loggers", "tracker_project")
    assert TRAINS_FURTHER_KEYS == ("max_steps", "max_tokens")
    assert FIT_KEYS == ("zero_stage", "offload_optimizer", "offload_param", "activation_checkpointing",
                        "micro_batch_size", "grad_accum_steps")  # the order of plan.json's memory_fit.asked
    assert keys_with(TrainSettings, "no such tag") == ()
    assert PLANNING_KEYS == ("force", "device_memory_gib", "host_memory_gib", "disk_gib")  # benchmark keys
    plan = Plan(name="run", role="pretrain", config=bare_plan_config(TrainSettings()), device_request="cpu",
                train=TrainSettings(),
                model=ModelSettings(preset="tiny"), init_from=None, data_sha256="0" * 64,
                paths=RunPaths(index="", tokenizer="", out_dir="", state_dir="", manifest=None), resume=True,
                save_checkpoints=True, peak_tflops=None, peak=None, measure_comm=True, memory_fit={})
    assert fingerprint_id(resume_fingerprint(plan)) == "39aa21b7b7eb"
