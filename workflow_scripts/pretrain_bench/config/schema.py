"""The config against its schema: command-line overrides with the types the schema asks for, defaults, validation,
and the typed settings built from the validated config.

Defaults have one home, the schema (schemas/config.schema.yaml `default:`): validation fills them into the config,
and settings dataclasses take theirs from it (`default_field`). config.yaml names only the keys that define the
experiment and those where it departs from the schema's defaults. Code reads typed, frozen settings built once from
the validated config (`config.Config`: the blocks' settings here and `settings.TrainSettings`), never
`.get(key, default)` on the dict.

`snakemake --config 'train={"gpus": 8}'` parses a nested value with YAML's BaseLoader, which keeps every scalar a
string, so the schema would see "8" where it wants an integer. Validation fills defaults but converts no types, and
jsonschema has no coercion, so this walks the schema and turns such strings into the YAML value they spell, where
that value is of a type the key accepts. Strings meant as strings are left alone.

The Snakefile parses the schema once (`load_schema`) for both steps: Snakemake's own validate() would parse it again
with the pure-Python YAML loader, a noticeable part of a dry run.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import re
from pathlib import Path

import yaml

SCHEMA_PATH = Path(__file__).resolve().parents[3] / "schemas" / "config.schema.yaml"

_PYTHON_TYPES = {"integer": int, "number": (int, float), "boolean": bool, "null": type(None),
                 "array": list, "object": dict}


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key and the reason."""


def load_schema(schema_path: Path | str) -> dict:
    """The JSON schema in a YAML file."""
    # libyaml's loader when PyYAML has it: the pure-Python one takes a noticeable part of a dry run here
    return yaml.load(Path(schema_path).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@functools.cache
def project_schema() -> dict:
    return load_schema(SCHEMA_PATH)


def _schema_node(keys: tuple[str, ...]) -> dict:
    """The schema of config key `keys` (say ("evaluate", "generation", "top_k"))."""
    node = project_schema()
    for key in keys:
        node = node["properties"][key]
    return node


def schema_default(*keys: str):
    """The default the schema states for config key `keys`: the one place defaults are written. Validation fills
    them into a config; settings objects built in code take them from here."""
    return copy.deepcopy(_schema_node(keys)["default"])


def schema_defaults(*keys: str) -> dict:
    """The defaults of every key of the config block `keys` that has one."""
    properties = _schema_node(keys)["properties"]
    return {key: copy.deepcopy(sub["default"]) for key, sub in properties.items() if "default" in sub}


def schema_enum(*keys: str) -> tuple:
    """The values the schema allows for config key `keys` (its `enum`)."""
    return tuple(_schema_node(keys)["enum"])


def corpus_source(source: dict) -> dict:
    """A corpus.sources entry with the schema's defaults for the keys it leaves out, as validation fills them in."""
    properties = _schema_node(("corpus", "sources"))["items"]["properties"]
    return {**source, **{key: copy.deepcopy(sub["default"]) for key, sub in properties.items()
                         if "default" in sub and key not in source}}


def default_field(*keys: str, **tags):
    """A dataclass field whose default is `schema_default(*keys)` (a list becomes a tuple: frozen settings hash).

    `tags` become the field's metadata: the groups a key belongs to (see `keys_with`)."""
    value = schema_default(*keys)
    if isinstance(value, dict):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(value), metadata=tags)
    return dataclasses.field(default=tuple(value) if isinstance(value, list) else value, metadata=tags)


def keys_with(settings_class, tag: str, value=True) -> tuple[str, ...]:
    """The fields of a settings dataclass whose metadata sets `tag` to `value`, in the order they are declared:
    groups of keys (what a resume fingerprints, what a benchmark cell ignores ...) are written on the fields
    themselves, never as lists kept beside them."""
    return tuple(f.name for f in dataclasses.fields(settings_class) if tag in f.metadata and f.metadata[tag] == value)


@dataclasses.dataclass(frozen=True)
class CorpusSettings:
    """The `corpus:` block of the config (corpus.<key> in schemas/config.schema.yaml). Its field names are
    corpus.build_corpus's parameters, but for `jobs` (data.products.CORPUS_EXECUTION_KEYS)."""

    sources: tuple  # mappings: a uri and its kind's keys (pretrain_bench.data.sources)
    max_bytes: int | None = default_field("corpus", "max_bytes")
    min_chars: int = default_field("corpus", "min_chars")
    dedup: bool = default_field("corpus", "dedup")
    val_fraction: float = default_field("corpus", "val_fraction")
    encoding_errors: str = default_field("corpus", "encoding_errors")
    seed: int = default_field("corpus", "seed")
    jobs: int | None = default_field("corpus", "jobs")  # how many part jobs clean it (corpus_parts.py), not a parameter

    @classmethod
    def from_config(cls, corpus: dict) -> CorpusSettings:
        return cls(**{**corpus, "sources": tuple(corpus["sources"])})

    def as_dict(self) -> dict:
        """The block as the config holds it (sources a list)."""
        return {**dataclasses.asdict(self), "sources": [dict(source) for source in self.sources]}


