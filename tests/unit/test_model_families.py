"""ModelFamily: what the pipeline asks of a model (parameter count, FLOPs per token, HF config and class, building it)
through the shape's registered family, never through one architecture's functions directly."""
import ast
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

import pretrain_bench
from pretrain_bench.train.models import flops
from pretrain_bench.train.models.llama import PRESETS, LlamaFamily, ModelShape, count_parameters
from pretrain_bench.train.models.registry import MODEL_FAMILIES, model_family, preset_family

PACKAGE_DIR = Path(pretrain_bench.__file__).parent
MODELS_DIR = PACKAGE_DIR / "train" / "models"
# what only a family may call: one architecture's own functions
ARCHITECTURE_FUNCTIONS = {"count_parameters", "build_model", "llama_config", "flops_per_token", "FLOPS_FORMULA"}


def direct_architecture_imports(source: str) -> list[str]:
    return [f"line {node.lineno}: from {node.module} import {alias.name}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and node.module in ("pretrain_bench.train.models.llama",
                                                                      "pretrain_bench.train.models.flops")
            for alias in node.names if alias.name in ARCHITECTURE_FUNCTIONS]


def test_outside_the_models_package_every_model_question_goes_through_its_family():
    found = {str(path.relative_to(PACKAGE_DIR)): hits for path in PACKAGE_DIR.rglob("*.py")
             if MODELS_DIR not in path.parents and (hits := direct_architecture_imports(path.read_text()))}
    assert found == {}
    assert direct_architecture_imports("from pretrain_bench.train.models.llama import count_parameters, PRESETS\n") \
        == ["line 1: from pretrain_bench.train.models.llama import count_parameters"], "the check sees one"


def test_every_preset_has_one_family_and_a_shape_finds_its_family_by_type():
    assert list(MODEL_FAMILIES) == ["llama", "deepseek"]
    for family in MODEL_FAMILIES.values():
        for preset, shape in family.presets.items():
            assert preset_family(preset) is family and model_family(shape) is family
    assert set(PRESETS) == set(MODEL_FAMILIES["llama"].presets)
    # the schema's model.preset enum lists every family's presets, and only those
    from pretrain_bench.config.schema import schema_enum

    assert set(schema_enum("model", "preset")) == {p for f in MODEL_FAMILIES.values() for p in f.presets}
    with pytest.raises(KeyError, match="model.preset 'gpt-9' is not one of"):
        preset_family("gpt-9")
    with pytest.raises(TypeError, match="no registered model family has shapes of type dict"):
        model_family({})


def test_the_llama_family_counts_and_its_flops_follow_the_formula_it_prints():
    family, shape = MODEL_FAMILIES["llama"], PRESETS["llama-1b"]
    counts = family.count_parameters(shape)
    assert counts == count_parameters(shape) and counts["total"] == 1_100_048_384  # TinyLlama-1.1B
    head_dim = shape.hidden_size // shape.num_attention_heads
    assert family.flops_per_token(shape, 2048) == 6 * counts["matmul"] + 12 * 22 * 32 * head_dim * 2048
    assert family.flops_formula == flops.FLOPS_FORMULA and family.flops_formula.startswith("6N + 12*L*H*Q*T")
    config = family.hf_config(replace(PRESETS["tiny"], vocab_size=300), 64)
    assert family.hf_class().__name__ == family.hf_architecture == "LlamaForCausalLM"
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (4, 192, 300)


@dataclass(frozen=True)
class ToyShape(ModelShape):
    """A shape of another family (here LLaMA's fields under another type)."""


class ToyFamily(LlamaFamily):
    name, shape_type, presets = "toy", ToyShape, {"toy-1": ToyShape(2, 64, 4, 4, 128, 100)}

    def flops_per_token(self, shape, seq_len):
        return 1.0  # a family's own formula


def test_a_new_family_is_one_class_and_one_registration(monkeypatch):
    monkeypatch.setitem(MODEL_FAMILIES, "toy", ToyFamily())
    shape = ToyFamily.presets["toy-1"]
    assert model_family(shape).name == "toy" and preset_family("toy-1").name == "toy"
    assert model_family(PRESETS["tiny"]).name == "llama", "a LLaMA shape keeps its family"
    assert model_family(shape).flops_per_token(shape, 128) == 1.0
    model = model_family(shape).build(shape, 16, seed=0)
    assert sum(p.numel() for p in model.parameters()) == model_family(shape).count_parameters(shape)["total"]
