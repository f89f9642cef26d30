"""The model families by name (`MODEL_FAMILIES`), a shape's or a preset's family, and the shape a `model:` block
describes (`model_shape`). Adding a family: its module beside llama.py (a ModelFamily subclass with its shape type and
presets), one registration here, and its presets in the schema's model.preset enum."""
from __future__ import annotations

from pathlib import Path

from pretrain_bench.config.schema import ModelSettings
from pretrain_bench.train.models.deepseek import DeepseekFamily
from pretrain_bench.train.models.family import ModelFamily
from pretrain_bench.train.models.llama import LlamaFamily, init_from_shape

MODEL_FAMILIES: dict[str, ModelFamily] = {family.name: family for family in (LlamaFamily(), DeepseekFamily())}


def model_family(shape) -> ModelFamily:
    """The family a shape belongs to, by the shape's type (its exact type: a family's shape may extend another's)."""
    for family in MODEL_FAMILIES.values():
        if type(shape) is family.shape_type:
            return family
    raise TypeError(f"no registered model family has shapes of type {type(shape).__name__} "
                    f"(families: {', '.join(MODEL_FAMILIES)})")


def preset_family(preset: str) -> ModelFamily:
    """The family whose presets name `preset`."""
    for family in MODEL_FAMILIES.values():
        if preset in family.presets:
            return family
    known = sorted(name for family in MODEL_FAMILIES.values() for name in family.presets)
    raise KeyError(f"model.preset {preset!r} is not one of {known}")


def model_shape(model: ModelSettings, tokenizer_vocab: int | None = None, init_folder: Path | None = None):
    """The shape of the model a `model:` block (config or plan) describes: model.init_from's config.json when set
    (`init_folder`: where it was resolved to), else its preset's family's shape with model.overrides."""
    if model.init_from:
        return init_from_shape(model, tokenizer_vocab, init_folder)
    return preset_family(model.preset).resolve_shape(model.preset, model.overrides, tokenizer_vocab)


def model_libraries(model: ModelSettings, compile: bool) -> tuple[str, ...]:
    """What a rank imports to build the model of `model` (model.implementation of its preset's family)."""
    family = MODEL_FAMILIES["llama"] if model.init_from else preset_family(model.preset)
    return family.model_libraries(model.implementation, compile)
