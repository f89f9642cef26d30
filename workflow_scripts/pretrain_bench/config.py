"""The validated config as typed, frozen settings: one object per block, built once, right after validation.

Defaults live in the schema (see `config_types`); `Config.from_config` turns a config that validation has filled in
into the blocks' settings and rejects, naming the key, what the schema cannot express (train settings that cannot run
together, a benchmark that times nothing). The workflow builds it once (rules/common.smk) and its rules read it.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config_types import (
    BenchSettings,
    CorpusSettings,
    EvaluateSettings,
    ModelSettings,
    ReportSettings,
    ShardSettings,
    TokenizerSettings,
)
from .model import check_attention
from .settings import TrainSettings, check_settings, fill_resolved_defaults


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
    def from_config(cls, config: dict) -> Config:
        """From a validated config (the schema's defaults filled in); raises ConfigError. Writes into `config` the
        defaults that depend on other keys (settings.fill_resolved_defaults), so the dict says what the settings do."""
        fill_resolved_defaults(config)
        model, train = ModelSettings.from_config(config["model"]), TrainSettings.from_config(config["train"])
        check_settings(train, seq_len=model.seq_len)
        check_attention(model.attn_implementation, train.precision, model.implementation)
        return cls(name=config["name"], corpus=CorpusSettings.from_config(config["corpus"]),
                   tokenizer=TokenizerSettings.from_config(config["tokenizer"]),
                   shards=ShardSettings.from_config(config["shards"]), model=model, train=train,
                   evaluate=EvaluateSettings.from_config(config["evaluate"]),
                   benchmark=BenchSettings.from_config(config), report=ReportSettings.from_config(config["report"]))