class ConfigBlock:
    """A config block whose fields are exactly its keys: built from the validated block, written back as a dict."""

    @classmethod
    def from_config(cls, block: dict):
        return cls(**block)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class TokenizerSettings(ConfigBlock):
    """The `tokenizer:` block of the config (tokenizer.<key> in schemas/config.schema.yaml); what a training run
    reads of it is tagged plan=True."""

    vocab_size: int = default_field("tokenizer", "vocab_size", plan=True)
    path: str | None = default_field("tokenizer", "path", plan=True)
    train_bytes: int = default_field("tokenizer", "train_bytes")


@dataclasses.dataclass(frozen=True)
class ShardSettings(ConfigBlock):
    """The `shards:` block of the config (shards.<key> in schemas/config.schema.yaml)."""

    count: int = default_field("shards", "count")
    verify: str = default_field("shards", "verify", plan=True)  # full | sampled: how a run checks what it reads


@dataclasses.dataclass(frozen=True)
class ReportSettings(ConfigBlock):
    """The `report:` block of the config (report.<key> in schemas/config.schema.yaml); what a training run reads of it
    is tagged plan=True."""

    target_corpus_tokens: float = default_field("report", "target_corpus_tokens")
    peak_tflops: float | None = default_field("report", "peak_tflops", plan=True)
    gpu_hour_price: dict | None = default_field("report", "gpu_hour_price")  # {amount, currency} or None


@dataclasses.dataclass(frozen=True)
class EvaluateSettings:
    """The `evaluate:` block of the config (evaluate.<key> in schemas/config.schema.yaml)."""

    max_tokens: int = default_field("evaluate", "max_tokens")
    batch_size: int = default_field("evaluate", "batch_size")
    device: str | None = default_field("evaluate", "device")  # null: train.device
    precision: str = default_field("evaluate", "precision")
    export_dtype: str = default_field("evaluate", "export_dtype")
    prompts: tuple = default_field("evaluate", "prompts")
    generation: dict = dataclasses.field(default_factory=lambda: schema_defaults("evaluate", "generation"))
    lm_eval: dict = dataclasses.field(default_factory=lambda: schema_defaults("evaluate", "lm_eval"))

    @classmethod
    def from_config(cls, evaluate: dict) -> EvaluateSettings:
        return cls(**{**evaluate, "prompts": tuple(evaluate["prompts"])})


