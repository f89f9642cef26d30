"""The DeepSeek family (deepseek, native_deepseek): held to transformers' DeepseekV3ForCausalLM / DeepseekV2ForCausalLM
(state dict, seeded weights, logits, loss, gradients, the router's choice), to the published parameter counts, and to
what transformers does not do: the sequence-wise balance loss, the auxiliary-loss-free bias update, forced balance."""
import os
import subprocess
import sys

import pytest
import torch
from transformers import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

from pretrain_bench.train.models import flops
from pretrain_bench.train.models.deepseek import (
    FLOPS_FORMULA,
    PRESETS,
    DeepseekFamily,
    DeepseekShape,
    build_model,
    count_parameters,
    flops_per_token,
    hf_config,
    resolve_shape,
)
from pretrain_bench.train.models.llama import PRESETS as LLAMA_PRESETS
from pretrain_bench.train.models.native_deepseek import (
    Experts,
    MultiHeadAttention,
    NativeDeepseekForCausalLM,
    max_violation,
    rotary_tables,
)
from pretrain_bench.train.models.registry import MODEL_FAMILIES, model_family, preset_family

VOCAB, T = 97, 16
# V3: sigmoid router, group-limited top-2 of 8 experts in 4 groups (2 of them), compressed queries, MLA
V3 = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
      "moe_intermediate_size": 32, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
      "n_group": 4, "topk_group": 2, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
      "qk_rope_head_dim": 8, "v_head_dim": 16, "first_k_dense_replace": 1, "aux_loss_alpha": 0.0,
      "bias_update_rate": 0.0}
# V2: softmax router, greedy top-2 (or group-limited), plain query projection, no normalisation
V2 = {**V3, "scoring_func": "softmax", "topk_method": "greedy", "q_lora_rank": None, "norm_topk_prob": False,
      "routed_scaling_factor": 1.0, "n_shared_experts": 2, "hf_model_type": "deepseek_v2"}
# DeepSeekMoE: plain multi-head attention, RoPE over the whole head
MHA = {**V2, "kv_lora_rank": None, "qk_nope_head_dim": 0, "qk_rope_head_dim": 16, "hf_model_type": None}
SHAPES = {"v3": V3, "v2": V2, "v2-group": {**V2, "topk_method": "group_limited"}}
# Published totals and activated parameters per token (the model cards / reports), and which count the activated
# figure truncates: DeepSeekMoE's and V3's count the embeddings, V2-Lite's 2.4B leaves out the input embedding.
PUBLISHED = {"deepseek-v3": (671e9, 37e9, 1e9, "active"), "deepseek-v2": (236e9, 21e9, 1e9, "active"),
             "deepseek-v2-lite": (15.7e9, 2.4e9, 0.1e9, "active_matmul"),
             "deepseekmoe-16b": (16.4e9, 2.8e9, 0.1e9, "active")}


def shape(key: str = "v3", **changes) -> DeepseekShape:
    return resolve_shape("tiny-moe", {**SHAPES.get(key, MHA if key == "mha" else {}), **changes}, VOCAB)


def pair(key: str, seed: int = 3):
    return build_model(shape(key), T, seed), build_model(shape(key), T, seed, implementation="native")


def router_choices(model) -> list:
    """Forward hooks on every MoE layer's router: its (weights, expert indices) per call, each token's sorted by
    expert (transformers' top-k is unsorted)."""
    seen = []

    def hook(module, args, output):
        weights, indices = output[1], output[2]
        indices, order = indices.sort(dim=-1)
        seen.append((weights.gather(1, order), indices))

    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(hook)
    return seen


