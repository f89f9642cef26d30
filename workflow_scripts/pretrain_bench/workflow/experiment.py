"""The validated config as typed, frozen settings: one object per block, built once, right after validation.

Defaults live in the schema (see `config.schema`); `Config.from_config` turns a config that validation has filled in
into the blocks' settings and rejects, naming the key, what the schema cannot express (train settings that cannot run
together, a benchmark that times nothing). The workflow builds it once (rules/common.smk) and its rules read it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from pretrain_bench.config.checks import check_attention
from pretrain_bench.config.schema import (
    BenchSettings,
    CorpusSettings,
    EvaluateSettings,
    ModelSettings,
    ReportSettings,
    ShardSettings,
    TokenizerSettings,
    coerce_command_line_types,
    project_schema,
)
from pretrain_bench.config.validation import validate_config
from pretrain_bench.train.engines.spec import engine_spec
from pretrain_bench.train.models.registry import check_expert_parallel
from pretrain_bench.train.plan import PlanConfig
from pretrain_bench.train.settings import TrainSettings, check_settings, resolve_gpus, resolve_zero_stage


@dataclass(frozen=True)
class Config:
    """Every block of a validated config as its settings."""

    name: str
    corpus: CorpusSettings
    tokenizer: TokenizerSettings
    shards: ShardSettings
    model: ModelSettings
    train: TrainSettings
    evaluate: EvaluateSettings
    benchmark: BenchSettings
    report: ReportSettings

    @classmethod
    def from_config(cls, config: dict, gpu_resource: int | None = None) -> Config:
        """From a validated config (the schema's defaults filled in); raises ConfigError. Writes into `config` the
        defaults that depend on other keys (fill_resolved_defaults: train.gpus auto from `gpu_resource`,
        Snakemake's `--resources gpu=N` when given), so the dict says what the settings do."""
        fill_resolved_defaults(config, gpu_resource)
        model, train = ModelSettings.from_config(config["model"]), TrainSettings.from_config(config["train"])
        check_settings(train, seq_len=model.seq_len)  # first: it names an unknown train.engine
        check_expert_parallel(model, train.expert_parallel, engine_spec(train.engine).check_expert_model)
        check_attention(model.attn_implementation, train.precision, model.implementation)
        return cls(name=config["name"], corpus=CorpusSettings.from_config(config["corpus"]),
                   tokenizer=TokenizerSettings.from_config(config["tokenizer"]),
                   shards=ShardSettings.from_config(config["shards"]), model=model, train=train,
                   evaluate=EvaluateSettings.from_config(config["evaluate"]),
                   benchmark=BenchSettings.from_config(config), report=ReportSettings.from_config(config["report"]))

    def plan_config(self, train: TrainSettings | None = None) -> PlanConfig:
        """What a training run reads of this config (the main run's; with `train`, a benchmark cell's)."""
        plan = PlanConfig.of(self.name, self.model, self.train, self.tokenizer, self.benchmark, self.report,
                             self.shards)
        return plan.for_cell(train) if train is not None else plan


def fill_resolved_defaults(config: dict, gpu_resource: int | None = None) -> dict:
    """In place, right after validation: a null train.zero_stage becomes the stage its engine implies
    (resolve_zero_stage), train.gpus a number of ranks per node (resolve_gpus, with Snakemake's `--resources gpu=N`
    as `gpu_resource` when given); returns config. Every reader of the validated config (the plan config, the
    benchmark matrix's axes, the cells) then sees what TrainSettings sees, and a DeepSpeed run that leaves the key out
    plans, fingerprints and digests as it did when the schema's default was 2."""
    train = config["train"]
    train["zero_stage"] = resolve_zero_stage(train["engine"], train["zero_stage"])
    train["gpus"] = resolve_gpus(train["gpus"], train["device"], train["nodes"], gpu_resource)
    return config


def plan_config(config: dict, train: dict | None = None) -> PlanConfig:
    """The main run's plan config of a validated config (load_config's), for code outside the workflow (tests,
    tools); `train` replaces its train block. Unlike Config.from_config it checks nothing: make_plan does."""
    return PlanConfig.of(config["name"], ModelSettings.from_config(config["model"]),
                         TrainSettings.from_config(config["train"] if train is None else train),
                         TokenizerSettings.from_config(config["tokenizer"]), BenchSettings.from_config(config),
                         ReportSettings.from_config(config["report"]), ShardSettings.from_config(config["shards"]))


def load_config(*paths: Path | str) -> dict:
    """The config of `snakemake --configfile <paths...>` after validation: the files merged in order, mapping into
    mapping as Snakemake merges them (snakemake.utils.update_config), with the schema's defaults filled in.
    For code outside the workflow (tests, tools) that needs the config the workflow sees (defaults that depend on
    other keys resolved as Config.from_config resolves them, train.gpus auto as without --resources gpu). Raises
    ConfigError with a short message naming the dotted key."""
    from snakemake.utils import update_config

    config: dict = {}
    for path in paths:
        update_config(config, yaml.safe_load(Path(path).read_text()) or {})
    schema = project_schema()
    return fill_resolved_defaults(validate_config(coerce_command_line_types(config, schema), schema))