# The benchmark matrix's axes: train keys a cell may set (an axis benchmark.matrix leaves out: the main run's value).
AXES = ("gpus", "zero_stage", "precision", "comm_backend", "micro_batch_size", "offload_optimizer", "engine",
        "activation_checkpointing", "expert_parallel")


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    """The `benchmark:` block of the config (benchmark.<key> in schemas/config.schema.yaml). The keys the pre-flight
    reads (the machine it plans for, and whether to launch runs that do not fit) are tagged plan=True."""

    matrix: dict = default_field("benchmark", "matrix")  # axis -> list of values, for every axis in AXES
    enabled: bool = default_field("benchmark", "enabled")  # false: no matrix at all (a train-only run)
    steps: int = default_field("benchmark", "steps")  # optimizer steps per launch
    # steps left out of the timing (train.warmup_timing_steps of a cell)
    warmup_steps: int = default_field("benchmark", "warmup_steps")
    repeats: int = default_field("benchmark", "repeats")  # launches per cell
    # let cells share the machine (timings then contended)
    allow_concurrent: bool = default_field("benchmark", "allow_concurrent")
    # launch cells (and the main run) predicted not to fit
    force: bool = default_field("benchmark", "force", plan=True)
    # add the setups the pre-flight finds feasible for the main run's model (bench_matrix.search_entries)
    search: bool = default_field("benchmark", "search")
    # memory per GPU when none can be detected
    device_memory_gib: float = default_field("benchmark", "device_memory_gib", plan=True)
    # host RAM of the GPU machine planned for when none is detected
    host_memory_gib: float | None = default_field("benchmark", "host_memory_gib", plan=True)
    # free disk at train.nvme_path on that machine
    disk_gib: float | None = default_field("benchmark", "disk_gib", plan=True)
    # the GPU planned for when none is detected (its datasheet peak predicts run times)
    assumed_gpu: str = default_field("benchmark", "assumed_gpu")
    # cores of that machine: they run an offloaded run's host Adam
    host_cores: int | None = default_field("benchmark", "host_cores")
    lr_warmup_steps: int = 0  # train.warmup_steps of a cell: the main run's, shortened to fit the cell's steps

    @classmethod
    def from_config(cls, config: dict) -> BenchSettings:
        """From a validated config: its benchmark block, with the main run's train values for the axes the matrix
        leaves out."""
        bench, train = config["benchmark"], config["train"]
        matrix = dict(bench["matrix"])
        for axis in AXES:  # an axis the matrix leaves out keeps the main run's value; an empty list: no cells
            matrix[axis] = list(matrix[axis]) if axis in matrix and matrix[axis] is not None else [train[axis]]
        if bench["warmup_steps"] >= bench["steps"]:
            raise ConfigError(f"benchmark.warmup_steps {bench['warmup_steps']} leaves no timed step of "
                              f"benchmark.steps {bench['steps']}")
        # A cell runs benchmark.steps steps, often fewer than the main run's learning-rate warm-up; it keeps a warm-up
        # that ends before its last step (what DeepSpeed's scheduler was clamped to anyway), so that the rule
        # "train.warmup_steps below max_steps" holds for cells too.
        lr_warmup = min(train["warmup_steps"], bench["steps"] - 1)
        return cls(**{**bench, "matrix": matrix}, lr_warmup_steps=lr_warmup)


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """The `model:` block of the config. What each key means, its bounds and its default: model.<key> in
    schemas/config.schema.yaml."""

    preset: str
    seq_len: int = default_field("model", "seq_len")
    overrides: dict = default_field("model", "overrides")
    init_from: str | None = default_field("model", "init_from")
    attn_implementation: str = default_field("model", "attn_implementation", fingerprint=False)
    # not fingerprinted, like the kernel: the same state dict and the same maths, so a checkpoint resumes under either
    implementation: str = default_field("model", "implementation", fingerprint=False)

    @classmethod
    def from_config(cls, model: dict) -> ModelSettings:
        return cls(**model)

    def as_dict(self) -> dict:
        """The block as plan.json and the resume fingerprint hold it."""
        return dataclasses.asdict(self)


def coerce_command_line_types(config: dict, schema: dict | Path | str) -> dict:
    """Convert, in place, string values whose schema type is not string; returns config.

    schema: the schema (see `load_schema`) or the path of its file."""
    _coerce_object(config, schema if isinstance(schema, dict) else load_schema(schema))
    return config


def fill_defaults_and_validate(config: dict, schema: dict) -> dict:
    """Fill in, in place, the schema's defaults for absent keys, then validate; returns config.

    What Snakemake's validate(config, schema) does for a dict (jsonschema's own recipe for defaults: each object's
    defaults are set before its properties are checked), without parsing the schema file again.
    Raises jsonschema.ValidationError.
    """
    from jsonschema import validators

    checker = validators.validator_for(schema)
    check_properties = checker.VALIDATORS["properties"]

    def fill_defaults(validator, properties, instance, subschema):
        for name, property_schema in properties.items():
            if "default" in property_schema:
                # a copy: the config's mappings are filled in turn, and the schema's defaults must stay as written
                instance.setdefault(name, copy.deepcopy(property_schema["default"]))
        yield from check_properties(validator, properties, instance, subschema)

    validators.extend(checker, {"properties": fill_defaults})(schema).validate(config)
    return config


def _coerce_object(values: dict, schema: dict) -> None:
    for key, sub in (schema.get("properties") or {}).items():
        if key in values:
            values[key] = _coerce(values[key], sub)


def _coerce(value, schema: dict):
    types = schema.get("type", [])
    types = [types] if isinstance(types, str) else list(types)
    # a string where the key also takes a string, but not this one (train.gpus: an integer or "auto"): "4" is 4
    if isinstance(value, str) and types and ("string" not in types
                                             or ("pattern" in schema and not re.search(schema["pattern"], value))):
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            return value
        if isinstance(parsed, str):  # YAML 1.1 reads "1e-3" (no dot) as a string; Python reads it as a number
            for number in (int, float):
                try:
                    parsed = number(value)
                    break
                except ValueError:
                    pass
        # the types the key takes other than a string (a string it takes here failed its pattern)
        wanted = tuple(t for name in types if name != "string"
                       for t in (_PYTHON_TYPES[name] if isinstance(_PYTHON_TYPES[name], tuple)
                                 else (_PYTHON_TYPES[name],)))
        # bool is an int in Python: "true" must not pass as an integer, nor "1" as a boolean
        if isinstance(parsed, wanted) and not (isinstance(parsed, bool) and "boolean" not in types):
            return parsed
        return value
    if isinstance(value, dict):
        _coerce_object(value, schema)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_coerce(item, schema["items"]) for item in value]
    return value