@pytest.mark.parametrize("key", list(SHAPES))
def test_native_is_transformers_state_dict_weights_logits_loss_gradients_and_routing(key):
    reference, native = pair(key)
    assert isinstance(reference, DeepseekV3ForCausalLM if key == "v3" else DeepseekV2ForCausalLM)
    theirs, ours = reference.state_dict(), native.state_dict()
    assert list(ours) == list(theirs)
    assert {k: (v.shape, v.dtype) for k, v in ours.items()} == {k: (v.shape, v.dtype) for k, v in theirs.items()}
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs), "one seed, one draw order: the same weights"
    assert ("model.layers.1.mlp.gate.e_score_correction_bias" in ours) == (key == "v3")
    torch.manual_seed(0)
    with torch.no_grad():  # other weights than the seed's
        for weight in reference.parameters():
            weight.add_(torch.randn_like(weight) * 0.05)
    native.load_state_dict(reference.state_dict(), strict=True)
    reference.load_state_dict(native.state_dict(), strict=True)
    batch = torch.randint(0, VOCAB, (3, T))
    labels = batch.clone()
    labels[0, 5:] = -100
    choices = router_choices(reference), router_choices(native)
    gradients = []
    for model in (reference, native):
        model.zero_grad()
        out = model(input_ids=batch, labels=labels)
        out.loss.backward()
        gradients.append({name: p.grad for name, p in model.named_parameters()})
        if model is reference:
            theirs = out
    assert torch.allclose(out.logits, theirs.logits, atol=1e-5, rtol=0)
    assert torch.allclose(out.loss, theirs.loss, atol=1e-5, rtol=0)
    assert out.aux_loss is None
    (their_weights, their_experts), (our_weights, our_experts) = choices[0][0], choices[1][0]
    assert torch.equal(our_experts, their_experts)
    assert torch.allclose(our_weights, their_weights, atol=1e-6, rtol=0)
    for name, grad in gradients[0].items():
        assert torch.allclose(gradients[1][name], grad, atol=1e-6, rtol=1e-5), name


