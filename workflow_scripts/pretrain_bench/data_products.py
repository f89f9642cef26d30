"""Where the data products live: the corpus, the tokenizer and the token shards belong to the settings that shape
them, not to a run's name, so every run with equal data settings shares one copy.

Each stage's folder is named by a short digest of exactly the settings that shape that stage, and sits inside the
folder of the stage it reads from:

    results/data/corpus-<c>/                                  train.jsonl, val.jsonl, manifest.json
    results/data/corpus-<c>/tokenizer-<t>/                    tokenizer.json and the HF tokenizer files
    results/data/corpus-<c>/tokenizer-<t>/shards-<s>/         {train,val}-NNNNN.bin + .json sidecars, index.json

<c> digests corpus.sources (with their pins), the cleaning keys and the split; <t> the tokenizer keys (or the adopted
tokenizer's path); <s> the shard layout. Nesting gives each product its inputs' ids too: a tokenizer edit makes a new
tokenizer (and shards) beside the same corpus, which is not cleaned again. The run's data id is the shards folder
relative to results/data (`corpus-<c>/tokenizer-<t>/shards-<s>`): it names every product the run reads. Editing a
data key makes a new id and leaves the old folders as they are. Keys that do not change the result (corpus.jobs, how
many processes clean) are left out of the digest.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from .config_types import CorpusSettings, ShardSettings, TokenizerSettings

# Part of every digest: raise it when a stage writes something else for the same settings, so that no folder
# written by the old code is taken for the new one's.
LAYOUT_VERSION = 1
ID_HEX_DIGITS = 10
# corpus.* keys that say how the corpus is built, not what it holds: never part of its id.
CORPUS_EXECUTION_KEYS = ("jobs",)


def settings_digest(stage: str, settings: dict) -> str:
    """The first ID_HEX_DIGITS hex digits of the sha256 of `settings` as canonical JSON (sorted keys)."""
    text = json.dumps({"stage": stage, "layout": LAYOUT_VERSION, "settings": settings}, sort_keys=True,
                      separators=(",", ":"), default=list)
    return hashlib.sha256(text.encode()).hexdigest()[:ID_HEX_DIGITS]


def corpus_shaping(corpus: CorpusSettings) -> dict:
    """The corpus keys its content depends on: all but CORPUS_EXECUTION_KEYS, and the mixture's seed only when the
    sources form a mixture (it orders nothing otherwise)."""
    shaping = {key: value for key, value in corpus.as_dict().items() if key not in CORPUS_EXECUTION_KEYS}
    if not any(source.get("weight") is not None for source in shaping["sources"]):
        shaping.pop("seed", None)
    return shaping


def tokenizer_shaping(tokenizer: TokenizerSettings, adopted: str | None) -> dict:
    """The tokenizer keys its files depend on: the adopted tokenizer's path, or the BPE's size and sample."""
    if adopted:
        return {"adopted": str(adopted)}
    return {"vocab_size": tokenizer.vocab_size, "train_bytes": tokenizer.train_bytes}


@dataclass(frozen=True)
class DataProducts:
    """The ids of one config's corpus, tokenizer and shards, and the paths they give."""

    corpus_id: str
    tokenizer_id: str
    shards_id: str

    @classmethod
    def from_settings(cls, corpus: CorpusSettings, tokenizer: TokenizerSettings, shards: ShardSettings,
                      adopted_tokenizer: str | None) -> DataProducts:
        return cls(corpus_id=settings_digest("corpus", corpus_shaping(corpus)),
                   tokenizer_id=settings_digest("tokenizer", tokenizer_shaping(tokenizer, adopted_tokenizer)),
                   shards_id=settings_digest("shards", shards.as_dict()))

    @classmethod
    def from_config(cls, config: dict) -> DataProducts:
        """The data products of a validated config (for code outside the workflow: tests, tools)."""
        from .tokenizer import adopted_tokenizer_path

        return cls.from_settings(CorpusSettings.from_config(config["corpus"]),
                                 TokenizerSettings.from_config(config["tokenizer"]),
                                 ShardSettings.from_config(config["shards"]), adopted_tokenizer_path(config))

    @property
    def data_id(self) -> str:
        """The shards folder relative to results/data: names the corpus, tokenizer and shards a run reads."""
        return self.shards.removeprefix("data/")

    # Each product's folder relative to results/ (and to logs/ and benchmarks/, which mirror it).
    @property
    def corpus(self) -> str:
        return f"data/corpus-{self.corpus_id}"

    @property
    def tokenizer(self) -> str:
        return f"{self.corpus}/tokenizer-{self.tokenizer_id}"

    @property
    def shards(self) -> str:
        return f"{self.tokenizer}/shards-{self.shards_id}"

    @property
    def manifest(self) -> str:
        return f"results/{self.corpus}/manifest.json"

    @property
    def tokenizer_json(self) -> str:
        return f"results/{self.tokenizer}/tokenizer.json"

    @property
    def index(self) -> str:
        return f"results/{self.shards}/index.json"

    def record(self) -> dict:
        """What a run's plan, summary and model card say of its data: the id and each product's folder."""
        return {"data_id": self.data_id, "corpus": f"results/{self.corpus}", "tokenizer": f"results/{self.tokenizer}",
                "shards": f"results/{self.shards}"}
