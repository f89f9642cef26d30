"""The model families by name (`MODEL_FAMILIES`), and a shape's or a preset's family. Adding a family: its module
beside llama.py (a ModelFamily subclass with its shape type and presets), one registration here, and its presets in
the schema's model.preset enum."""
from __future__ import annotations

from pretrain_bench.train.models.family import ModelFamily
from pretrain_bench.train.models.llama import LlamaFamily

MODEL_FAMILIES: dict[str, ModelFamily] = {family.name: family for family in (LlamaFamily(),)}


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