def test_a_non_zero_router_bias_changes_the_choice_as_in_transformers():
    reference, native = pair("v3")
    torch.manual_seed(1)
    bias = torch.randn(8) * 0.05  # the sigmoid scores differ by ~0.01 at init: this bias decides
    batch = torch.randint(0, VOCAB, (2, T))
    before = router_choices(native)
    with torch.no_grad():
        native(input_ids=batch)
        native.model.layers[1].mlp.gate.e_score_correction_bias.copy_(bias)
    reference.load_state_dict(native.state_dict(), strict=True)
    assert torch.equal(reference.model.layers[1].mlp.gate.e_score_correction_bias, bias)
    theirs, ours = router_choices(reference), router_choices(native)
    with torch.no_grad():
        logits = reference(input_ids=batch).logits, native(input_ids=batch).logits
    assert not torch.equal(ours[0][1], before[0][1]), "the bias moves some tokens to other experts"
    assert torch.equal(ours[0][1], theirs[0][1])
    assert torch.allclose(ours[0][0], theirs[0][0], atol=1e-6, rtol=0), "weights from the unbiased scores"
    assert torch.allclose(logits[1], logits[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_gemm_and_the_loop_over_experts_agree(dtype):
    torch.manual_seed(0)
    experts = Experts(8, 64, 32).to(dtype)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.1)
        experts.down_proj.normal_(0, 0.1)
    x = torch.randn(40, 64, dtype=dtype)
    indices = torch.randint(0, 7, (40, 2))  # expert 7 gets no token: an empty group
    weights = torch.rand(40, 2)
    outputs = []
    for kernel in ("grouped_mm", "loop"):
        experts.kernel = kernel
        experts.zero_grad()
        source = x.clone().requires_grad_()
        out = experts(source, indices, weights)
        out.float().pow(2).sum().backward()
        outputs.append((out, source.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()))
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    for grouped, loop in zip(*outputs):
        assert torch.allclose(grouped.float(), loop.float(), atol=tolerance, rtol=0)
    assert outputs[0][0].dtype == dtype and outputs[0][3][7].abs().sum() == 0


@pytest.mark.parametrize("key", ["v3", "v2", "mha"])
def test_count_parameters_is_the_models_numel(key):
    native = build_model(shape(key), T, seed=0, implementation="native")
    counts = count_parameters(shape(key))
    assert sum(p.numel() for p in native.parameters()) == counts["total"]
    assert counts["total"] == counts["expert"] + counts["non_expert"]
    assert counts["active"] == counts["total"] - counts["moe_layers"] * 6 * counts["per_expert"]  # 8 experts, 2 used
    if key != "mha":
        with torch.device("meta"):
            reference = DeepseekFamily().hf_class_for(shape(key))(hf_config(shape(key), T))
        assert sum(p.numel() for p in reference.parameters()) == counts["total"]
        experts = sum(p.numel() for name, p in reference.named_parameters() if ".experts." in name)
        assert experts == counts["expert"]


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_presets_are_the_published_models(preset):
    """Built on the meta device (no memory): the native model's and transformers' numel are count_parameters', whose
    total is within 1 % of the published one and whose activated count truncates to the published figure."""
    total, active, unit, key = PUBLISHED[preset]
    preset_shape = resolve_shape(preset, None, 2048)
    counts = count_parameters(preset_shape)
    with torch.device("meta"):
        native = NativeDeepseekForCausalLM(preset_shape)
        if preset_shape.hf_model_type:
            reference = DeepseekFamily().hf_class_for(preset_shape)(hf_config(preset_shape, 4096))
            assert sum(p.numel() for p in reference.parameters()) == counts["total"]
    assert sum(p.numel() for p in native.parameters()) == counts["total"]
    assert abs(counts["total"] - total) / total < 0.01, counts["total"]
    assert 0 <= counts[key] - active < unit, counts[key]
    assert counts["active_matmul"] < counts["active"] < counts["total"]


def test_tiny_moe_is_about_four_million_parameters_with_the_demo_vocabulary():
    counts = count_parameters(resolve_shape("tiny-moe", None, 2048))
    assert 3.5e6 < counts["total"] < 4.5e6 and PRESETS["tiny-moe"].vocab_size is None


def test_aux_loss_is_zero_without_alpha_and_otherwise_adds_its_gradient_to_the_router():
    batch = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(0))
    results = {}
    for alpha in (0.0, 0.1):
        model = build_model(shape("v3", aux_loss_alpha=alpha), T, seed=4, implementation="native")
        model.train()
        out = model(batch, labels=batch)
        out.loss.backward()
        results[alpha] = out, model.model.layers[1].mlp.gate.weight.grad.clone(), model
    plain, balanced = results[0.0][0], results[0.1][0]
    assert plain.aux_loss is None
    assert balanced.aux_loss > 0 and torch.allclose(balanced.loss, plain.loss + balanced.aux_loss)
    assert not torch.allclose(results[0.1][1], results[0.0][1], atol=1e-9, rtol=0), "the aux loss moves the router"
    model = results[0.1][2]
    model.zero_grad()
    model(batch).aux_loss.backward()  # the aux loss alone: its gradient is the difference
    assert torch.allclose(results[0.1][1] - results[0.0][1], model.model.layers[1].mlp.gate.weight.grad, atol=1e-6)
    model.eval()
    assert model(batch).aux_loss is None, "held-out evaluation reports the cross-entropy alone"


def test_uniform_routing_makes_the_sequence_balance_loss_alpha():
    """Eq. 17-20 at perfect balance (every f_i = 1, P_i = 1/E): L = α Σ_i f_i P_i = α, per MoE layer."""
    model = build_model(shape("v3", aux_loss_alpha=0.5, force_balanced=True), T, seed=0, implementation="native")
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight.zero_()  # equal scores for every expert
    model.train()
    assert torch.allclose(model(torch.zeros(2, T, dtype=torch.long)).aux_loss, torch.tensor(0.5))


