"""The model families by name (`MODEL_FAMILIES`), a shape's or a preset's family, and the shape a `model:` block
describes (`model_shape`). Adding a family: its module beside llama.py (a ModelFamily subclass with its shape type and
presets), one registration here, and its presets in the schema's model.preset enum."""
from __future__ import annotations

from pathlib import Path

from pretrain_bench.config.schema import ConfigError, ModelSettings
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


def check_expert_parallel(model: ModelSettings, expert_parallel: int, check_engine_model=None) -> None:
    """train.expert_parallel above 1 needs routed experts to split (a mixture-of-experts preset), built by the
    native model class (whose fused expert tensors a rank slices), and n_routed_experts divisible by it; and what
    the engine asks of the model (`check_engine_model(expert_parallel, shape, what)`: the engine spec's
    check_expert_model). Refused naming the keys. The engine and the ranks are train settings' own checks
    (settings.check_settings)."""
    if expert_parallel == 1:
        return
    family = MODEL_FAMILIES["llama"] if model.init_from else preset_family(model.preset)
    what = f"model.init_from {model.init_from}" if model.init_from else f"model.preset {model.preset}"
    try:
        # the experts do not depend on the vocabulary: any size stands in for a preset that leaves it to the tokenizer
        moe = family.memory_dims(model_shape(model, tokenizer_vocab=2)).get("moe") if not model.init_from else None
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if moe is None:
        raise ConfigError(f"train.expert_parallel {expert_parallel} needs a model with routed experts, and {what} "
                          f"({family.title}) has none: set train.expert_parallel: 1")
    if model.implementation != "native":
        raise ConfigError(f"train.expert_parallel {expert_parallel} needs model.implementation native (it splits "
                          f"the native model's fused expert tensors), not {model.implementation}")
    if moe.routed_experts % expert_parallel:
        raise ConfigError(f"train.expert_parallel {expert_parallel} does not divide the {moe.routed_experts} "
                          f"routed experts per layer of {what} (model.overrides n_routed_experts): each rank of an "
                          "expert-parallel group holds an equal share")
    if check_engine_model is not None:
        check_engine_model(expert_parallel, model_shape(model, tokenizer_vocab=2), what)
