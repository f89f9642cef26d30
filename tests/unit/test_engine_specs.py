"""EngineSpec: every engine's planning knowledge in one registered spec, and nothing outside train/engines/ branching
on an engine's name; a new engine is a spec plus a registration."""
import ast
from dataclasses import replace
from pathlib import Path

import pytest

import pretrain_bench
from pretrain_bench.bench.matrix import Cell, search_layouts
from pretrain_bench.config.schema import ConfigError
from pretrain_bench.report.tables import engine_label
from pretrain_bench.train.engines.spec import ENGINE_SPECS, ENGINES, DDPSpec, engine_spec, resolve_zero_stage
from pretrain_bench.train.memory import model as memory_model
from pretrain_bench.train.memory.fit import ladder
from pretrain_bench.train.settings import TrainSettings, check_settings

PACKAGE_DIR = Path(pretrain_bench.__file__).parent
ENGINES_DIR = PACKAGE_DIR / "train" / "engines"

MAIN = TrainSettings(micro_batch_size=4, activation_checkpointing=False)  # the main run cells are named against


def engine_name_comparisons(source: str) -> list[str]:
    """`a == "ddp"`, `x in ("deepspeed", ...)` and the like: a comparison of anything with an engine's name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        for operand in [node.left, *node.comparators]:
            names = [operand] if isinstance(operand, ast.Constant) else \
                list(operand.elts) if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else []
            if any(isinstance(n, ast.Constant) and n.value in ENGINES for n in names):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_outside_the_engines_package_branches_on_an_engine_name():
    found = {str(path.relative_to(PACKAGE_DIR)): hits for path in PACKAGE_DIR.rglob("*.py")
             if ENGINES_DIR not in path.parents and (hits := engine_name_comparisons(path.read_text()))}
    assert found == {}


def test_the_check_sees_a_branch():
    assert engine_name_comparisons('if s.engine == "ddp":\n    pass\nok = e in ("fsdp", "x")\n') == [
        "line 1: s.engine == 'ddp'", "line 3: e in ('fsdp', 'x')"]


def test_every_registered_spec_has_its_engine_class():
    from pretrain_bench.train.engines.registry import ENGINE_CLASSES

    assert list(ENGINE_SPECS) == list(ENGINES) == list(ENGINE_CLASSES)
    assert {name: spec.name for name, spec in ENGINE_SPECS.items()} == {name: name for name in ENGINES}


def test_each_spec_says_its_layout_and_labels():
    assert [resolve_zero_stage(name, None) for name in ("deepspeed", "ddp", "fsdp")] == [2, 0, 3]
    assert resolve_zero_stage("ddp", 0) == 0 and resolve_zero_stage("unknown", None) is None
    assert engine_label({"engine": "deepspeed", "zero_stage": 3, "offload_optimizer": "cpu"}) == \
        "DeepSpeed ZeRO-3 + optimizer offload"
    assert [engine_label({"engine": e, "zero_stage": 0, "offload_optimizer": "none"}) for e in ("ddp", "fsdp")] == \
        ["DDP", "FSDP2"]
    assert Cell(2, 1, "fp32", "gloo", 4, "none").name(MAIN) == \
        "ranks2-zero1-fp32-gloo"
    assert Cell(2, 3, "fp32", "gloo", 4, "none", "fsdp").name(MAIN) == "fsdp-ranks2-fp32-gloo"
    with pytest.raises(ConfigError, match=r"train.engine 'megatron' is not one of \['deepspeed', 'ddp', 'fsdp'\]"):
        engine_spec("megatron")


def test_a_fixed_layout_engine_refuses_what_means_nothing_under_it():
    with pytest.raises(ConfigError, match="train.zero_stage 2 means nothing under train.engine ddp"):
        check_settings(TrainSettings(engine="ddp", zero_stage=2, gpus=1))
    with pytest.raises(ConfigError, match="train.offload_optimizer cpu means nothing under train.engine fsdp"):
        check_settings(TrainSettings(engine="fsdp", offload_optimizer="cpu", gpus=1))
    with pytest.raises(ConfigError, match="train.deepspeed sets what the pipeline owns"):
        check_settings(TrainSettings(engine="deepspeed", deepspeed={"optimizer": {}}, gpus=1))


class ToySpec(DDPSpec):
    """A copy of DDP under another name, as docs/contributing.md adds one."""

    name, title = "toy", "Toy"


@pytest.fixture
def toy_engine(monkeypatch):
    monkeypatch.setitem(ENGINE_SPECS, "toy", ToySpec())  # the registration
    return "toy"


def test_a_new_engine_is_one_spec_and_one_registration(toy_engine):
    """Every planning step that reads engines takes the toy's spec without a change anywhere else."""
    settings = TrainSettings(engine=toy_engine, zero_stage=None, gpus=2)
    assert settings.zero_stage == 0  # its layout's stage, from the spec
    check_settings(settings)
    with pytest.raises(ConfigError, match="train.zero_stage 3 means nothing under train.engine toy"):
        check_settings(replace(settings, zero_stage=3))
    assert engine_label({"engine": toy_engine, "zero_stage": 0, "offload_optimizer": "none"}) == "Toy"
    assert (toy_engine, 0, "none") in search_layouts("cuda")
    assert Cell(2, 0, "fp32", "gloo", 4, "none", toy_engine).name(MAIN) == "toy-ranks2-fp32-gloo"
    run = memory_model.RunShape(parameters=10**9, layers=16, hidden_size=2048, kv_size=2048, ffn_size=5632,
                                vocab_size=32000, seq_len=512, micro_batch_size=1, ranks=2, zero_stage=0,
                                precision="fp32", device="cuda", engine=toy_engine)
    assert memory_model.estimate(run).params == memory_model.estimate(replace(run, engine="ddp")).params
    assert memory_model.checkpoint_bytes(10**9, "fp32", 0, toy_engine) == 12 * 10**9
    rungs, ddp_rungs = ladder(settings, "cuda"), ladder(replace(settings, engine="ddp"), "cuda")
    assert [rung.label.replace("TOY", "DDP") for rung in rungs] == [rung.label for rung in ddp_rungs] and rungs
    assert {rung.settings.engine for rung in rungs} == {toy_engine}