def test_the_bias_update_lowers_max_violation_in_training():
    """A fixed-seed run from an imbalanced router (its weights × 10): with bias_update_rate the load ends far more
    balanced than without."""
    def late_max_violation(rate: float) -> float:
        model = build_model(shape("v3", bias_update_rate=rate), T, seed=0, implementation="native")
        with torch.no_grad():
            model.model.layers[1].mlp.gate.weight.mul_(10.0)
        model.train()
        batch = torch.randint(0, VOCAB, (4, T), generator=torch.Generator().manual_seed(0))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        violations = []
        for _ in range(30):
            optimizer.zero_grad()
            model(batch, labels=batch).loss.backward()
            optimizer.step()
            violations.append(max_violation(model.expert_load()).mean().item())
            model.update_router_biases()
            model.reset_expert_load()
        return sum(violations[-10:]) / 10

    still, moved = late_max_violation(0.0), late_max_violation(0.01)
    assert moved < 0.5 * still, (moved, still)


def test_update_router_biases_steps_by_sign_keeps_float32_and_is_a_no_op_at_rate_zero():
    batch = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(0))
    still = build_model(shape("v3"), T, seed=0, implementation="native")
    still.train()
    still(batch)
    load = still.expert_load()
    assert load.shape == (1, 8) and load.dtype == torch.int64 and load.sum() == 2 * T * 2
    still.update_router_biases()
    assert torch.equal(still.expert_load(), load), "rate 0: nothing changes, the counts stay"
    assert still.model.layers[1].mlp.gate.e_score_correction_bias.abs().sum() == 0
    model = build_model(shape("v3", bias_update_rate=0.25), T, seed=0, implementation="native").to(torch.bfloat16)
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and model.model.layers[1].mlp.gate.weight.dtype == torch.bfloat16
    summed = torch.tensor([[9, 1, 4, 4, 4, 4, 0, 6]])  # e.g. all-reduced over ranks: mean 4
    model.update_router_biases(summed)
    assert torch.equal(bias, torch.tensor([-0.25, 0.25, 0, 0, 0, 0, 0.25, -0.25]))
    assert model.model.layers[1].mlp.gate.e_score_correction_bias is bias and bias.dtype == torch.float32
    assert max_violation(summed).item() == pytest.approx((9 - 4) / 4)
    assert max_violation(torch.full((2, 8), 3)).tolist() == [0.0, 0.0]


def test_activation_checkpointing_counts_each_token_once_and_keeps_the_aux_loss_gradient():
    batch = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(0))
    grads = []
    for kwargs in (None, {"use_reentrant": False}, {"use_reentrant": True}):
        model = build_model(shape("v3", aux_loss_alpha=0.1), T, seed=0, implementation="native")
        if kwargs:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.train()
        model(batch, labels=batch).loss.backward()
        assert model.expert_load().sum() == 2 * T * 2, kwargs
        grads.append(model.model.layers[1].mlp.gate.weight.grad)
    assert all(torch.allclose(grad, grads[0], atol=1e-7) for grad in grads)


def test_force_balanced_gives_every_expert_the_same_load():
    model = build_model(shape("v3", force_balanced=True), T, seed=0, implementation="native")
    model.train()
    model(torch.randint(0, VOCAB, (3, T)))  # 48 tokens × 2 slots over 8 experts
    assert model.expert_load().tolist() == [[12] * 8]
    assert max_violation(model.expert_load()).item() == 0


def test_build_is_seeded_and_a_state_dict_round_trips_native_transformers_native():
    first, again = (build_model(shape("v3"), T, seed=7, implementation="native") for _ in range(2))
    other = build_model(shape("v3"), T, seed=8, implementation="native")
    ours = first.state_dict()
    assert all(torch.equal(value, again.state_dict()[key]) for key, value in ours.items())
    assert not torch.equal(ours["model.layers.1.mlp.experts.gate_up_proj"],
                           other.state_dict()["model.layers.1.mlp.experts.gate_up_proj"])
    with torch.no_grad():
        first.model.layers[1].mlp.gate.e_score_correction_bias.uniform_(-1, 1)
    reference = build_model(shape("v3"), T, seed=9)
    reference.load_state_dict(first.state_dict(), strict=True)
    other.load_state_dict(reference.state_dict(), strict=True)
    assert all(torch.equal(value, other.state_dict()[key]) for key, value in first.state_dict().items())


