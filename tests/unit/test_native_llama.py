"""model.implementation native: transformers' LlamaForCausalLM as plain torch modules, held to its state dict,
logits, loss, initialisation and the module tree the trainer, train.compile and FSDP rely on."""
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaForCausalLM

from pretrain_bench.config.checks import check_attention
from pretrain_bench.config.schema import ConfigError, ModelSettings
from pretrain_bench.train.compiling import compile_model
from pretrain_bench.train.models.llama import build_model, llama_config, resolve_shape
from pretrain_bench.train.models.native_llama import DecoderBlock, NativeLlamaForCausalLM

VOCAB, T = 97, 16
# grouped-query attention (2 key/value heads for 4 query heads), so the kernels' head sharing is exercised too
GQA = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
       "intermediate_size": 128}


def shape(tied: bool):
    return resolve_shape("tiny", {**GQA, "tie_word_embeddings": tied}, VOCAB)


def pair(tied: bool, kernel: str = "sdpa", seed: int = 3):
    """transformers' model and the native one, each from build_model with the same seed."""
    return (build_model(shape(tied), T, seed, attn_implementation=kernel),
            build_model(shape(tied), T, seed, attn_implementation=kernel, implementation="native"))


@pytest.mark.parametrize("tied", [True, False])
def test_state_dict_names_shapes_and_seeded_weights_are_llama_for_causal_lms(tied):
    reference, native = pair(tied)
    assert isinstance(reference, LlamaForCausalLM) and isinstance(native, NativeLlamaForCausalLM)
    theirs, ours = reference.state_dict(), native.state_dict()
    assert list(ours) == list(theirs)
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    # one seed, one draw order: the very same initial weights, not only the same distribution
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert (native.lm_head.weight is native.model.embed_tokens.weight) == tied
    assert sum(p.numel() for p in native.parameters()) == sum(p.numel() for p in reference.parameters())


def test_initialisation_is_transformers_distribution_per_parameter_kind():
    """normal(0, 0.02) for every linear and embedding weight, ones for the RMSNorm weights (LlamaConfig's
    initializer_range), on a shape with enough weights for the moments to be tight."""
    model = build_model(resolve_shape("tiny", {"tie_word_embeddings": False}, 512), T, seed=11,
                        implementation="native")
    for name, weight in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(weight, torch.ones_like(weight)), name
        else:
            assert abs(weight.mean().item()) < 2e-3 and abs(weight.std().item() - 0.02) < 1e-3, name


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
@pytest.mark.parametrize("tied", [True, False])
def test_a_state_dict_loads_strictly_both_ways_and_gives_transformers_logits_and_loss(tied, kernel):
    torch.manual_seed(0)
    reference, native = pair(tied, kernel)
    with torch.no_grad():  # other weights than the seed's: the comparison does not rest on equal initialisation
        for weight in reference.parameters():
            weight.add_(torch.randn_like(weight) * 0.05)
    native.load_state_dict(reference.state_dict(), strict=True)
    reference.load_state_dict(native.state_dict(), strict=True)
    assert native.attn_implementation == reference.config._attn_implementation == kernel
    batch = torch.randint(0, VOCAB, (3, T))
    labels = batch.clone()
    labels[0, 5:] = -100  # ignored positions, as transformers' loss ignores them
    with torch.no_grad():
        theirs = reference(input_ids=batch, labels=labels)
        ours = native(input_ids=batch, labels=labels)
    assert ours.logits.shape == (3, T, VOCAB)
    assert torch.allclose(ours.logits, theirs.logits, atol=1e-5, rtol=0)
    assert torch.allclose(ours.loss, theirs.loss, atol=1e-5, rtol=0)
    assert native(input_ids=batch).loss is None


