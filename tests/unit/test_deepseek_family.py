"""The DeepSeek family (MLA + MoE): the native class against transformers' DeepseekV3 / DeepseekV2 classes (state dict,
initialisation, router choices and logits), the presets' parameter counts against the published figures, the
batched expert kernels, and the balancing (sequence-wise loss, the auxiliary-loss-free bias, forced balance)."""
import pytest
import torch

from pretrain_bench.train.models import deepseek
from pretrain_bench.train.models.native_deepseek import NativeDeepseekForCausalLM, max_violation
from pretrain_bench.train.models.registry import MODEL_FAMILIES, model_family, model_shape, preset_family

VOCAB = 512
V2 = {"hf_model_type": "deepseek_v2", "scoring_func": "softmax", "topk_method": "group_limited",
      "norm_topk_prob": False, "q_lora_rank": None, "bias_update_rate": 0.0}


def tiny(**overrides):
    return deepseek.resolve_shape("tiny-moe", overrides, VOCAB)


def pair(shape):
    """The native model and transformers' class of `shape`, built from the same seed, in eval mode."""
    native = deepseek.build_model(shape, 64, seed=0, implementation="native").eval()
    reference = deepseek.build_model(shape, 64, seed=0, implementation="transformers").eval()
    return native, reference


@pytest.mark.parametrize("overrides", [{}, V2], ids=["v3-sigmoid-group-limited-q-lora", "v2-softmax-no-q-lora"])
def test_native_model_is_transformers_class_weight_for_weight_and_logit_for_logit(overrides):
    shape = tiny(**overrides)
    native, reference = pair(shape)
    # the same state dict, drawn in the same order from the same seed
    ours, theirs = native.state_dict(), reference.state_dict()
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[key], theirs[key]) for key in ours)
    biases = [key for key in ours if key.endswith("e_score_correction_bias")]
    assert bool(biases) == (shape.scoring_func == "sigmoid")
    for key in biases:  # a trained bias steers the choice: set it, in both
        ours[key].copy_(torch.linspace(-0.2, 0.2, ours[key].numel()))
    reference.load_state_dict(ours, strict=True)
    # the router's choices, hooked on both: the same experts for every token of every MoE layer
    chosen = {"ours": [], "theirs": []}
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: chosen["ours"].append(o[2].sort(-1).values))
             for layer in native.model.layers[shape.first_k_dense_replace:]]
    hooks += [layer.mlp.gate.register_forward_hook(
        lambda m, i, o: chosen["theirs"].append(m.route_tokens_to_experts(o)[0].sort(-1).values)
        if hasattr(m, "route_tokens_to_experts") else None)
        for layer in reference.model.layers[shape.first_k_dense_replace:]]
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours_logits, theirs_logits = native(input_ids=ids).logits, reference(input_ids=ids).logits
    for hook in hooks:
        hook.remove()
    assert torch.equal(ours_logits, theirs_logits)
    assert len(chosen["ours"]) == shape.num_hidden_layers - shape.first_k_dense_replace
    if chosen["theirs"]:
        assert all(torch.equal(a, b) for a, b in zip(chosen["ours"], chosen["theirs"]))


def test_grouped_gemm_and_the_loop_over_experts_give_the_same_output():
    shape = tiny()
    native = deepseek.build_model(shape, 64, seed=0, implementation="native").eval()
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    outputs = {}
    for kernel in ("grouped_mm", "loop"):
        for layer in native.model.layers[shape.first_k_dense_replace:]:
            layer.mlp.experts.kernel = kernel
        with torch.no_grad():
            outputs[kernel] = native(input_ids=ids).logits
    assert torch.allclose(outputs["grouped_mm"], outputs["loop"], atol=1e-5, rtol=0)