def test_plain_multi_head_attention_is_llamas_when_rope_covers_the_head():
    """DeepSeekMoE's attention (qk_nope_head_dim 0) is native_llama's Attention with the same weights."""
    from pretrain_bench.train.models.llama import resolve_shape as llama_shape
    from pretrain_bench.train.models.native_llama import Attention, RotaryEmbedding

    ours = MultiHeadAttention(shape("mha"), "sdpa", "halves")
    theirs = Attention(llama_shape("tiny", {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4},
                                   VOCAB), "sdpa")
    theirs.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(2, T, 64)
    positions = torch.arange(T).unsqueeze(0)
    angles = positions[..., None].float() * RotaryEmbedding(16, 10000.0).inv_freq
    with torch.no_grad():
        assert torch.allclose(ours(x, rotary_tables(angles, "halves", x.dtype)),
                              theirs(x, *RotaryEmbedding(16, 10000.0)(x, positions)), atol=1e-6)


def test_the_registry_finds_the_deepseek_family_and_llama_keeps_its_presets():
    assert set(MODEL_FAMILIES) == {"llama", "deepseek"}
    family = MODEL_FAMILIES["deepseek"]
    assert model_family(shape("v3")) is family
    for preset, preset_shape in PRESETS.items():
        assert preset_family(preset) is family and model_family(preset_shape) is family
    for preset, llama_shape in LLAMA_PRESETS.items():
        assert preset_family(preset).name == "llama" and model_family(llama_shape).name == "llama"
    assert family.hf_class().__name__ == family.hf_architecture == "DeepseekV3ForCausalLM"
    assert family.hf_class_for(shape("v2")) is DeepseekV2ForCausalLM
    assert family.model_libraries("native", False) == ("pretrain_bench.train.models.native_deepseek",)
    assert "torch._dynamo" in family.model_libraries("transformers", True)


def test_resolve_shape_takes_overrides_and_the_tokenizers_vocabulary_and_refuses_invalid_combinations():
    resolved = resolve_shape("tiny-moe", {"num_hidden_layers": 3, "max_position_embeddings": 8192}, 300)
    assert (resolved.num_hidden_layers, resolved.vocab_size) == (3, 300)
    assert resolved.extra == {"max_position_embeddings": 8192}
    assert resolve_shape("deepseek-v3").vocab_size == 129280
    refused = {"num_experts_per_tok": {"num_experts_per_tok": 9},
               "n_group": {"n_group": 3},
               "topk_group": {"topk_group": 5},
               "scoring_func": {"scoring_func": "softmax", "bias_update_rate": 0.0},  # with hf_model_type deepseek_v3
               "bias_update_rate": {**V2, "bias_update_rate": 0.001},
               "norm_topk_prob": {**V2, "norm_topk_prob": True},
               "kv_lora_rank": {**V3, "kv_lora_rank": None, "q_lora_rank": None},
               "topk_method": {"topk_method": "noaux_tc"},
               # no multi-token prediction module: an export may not claim one
               "num_nextn_predict_layers": {"num_nextn_predict_layers": 1},
               "num_mtp_layers": {"num_mtp_layers": 1}}
    for key, overrides in refused.items():
        with pytest.raises(ValueError, match=f"model.overrides.{key}:"):
            resolve_shape("tiny-moe", overrides, VOCAB)
    with pytest.raises(ValueError, match="model.preset: unknown preset"):
        resolve_shape("deepseek-v9")
    with pytest.raises(ValueError, match="smaller than the tokenizer's"):
        resolve_shape("deepseek-v2-lite", None, 200000)