def test_gradients_match_transformers_with_and_without_activation_checkpointing():
    reference, native = pair(False)
    batch = torch.randint(0, VOCAB, (2, T))
    calls = []
    native.model.layers[0].register_forward_pre_hook(lambda *args: calls.append(1))

    def gradients(model):
        model.zero_grad()
        model(input_ids=batch, labels=batch).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    theirs = gradients(reference)
    plain = gradients(native)
    native.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # as the trainer
    checkpointed = gradients(native)
    assert len(calls) == 1 + 2, "with checkpointing the block runs again in the backward pass"
    for name, grad in theirs.items():
        assert torch.allclose(plain[name], grad, atol=1e-6, rtol=1e-5), name
        assert torch.equal(checkpointed[name], plain[name]), name
    native.eval()
    calls.clear()
    with torch.no_grad():
        native(input_ids=batch)
    assert len(calls) == 1, "no checkpointing outside training"


def test_decoder_blocks_are_where_compile_and_fsdp_look_for_them():
    """Per-block compile and the FSDP engine walk model.model.layers: the native blocks are there and compile in place
    (the state dict keeps its names)."""
    native = build_model(shape(True), T, seed=3, implementation="native")
    names = list(native.state_dict())
    assert len(native.model.layers) == GQA["num_hidden_layers"]
    assert all(isinstance(block, DecoderBlock) for block in native.model.layers)
    clock = compile_model(native, "blocks")
    try:
        assert all(block._compiled_call_impl is not None for block in native.model.layers)
        assert list(native.state_dict()) == names
    finally:
        clock.close()


def test_fsdp_wraps_the_native_model_per_block_and_keeps_its_logits(tmp_path):
    """FSDPEngine.wrap on one gloo rank: every decoder block and the whole model become FSDP modules, and the
    forward pass gives the unwrapped model's logits."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from pretrain_bench.train.engines.fsdp import FSDPEngine

    native = build_model(shape(False), T, seed=3, implementation="native")
    batch = torch.randint(0, VOCAB, (2, T))
    with torch.no_grad():
        expected = native(input_ids=batch).logits
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        engine = FSDPEngine.__new__(FSDPEngine)  # wrap needs only the device, the precision and EP
        engine.device = "cpu"
        engine.settings = type("Settings", (), {"precision": "fp32", "expert_parallel": 1})()
        wrapped = engine.wrap(native)
        assert isinstance(wrapped, FSDPModule)
        assert all(isinstance(block, FSDPModule) for block in wrapped.model.layers)
        with torch.no_grad():
            assert torch.allclose(wrapped(input_ids=batch).logits, expected, atol=1e-6)
    finally:
        dist.destroy_process_group()


def test_the_key_defaults_to_transformers_and_a_checkpoint_resumes_under_either_class():
    """Like the attention kernel, the class is left out of the resume fingerprint (the same state dict, the same
    maths), so earlier runs' fingerprints stay as they were; the plan records it."""
    from types import SimpleNamespace

    from pretrain_bench.train.checkpoints.run_state import resume_fingerprint

    assert ModelSettings(preset="tiny").implementation == "transformers"
    fingerprints = []
    for implementation in ("transformers", "native"):
        model = ModelSettings(preset="tiny", implementation=implementation)
        assert model.as_dict()["implementation"] == implementation
        plan = SimpleNamespace(model=model, train=SimpleNamespace(as_dict=dict), data_sha256="d", init_from=None)
        fingerprints.append(resume_fingerprint(plan))
    assert fingerprints[0] == fingerprints[1] and "implementation" not in fingerprints[0]["model"]


def test_what_native_does_not_implement_is_refused_naming_the_key():
    from pretrain_bench.workflow.experiment import Config
    from support import tiny_config

    config = tiny_config("native")
    config["model"] = {**config["model"], "implementation": "native"}
    assert Config.from_config(config).model.implementation == "native"
    config["model"]["attn_implementation"] = "flash_attention_2"
    with pytest.raises(ConfigError, match="model.attn_implementation flash_attention_2 runs only with "
                                          "model.implementation transformers"):
        Config.from_config(config)  # when the workflow is planned, before the flash_attn package is looked for
    with pytest.raises(ConfigError, match="model.implementation native runs sdpa or eager"):
        check_attention("flash_attention_2", "bf16", "native")
    llama3 = resolve_shape("tiny", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, VOCAB)
    with pytest.raises(ConfigError, match=r"model.implementation native .* \['rope_scaling'\]"):
        NativeLlamaForCausalLM(llama3)
    with pytest.raises(ConfigError, match=r"\['hidden_act'\]"):
        build_model(resolve_shape("tiny", {"hidden_act": "gelu"}, VOCAB), T, 1, implementation="native")
    assert llama_config(resolve_shape("tiny", {"hidden_act": "gelu"}, VOCAB), T).hidden_act == "gelu"


