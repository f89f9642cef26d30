"""train.compile (per decoder block or the whole model, in place) and model.attn_implementation (the kernel, and
flash's refusal)."""
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from pretrain_bench.config.checks import FLASH_INSTALL_HINT, check_attention
from pretrain_bench.config.schema import ConfigError, ModelSettings
from pretrain_bench.train.compiling import COMPILE_SCOPES, CompileClock, compile_model, compile_scope
from pretrain_bench.train.models.llama import build_model, resolve_shape
from pretrain_bench.train.settings import TrainSettings
from pretrain_bench.workflow.experiment import Config
from support import tiny_config

SHAPE = resolve_shape("tiny", {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                               "num_key_value_heads": 4, "intermediate_size": 128}, 97)
T = 16


def test_the_schema_defaults_keep_eager_training_with_torchs_sdpa_kernel():
    assert TrainSettings().compile is False
    assert ModelSettings(preset="tiny").attn_implementation == "sdpa"


def test_each_attention_kernel_builds_the_model_it_names_with_the_same_logits():
    batch = torch.randint(0, 97, (2, T))
    logits = {}
    for kernel in ("sdpa", "eager"):
        model = build_model(SHAPE, T, seed=5, attn_implementation=kernel).eval()
        assert model.config._attn_implementation == kernel
        with torch.no_grad():
            logits[kernel] = model(input_ids=batch).logits  # (B, T, vocab)
    assert torch.allclose(logits["sdpa"], logits["eager"], atol=1e-5), "same weights, same maths"


def test_flash_attention_without_its_package_is_refused_naming_the_key_and_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else real(name, *a))
    with pytest.raises(ConfigError) as caught:
        check_attention("flash_attention_2", "bf16")
    message = str(caught.value)
    assert "model.attn_implementation flash_attention_2" in message and FLASH_INSTALL_HINT in message
    assert "\n" not in message
    check_attention("sdpa", "fp32")  # the others need nothing
    check_attention("eager", "fp32")
    # at plan time: the typed config the workflow builds once refuses it, so `snakemake -n` shows the error
    config = tiny_config("unit-flash")
    config["model"] = {**config["model"], "attn_implementation": "flash_attention_2", "implementation": "transformers"}
    with pytest.raises(ConfigError, match="model.attn_implementation flash_attention_2 needs the flash_attn package"):
        Config.from_config(config)


def test_flash_attention_in_fp32_is_refused(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # as if installed
    with pytest.raises(ConfigError, match="runs in bf16 or fp16, not train.precision fp32"):
        check_attention("flash_attention_2", "fp32")
    check_attention("flash_attention_2", "bf16")


def test_the_compile_scope_is_the_whole_native_model_and_transformers_blocks_and_blocks_under_fsdp():
    assert compile_scope("native", "deepspeed") == compile_scope("native", "ddp") == "model"
    assert compile_scope("native", "fsdp") == "blocks"
    assert {compile_scope("transformers", engine) for engine in ("deepspeed", "ddp", "fsdp")} == {"blocks"}


@pytest.mark.parametrize("implementation,scope", [("transformers", "blocks"), ("native", "model")])
def test_a_model_compiled_keeps_the_state_dict_names_and_trains_to_eagers_losses(implementation, scope):
    """Compiled in place, per block (transformers' class) or whole (the native class): checkpoints and the HF export
    see the same keys. Same weights and batches give eager's losses within 1e-4 (the tolerance README states; the
    bench measures the actual difference)."""
    eager, compiled = (build_model(SHAPE, T, seed=3, implementation=implementation) for _ in range(2))
    keys = list(compiled.state_dict())
    clock = compile_model(compiled, scope)
    # a forward hook on the model, as DeepSpeed's engine puts on the model it wraps, runs outside the compiled graph
    hook_ran_compiled = []
    compiled.register_forward_pre_hook(lambda module, args: hook_ran_compiled.append(torch.compiler.is_compiling()))
    try:
        assert list(compiled.state_dict()) == keys and all("_orig_mod" not in k for k in keys)
        assert compiled._compiled_call_impl is None  # the whole model: its forward method, not the module's call
        assert hasattr(vars(compiled).get("forward"), "_torchdynamo_orig_callable") == (scope == "model")
        assert all((block._compiled_call_impl is not None) == (scope == "blocks") for block in compiled.model.layers)
        generator = torch.Generator().manual_seed(0)
        batches = torch.randint(0, 97, (1, 2, T + 1), generator=generator).expand(3, -1, -1)  # one batch, learnt
        losses = {}
        for name, model in (("eager", eager), ("compiled", compiled)):
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses[name] = []
            for batch in batches:
                logits = model(input_ids=batch[:, :-1]).logits  # (B, T, vocab)
                loss = F.cross_entropy(logits.reshape(-1, 97), batch[:, 1:].reshape(-1))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses[name].append(loss.item())
        assert max(abs(a - b) for a, b in zip(losses["eager"], losses["compiled"])) < 1e-4, losses
        assert losses["compiled"][-1] < losses["compiled"][0], "it trains"
        assert hook_ran_compiled == [False] * len(batches)
        summary = clock.summary()
        assert summary["scope"] == COMPILE_SCOPES[scope] and summary["compilations"] >= 1 and summary["time_s"] > 0
    finally:
        clock.close()


def test_the_compile_clock_sums_the_time_between_each_start_and_end(monkeypatch):
    import pretrain_bench.train.compiling as compiling

    ticks = iter([10.0, 12.5, 20.0, 20.25])
    monkeypatch.setattr(compiling.time, "perf_counter", lambda: next(ticks))
    clock = CompileClock()
    try:
        clock._start(), clock._end()  # 2.5 s
        clock._end()  # an end without a start counts nothing
        clock._start(), clock._end()  # 0.25 s
        assert clock.compilations == 2 and clock.seconds == 2.75
    finally:
        clock.close()