def test_hf_configs_and_the_refused_export():
    v3 = hf_config(shape("v3"), 8192, "eager")
    assert (v3.model_type, v3.num_mtp_layers, v3.use_cache) == ("deepseek_v3", 0, False)
    assert (v3.n_group, v3.topk_group, v3.rope_interleave) == (4, 2, True)
    assert (v3.num_key_value_heads, v3.max_position_embeddings, v3._attn_implementation) == (4, 8192, "eager")
    greedy = hf_config(shape("v3", topk_method="greedy"), T)
    assert (greedy.n_group, greedy.topk_group) == (1, 1), "greedy: one group of every expert"
    assert hf_config(shape("v2-group"), T).topk_method == "group_limited_greedy"
    with pytest.raises(ValueError, match="no transformers class: export is refused"):
        hf_config(resolve_shape("deepseekmoe-16b"), T)
    with pytest.raises(ValueError, match="export is refused"):
        DeepseekFamily().hf_class_for(resolve_shape("deepseekmoe-16b"))


def test_flops_follow_the_printed_formula_and_llamas_convention():
    preset_shape = PRESETS["deepseek-v3"]
    counts = count_parameters(preset_shape)
    assert flops_per_token(preset_shape, 4096) == 6 * counts["active_matmul"] + 6 * 61 * 128 * (192 + 128) * 4096
    assert DeepseekFamily().flops_formula == FLOPS_FORMULA and FLOPS_FORMULA.startswith("6N + 6*L*H*(Dqk+Dv)*T")
    equal_heads = shape("v3", qk_nope_head_dim=8, qk_rope_head_dim=8)  # Dqk = Dv = 16: LLaMA's attention term
    assert flops_per_token(equal_heads, 512) == flops.flops_per_token(count_parameters(equal_heads)["active_matmul"],
                                                                      2, 4, 16, 512)


def test_a_rank_that_builds_the_native_model_never_imports_transformers():
    code = ("import sys, torch\n"
            "from pretrain_bench.train.models.deepseek import build_model, resolve_shape\n"
            f"model = build_model(resolve_shape('tiny-moe', None, {VOCAB}), {T}, 1, implementation='native')\n"
            f"model(torch.zeros(1, {T}, dtype=torch.long)).logits.sum().backward()\n"
            "print(sorted(name for name in sys.modules if name.split('.')[0] == 'transformers'))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().split("\n")[-1] == "[]"


def test_a_model_block_with_a_deepseek_preset_resolves_through_its_family_for_the_memory_model():
    from pretrain_bench.config.schema import ModelSettings
    from pretrain_bench.train.models.registry import model_shape

    resolved = model_shape(ModelSettings(preset="tiny-moe", overrides={"num_hidden_layers": 3}), 300)
    assert isinstance(resolved, DeepseekShape) and resolved.num_hidden_layers == 3 and resolved.vocab_size == 300
    dims = MODEL_FAMILIES["deepseek"].memory_dims(resolved)
    assert dims["layers"] == 3 and dims["hidden_size"] == resolved.hidden_size and dims["vocab_size"] == 300
    # the dense layers' FFN width, and the MoE layers apart: their experts, split from the rest for the states
    assert dims["ffn_size"] == resolved.intermediate_size
    counts = count_parameters(resolved)
    assert dims["moe"].dense_layers == 1 and dims["moe"].experts_per_token == resolved.num_experts_per_tok
    assert (3 - 1) * dims["moe"].expert_parameters_per_layer == counts["expert"]
    assert dims["attention"].kv_lora_rank == resolved.kv_lora_rank
    rows = dict(MODEL_FAMILIES["deepseek"].card_rows(resolved))
    assert rows["active parameters per token"] == f"{count_parameters(resolved)['active']:,}"