def test_a_rank_that_builds_the_native_model_never_imports_transformers():
    """In a fresh interpreter: the trainer, every engine and DeepSpeed imported, the native model built and run; then,
    in the same interpreter, transformers' class built, which the same check must see."""
    code = ("import sys\n"
            "import deepspeed, pretrain_bench.train.trainer\n"
            "import pretrain_bench.train.engines.fsdp, pretrain_bench.train.engines.ddp\n"
            "import pretrain_bench.train.engines.deepspeed_engine\n"
            "import torch\n"
            "from pretrain_bench.train.models.llama import build_model, resolve_shape\n"
            "def loaded():\n"
            "    return sorted(name for name in sys.modules if name.split('.')[0] == 'transformers')\n"
            f"model = build_model(resolve_shape('tiny', None, {VOCAB}), {T}, 1, implementation='native')\n"
            f"model(input_ids=torch.zeros(1, {T}, dtype=torch.long)).logits.sum().backward()\n"
            "print(loaded())\n"
            f"build_model(resolve_shape('tiny', None, {VOCAB}), {T}, 1, implementation='transformers')\n"
            "print(loaded())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    native, then_transformers = proc.stdout.split("\n")[-3:-1]
    assert native == "[]"
    assert "'transformers'" in then_transformers, "the check sees transformers where the rank does import it"


def test_the_preloaded_model_libraries_are_all_a_model_build_imports():
    """forked_ranks.preload imports model.model_libraries in torchrun's agent so that no forked rank imports them:
    in a fresh interpreter, after those of each class, building and running that class imports nothing more of
    transformers (none of it for the native class), and train.compile adds the compiler to the list."""
    code = ("import importlib, sys\n"
            "import torch\n"
            "from pretrain_bench.train.models.llama import build_model, model_libraries, resolve_shape\n"
            "def loaded():\n"
            "    return {name for name in sys.modules if name.split('.')[0] == 'transformers'}\n"
            "for implementation in ('native', 'transformers'):\n"
            "    for name in model_libraries(implementation, False):\n"
            "        importlib.import_module(name)\n"
            "    before = loaded()\n"
            f"    model = build_model(resolve_shape('tiny', None, {VOCAB}), {T}, 1, implementation=implementation)\n"
            f"    model(input_ids=torch.zeros(1, {T}, dtype=torch.long)).logits.sum().backward()\n"
            "    print(implementation, len(before), sorted(loaded() - before))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    native, transformers = (line.split(" ", 2) for line in proc.stdout.split("\n")[-3:-1])
    assert native == ["native", "0", "[]"]
    assert transformers[0] == "transformers" and int(transformers[1]) > 0 and transformers[2] == "[]", transformers
    from pretrain_bench.train.models.llama import model_libraries

    assert set(model_libraries("native", True)) - set(model_libraries("native", False)) == {"torch._dynamo",
                                                                                           "torch._inductor.compile_fx"}


def test_model_init_from_weights_load_into_the_native_model(tmp_path):
    """load_pretrained (model.init_from) copies an HF folder's safetensors into the native model as into
    transformers' class: the same logits afterwards."""
    from pretrain_bench.train.models.llama import load_pretrained

    reference = build_model(shape(True), T, seed=5)
    reference.save_pretrained(tmp_path / "hf")
    native = build_model(shape(True), T, seed=6, implementation="native")
    loaded = load_pretrained(native, tmp_path / "hf")
    assert loaded["files"] == ["model.safetensors"] and loaded["added_vocab_rows"] == 0
    batch = torch.randint(0, VOCAB, (2, T))
    with torch.no_grad():
        assert torch.allclose(native(input_ids=batch).logits, reference(input_ids=batch).logits, atol=1e-5, rtol=0)