def test_parameter_counts_are_exact_and_the_presets_match_the_published_figures():
    for shape in (tiny(), tiny(**V2)):
        native, reference = pair(shape)
        counted = deepseek.count_parameters(shape)["total"]
        assert counted == sum(p.numel() for p in native.parameters()) == sum(p.numel() for p in reference.parameters())
    # published totals and activated parameters; the papers differ on the input embedding: DeepSeekMoE 16B's 2.8B
    # counts it, V2-Lite's 2.4B does not (2.66B with it), V3's 37B lies between (37.5B with it, 36.6B without)
    published = {"deepseek-v3": (671e9, 37e9, False), "deepseek-v2-lite": (15.7e9, 2.4e9, False),
                 "deepseekmoe-16b": (16.4e9, 2.8e9, True)}
    for preset, (total, active, with_embedding) in published.items():
        shape = deepseek.resolve_shape(preset)
        counts = deepseek.count_parameters(shape)
        assert counts["total"] == pytest.approx(total, rel=0.01), preset
        counted = counts["active"] - (0 if with_embedding else counts["embedding"])
        assert counted == pytest.approx(active, rel=0.025), preset
        assert counts["expert"] + counts["non_expert"] == counts["total"]
    with torch.device("meta"):  # transformers' class of the V2-Lite shape, never allocated
        lite = deepseek.resolve_shape("deepseek-v2-lite")
        model = deepseek.build_model(lite, 64, seed=0, device="meta")
    assert sum(p.numel() for p in model.parameters()) == deepseek.count_parameters(lite)["total"]


def test_flops_count_active_parameters_and_mla_head_dims():
    shape = tiny()
    counts = deepseek.count_parameters(shape)
    per_token = deepseek.flops_per_token(shape, 128)
    attention = 6 * shape.num_hidden_layers * shape.num_attention_heads * (
        shape.qk_nope_head_dim + shape.qk_rope_head_dim + shape.v_head_dim) * 128
    assert per_token == 6 * counts["active_matmul"] + attention
    assert counts["active_matmul"] < counts["matmul"]  # the experts a token is not sent to do no work for it


def test_the_registry_finds_each_family_by_shape_and_preset():
    assert set(MODEL_FAMILIES) == {"llama", "deepseek"}
    for preset in deepseek.PRESETS:
        assert preset_family(preset).name == "deepseek"
    assert preset_family("tiny").name == "llama"
    from pretrain_bench.config.schema import ModelSettings

    shape = model_shape(ModelSettings(preset="tiny-moe"), VOCAB)
    assert isinstance(shape, deepseek.DeepseekShape) and model_family(shape).name == "deepseek"
    assert shape.vocab_size == VOCAB
    with pytest.raises(ValueError, match=r"model.overrides.num_experts_per_tok: 9 experts per token"):
        tiny(num_experts_per_tok=9)
    with pytest.raises(ValueError, match="has no transformers class: export is refused"):
        deepseek.hf_config(deepseek.resolve_shape("deepseekmoe-16b"), 64)


def test_the_balance_loss_is_zero_at_alpha_zero_and_trains_the_router_otherwise():
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    off = deepseek.build_model(tiny(aux_loss_alpha=0.0), 64, seed=0, implementation="native").train()
    assert off(input_ids=ids, labels=ids).aux_loss is None
    on = deepseek.build_model(tiny(aux_loss_alpha=0.1), 64, seed=0, implementation="native").train()
    out = on(input_ids=ids, labels=ids)
    assert out.aux_loss > 0
    router = on.model.layers[1].mlp.gate.weight
    (aux_grad,) = torch.autograd.grad(out.aux_loss, router)
    assert aux_grad.abs().sum() > 0


def test_the_bias_update_lowers_the_imbalance_and_forced_routing_balances_exactly():
    def final_violation(rate: float) -> float:
        torch.manual_seed(0)
        model = deepseek.build_model(tiny(bias_update_rate=rate, aux_loss_alpha=0.0), 64, seed=0,
                                     implementation="native").train()
        # a skewed router: some experts start far more likely than the others
        for layer in model.moe_layers():
            layer.gate.weight.data[:2] += 0.2
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(4))
        for _ in range(30):
            loss = model(input_ids=ids, labels=ids).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            last = model.expert_load().clone()
            model.update_router_biases()
            model.reset_expert_load()
        return max_violation(last).mean().item()

    assert final_violation(0.01) < final_violation(0.0)
    balanced = deepseek.build_model(tiny(force_balanced=True), 64, seed=0, implementation="native").train()
    balanced(input_ids=torch.randint(0, VOCAB, (2, 32)))
    load = balanced.expert_load()
    assert (load == load[:, :1]).all() and max_violation(load).abs().max() == 0


def test_the_router_bias_stays_float32_in_a_bf16_model_and_is_saved():
    model = deepseek.build_model(tiny(), 64, seed=0, precision="bf16", implementation="native")
    state = model.state_dict()
    biases = [key for key in state if key.endswith("e_score_correction_bias")]
    assert biases and all(state[key].dtype == torch.float32 for key in biases)
    assert isinstance(model, NativeDeepseekForCausalLM) and model.lm_head.weight.dtype == torch.bfloat16
