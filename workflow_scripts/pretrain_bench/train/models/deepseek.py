"""Model shapes of the DeepSeek family (mixture-of-experts feed-forward layers and multi-head latent attention, via
`transformers`' DeepseekV3ForCausalLM / DeepseekV2ForCausalLM or the native twin), parameter counting and FLOPs.

Presets name real shapes: `deepseek-v3` is DeepSeek-V3 (61 layers, 256 routed experts of which 8 per token, MLA with
a compressed query), `deepseek-v2` DeepSeek-V2 (60 layers, 160 routed experts, 6 per token),
`deepseek-v2-lite` DeepSeek-V2-Lite (27 layers, 64 routed experts, 6 per token, MLA with a plain query),
`deepseekmoe-16b` DeepSeekMoE-16B (28 layers, 64 routed experts, plain multi-head attention: it has no transformers
class, so it trains with model.implementation native and is not exported), and `tiny-moe` a few million
parameters in DeepSeek-V3's style for CPU runs.

Three fields are training knobs that belong to the model because its forward pass and its state carry them:
`aux_loss_alpha` (the sequence-wise balance loss added to the loss), `bias_update_rate` (DeepSeek-V3's
auxiliary-loss-free balancing: the router's per-expert bias, moved after each optimizer step by
`update_router_biases`) and `force_balanced` (a benchmark switch that routes tokens round-robin so every expert gets
the same load, to time a perfectly balanced MoE layer). transformers' classes implement none of them: they train
with aux_loss_alpha 0, a still bias and the router's own choice.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from pretrain_bench.train.models.family import AttentionDims, ModelFamily, MoeDims, preset_with_overrides
from pretrain_bench.train.models.llama import TORCH_DTYPES

SCORING_FUNCS = ("softmax", "sigmoid")  # DeepSeek-V2 / DeepSeekMoE's softmax router, DeepSeek-V3's sigmoid router
ROUTER_WEIGHT = re.compile(r"\.mlp\.gate\.(weight|e_score_correction_bias)$")  # not the dense FFN's gate_proj
TOPK_METHODS = ("greedy", "group_limited")  # top-k over all routed experts, or within the best topk_group groups
HF_MODEL_TYPES = ("deepseek_v3", "deepseek_v2", None)  # None: no transformers class (DeepSeekMoE's plain attention)
# transformers' name for topk_method group_limited, by model type: V2's router ranks a group by its best score
# ("group_limited_greedy"), V3's by the sum of its two best biased scores ("noaux_tc" in DeepSeek's config.json,
# the only method transformers' DeepseekV3TopkRouter runs).
HF_TOPK_METHODS = {"deepseek_v2": {"greedy": "greedy", "group_limited": "group_limited_greedy"},
                   "deepseek_v3": {"greedy": "noaux_tc", "group_limited": "noaux_tc"}}
HF_ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"}


@dataclass(frozen=True)
class DeepseekShape:
    """Shape of a DeepSeek-architecture causal LM: a few dense layers, then mixture-of-experts layers (shared experts
    that see every token plus routed experts of which a router picks num_experts_per_tok per token), with multi-head
    latent attention (MLA, DeepSeek-V2 §2.1) or, when kv_lora_rank is None, plain multi-head attention."""

    num_hidden_layers: int  # transformer blocks (L)
    hidden_size: int  # model width (H)
    num_attention_heads: int  # attention heads (every head has its own keys and values: no grouped-query sharing)
    vocab_size: int | None  # None: take the tokenizer's vocabulary size
    intermediate_size: int = 18432  # SwiGLU FFN width of the first_k_dense_replace dense layers
    moe_intermediate_size: int = 2048  # SwiGLU FFN width of one expert (routed or shared)
    n_routed_experts: int = 256  # routed experts per MoE layer (E)
    n_shared_experts: int = 1  # shared experts per MoE layer, run as one SwiGLU FFN n_shared × moe_intermediate wide
    num_experts_per_tok: int = 8  # routed experts each token is sent to (K)
    first_k_dense_replace: int = 3  # the first layers keep a dense FFN; every later layer is an MoE layer
    routed_scaling_factor: float = 2.5  # the routed experts' gate weights are multiplied by this
    norm_topk_prob: bool = True  # the K chosen gate weights are normalised to sum to 1 (before the scaling)
    scoring_func: str = "sigmoid"  # router affinities: "softmax" (V2, DeepSeekMoE) or "sigmoid" (V3)
    topk_method: str = "group_limited"  # "greedy", or "group_limited": experts only from the best topk_group groups
    n_group: int = 8  # expert groups for group_limited routing (E must divide into them)
    topk_group: int = 4  # groups a token's experts may come from
    q_lora_rank: int | None = 1536  # query compression rank (q_a_proj → norm → q_b_proj); None: one q_proj
    kv_lora_rank: int | None = 512  # key/value latent rank (MLA); None: plain multi-head attention (DeepSeekMoE)
    qk_nope_head_dim: int = 128  # per-head query/key dims without rotary position embedding
    qk_rope_head_dim: int = 64  # per-head query/key dims with rotary position embedding (shared key in MLA)
    v_head_dim: int = 128  # per-head value dims
    rope_theta: float = 10000.0  # rotary embedding base
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    tie_word_embeddings: bool = False  # share input embedding and LM head
    hf_model_type: str | None = "deepseek_v3"  # transformers class: "deepseek_v3", "deepseek_v2", None (no export)
    aux_loss_alpha: float = 0.0  # sequence-wise balance loss coefficient α (DeepSeek-V3 eq. 17); 0: none
    bias_update_rate: float = 0.0  # auxiliary-loss-free bias update speed γ (DeepSeek-V3 §2.1.2); 0: bias stays
    force_balanced: bool = False  # benchmark switch: route token t to experts (t·K + j) mod E, weights 1/K
    extra: dict = field(default_factory=dict)  # any other DeepseekV3Config / DeepseekV2Config field from overrides


# Each preset from its published config.json; the parameter counts are compared with the published ones in
# tests/unit/test_deepseek_family.py (count_parameters: total within 1 %).
PRESETS: dict[str, DeepseekShape] = {
    # deepseek-ai/DeepSeek-V3, config.json (its yarn rope_scaling, for the 128K-context extension after pre-training,
    # is left out: pre-training ran at 4K with plain RoPE). α and γ from the DeepSeek-V3 report §4.2 (α = 0.0001,
    # γ = 0.001 for the first 14.3T tokens); its config.json's aux_loss_alpha 0.001 is unused by its noaux_tc router.
    "deepseek-v3": DeepseekShape(61, 7168, 128, 129280, intermediate_size=18432, moe_intermediate_size=2048,
                                 n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
                                 first_k_dense_replace=3, routed_scaling_factor=2.5, norm_topk_prob=True,
                                 scoring_func="sigmoid", topk_method="group_limited", n_group=8, topk_group=4,
                                 q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                 v_head_dim=128, hf_model_type="deepseek_v3", aux_loss_alpha=0.0001,
                                 bias_update_rate=0.001),
    # deepseek-ai/DeepSeek-V2, config.json (236B total, 21B activated; topk_method group_limited_greedy, 8 groups
    # of which 3, norm_topk_prob false, scaling 16.0, aux_loss_alpha 0.003 with seq_aux true; yarn left out as
    # above). Its published training cost is one of the report's claims (report/experts.py).
    "deepseek-v2": DeepseekShape(60, 5120, 128, 102400, intermediate_size=12288, moe_intermediate_size=1536,
                                 n_routed_experts=160, n_shared_experts=2, num_experts_per_tok=6,
                                 first_k_dense_replace=1, routed_scaling_factor=16.0, norm_topk_prob=False,
                                 scoring_func="softmax", topk_method="group_limited", n_group=8, topk_group=3,
                                 q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                 v_head_dim=128, hf_model_type="deepseek_v2", aux_loss_alpha=0.003),
    # deepseek-ai/DeepSeek-V2-Lite, config.json (topk_method greedy, n_group 1, norm_topk_prob false, scaling 1.0,
    # aux_loss_alpha 0.001 with seq_aux true; yarn rope_scaling left out as above).
    "deepseek-v2-lite": DeepseekShape(27, 2048, 16, 102400, intermediate_size=10944, moe_intermediate_size=1408,
                                      n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                                      first_k_dense_replace=1, routed_scaling_factor=1.0, norm_topk_prob=False,
                                      scoring_func="softmax", topk_method="greedy", n_group=1, topk_group=1,
                                      q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                      v_head_dim=128, hf_model_type="deepseek_v2", aux_loss_alpha=0.001),
    # deepseek-ai/deepseek-moe-16b-base, config.json: plain multi-head attention (16 heads of 128, RoPE over the
    # whole head), softmax top-6 greedy, aux_loss_alpha 0.001 with seq_aux true. No transformers class.
    "deepseekmoe-16b": DeepseekShape(28, 2048, 16, 102400, intermediate_size=10944, moe_intermediate_size=1408,
                                     n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                                     first_k_dense_replace=1, routed_scaling_factor=1.0, norm_topk_prob=False,
                                     scoring_func="softmax", topk_method="greedy", n_group=1, topk_group=1,
                                     q_lora_rank=None, kv_lora_rank=None, qk_nope_head_dim=0, qk_rope_head_dim=128,
                                     v_head_dim=128, hf_model_type=None, aux_loss_alpha=0.001),
    # Ours: DeepSeek-V3's design at CPU scale (about 4M parameters with the demo's 2048-token vocabulary).
    "tiny-moe": DeepseekShape(4, 128, 4, None, intermediate_size=512, moe_intermediate_size=288,
                              n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                              routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid",
                              topk_method="group_limited", n_group=4, topk_group=2, q_lora_rank=64, kv_lora_rank=32,
                              qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, hf_model_type="deepseek_v3",
                              aux_loss_alpha=0.0001, bias_update_rate=0.001),
}


def resolve_shape(preset: str, overrides: dict | None = None, tokenizer_vocab: int | None = None) -> DeepseekShape:
    """Preset + overrides (keys that are not DeepseekShape fields go to `extra`); the vocabulary is the preset's, or
    the tokenizer's when the preset leaves it open; an invalid combination is refused naming its key."""
    shape = preset_with_overrides(PRESETS, preset, overrides, tokenizer_vocab)
    check_shape(shape)
    return shape


def check_shape(shape: DeepseekShape) -> None:
    """Refuse a shape the router, the attention or the named transformers class cannot run, naming the key."""
    def refuse(key: str, why: str) -> None:
        raise ValueError(f"model.overrides.{key}: {why}")

    experts, k = shape.n_routed_experts, shape.num_experts_per_tok
    if shape.scoring_func not in SCORING_FUNCS:
        refuse("scoring_func", f"{shape.scoring_func!r} is not one of {list(SCORING_FUNCS)}")
    if shape.topk_method not in TOPK_METHODS:
        refuse("topk_method", f"{shape.topk_method!r} is not one of {list(TOPK_METHODS)}")
    if shape.hf_model_type not in HF_MODEL_TYPES:
        refuse("hf_model_type", f"{shape.hf_model_type!r} is not one of {list(HF_MODEL_TYPES)}")
    if experts < 1 or not 1 <= k <= experts:
        refuse("num_experts_per_tok", f"{k} experts per token must be between 1 and n_routed_experts {experts}")
    if shape.n_shared_experts < 0:
        refuse("n_shared_experts", f"{shape.n_shared_experts} is negative")
    if not 0 <= shape.first_k_dense_replace <= shape.num_hidden_layers:
        refuse("first_k_dense_replace", f"{shape.first_k_dense_replace} is not between 0 and num_hidden_layers "
                                        f"{shape.num_hidden_layers}")
    if shape.topk_method == "group_limited":
        if shape.n_group < 1 or experts % shape.n_group:
            refuse("n_group", f"n_routed_experts {experts} does not divide into {shape.n_group} groups")
        if not 1 <= shape.topk_group <= shape.n_group:
            refuse("topk_group", f"{shape.topk_group} is not between 1 and n_group {shape.n_group}")
        if shape.topk_group * (experts // shape.n_group) < k:
            refuse("topk_group", f"{shape.topk_group} group(s) of {experts // shape.n_group} experts hold fewer than "
                                 f"num_experts_per_tok {k}")
        if shape.scoring_func == "sigmoid" and experts // shape.n_group < 2:
            refuse("n_group", "the sigmoid router ranks a group by its two best experts: each group needs two")
    if shape.scoring_func == "sigmoid" and experts < 2:
        refuse("n_routed_experts", "the sigmoid router needs at least two routed experts")
    if shape.aux_loss_alpha < 0:
        refuse("aux_loss_alpha", f"{shape.aux_loss_alpha} is negative")
    if shape.bias_update_rate < 0:
        refuse("bias_update_rate", f"{shape.bias_update_rate} is negative")
    if shape.bias_update_rate > 0 and shape.scoring_func != "sigmoid":
        refuse("bias_update_rate", "the auxiliary-loss-free bias exists in the sigmoid (DeepSeek-V3) router only")
    if shape.qk_rope_head_dim % 2 or shape.qk_rope_head_dim < 0 or shape.qk_nope_head_dim < 0:
        refuse("qk_rope_head_dim", f"rotary dims {shape.qk_rope_head_dim} must be even (and no dim negative)")
    if shape.qk_nope_head_dim + shape.qk_rope_head_dim < 1 or shape.v_head_dim < 1:
        refuse("qk_nope_head_dim", "a head needs query/key dims and value dims")
    if shape.kv_lora_rank is None and shape.q_lora_rank is not None:
        refuse("q_lora_rank", "plain multi-head attention (kv_lora_rank None) has no query compression")
    if shape.hf_model_type == "deepseek_v3" and shape.scoring_func != "sigmoid":
        refuse("scoring_func", "transformers' DeepseekV3 router scores with a sigmoid; softmax is DeepseekV2's")
    if shape.hf_model_type == "deepseek_v2":
        if shape.scoring_func != "softmax":
            refuse("scoring_func", "transformers' DeepseekV2 router scores with a softmax; sigmoid is DeepseekV3's")
        if shape.norm_topk_prob:
            refuse("norm_topk_prob", "transformers' DeepseekV2 router ignores it (set hf_model_type: null to train "
                                     "it natively without an export)")
    for key in ("num_nextn_predict_layers", "num_mtp_layers"):
        if shape.extra.get(key, 0):
            # transformers' classes have no multi-token prediction module, nor has the native model: trained
            # without one, an export saying it had one would describe something other than what ran
            refuse(key, f"{shape.extra[key]}: multi-token prediction (DeepSeek-V3 §2.2) is not built here, so the "
                        "model trains and exports without it; set it to 0")
    if shape.hf_model_type is not None and shape.kv_lora_rank is None:
        refuse("kv_lora_rank", f"transformers' {HF_ARCHITECTURES[shape.hf_model_type]} has latent attention only: "
                               "plain multi-head attention needs hf_model_type null")


def count_parameters(shape: DeepseekShape) -> dict[str, int]:
    """Exact parameter count of DeepseekV3ForCausalLM / DeepseekV2ForCausalLM (or the native twin) with this shape
    (no bias terms; the router's e_score_correction_bias is a buffer, not a parameter), without building it.

    `active` is what one token passes through (DeepSeek's "activated parameters"): everything but the routed experts
    it is not sent to; `matmul` and `active_matmul` leave out the input embedding (a lookup) like LLaMA's `matmul`."""
    h, v, heads = shape.hidden_size, shape.vocab_size, shape.num_attention_heads
    qk_head = shape.qk_nope_head_dim + shape.qk_rope_head_dim
    if shape.kv_lora_rank is None:  # q, k, v, o projections
        attention = 2 * h * heads * qk_head + 2 * h * heads * shape.v_head_dim
    else:
        if shape.q_lora_rank is None:
            query = h * heads * qk_head  # q_proj
        else:
            query = h * shape.q_lora_rank + shape.q_lora_rank + shape.q_lora_rank * heads * qk_head  # q_a, norm, q_b
        rank = shape.kv_lora_rank
        key_value = h * (rank + shape.qk_rope_head_dim) + rank  # kv_a_proj_with_mqa, kv_a_layernorm
        key_value += rank * heads * (shape.qk_nope_head_dim + shape.v_head_dim)  # kv_b_proj
        attention = query + key_value + heads * shape.v_head_dim * h  # + o_proj
    norms = 2 * h
    expert = 3 * h * shape.moe_intermediate_size  # one routed expert: gate, up, down (SwiGLU)
    shared = 3 * h * shape.moe_intermediate_size * shape.n_shared_experts
    router = shape.n_routed_experts * h
    dense_layer = attention + 3 * h * shape.intermediate_size + norms
    moe_layer = attention + shape.n_routed_experts * expert + shared + router + norms
    dense_layers = shape.first_k_dense_replace
    moe_layers = shape.num_hidden_layers - dense_layers
    embedding = v * h
    head = 0 if shape.tie_word_embeddings else v * h
    total = dense_layers * dense_layer + moe_layers * moe_layer + embedding + head + h  # + final norm
    routed = moe_layers * shape.n_routed_experts * expert
    idle = moe_layers * (shape.n_routed_experts - shape.num_experts_per_tok) * expert  # experts a token skips
    matmul = total - embedding + (embedding if shape.tie_word_embeddings else 0)  # as llama.count_parameters
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding, "matmul": matmul,
            "active": total - idle, "active_matmul": matmul - idle, "expert": routed, "non_expert": total - routed,
            "per_dense_layer": dense_layer, "per_moe_layer": moe_layer, "per_expert": expert,
            "dense_layers": dense_layers, "moe_layers": moe_layers}


FLOPS_FORMULA = ("6N + 6*L*H*(Dqk+Dv)*T (PaLM appendix B with MLA's head dims: Dqk = qk_nope + qk_rope per head for "
                 "QK^T, Dv = v_head_dim for AV; N = matmul parameters one token passes through: all but the input "
                 "embedding and the routed experts it is not sent to)")


def flops_per_token(shape: DeepseekShape, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), FLOPS_FORMULA: flops.py's LLaMA convention (PaLM appendix B,
    the full T × T score matrix, causal or not) with a token's active matmul parameters, and the attention term split
    into QK^T (2·Dqk FLOPs per head and key forward) and AV (2·Dv) — 12·L·H·Q·T when Dqk = Dv = Q."""
    counts = count_parameters(shape)
    qk_head = shape.qk_nope_head_dim + shape.qk_rope_head_dim
    return 6.0 * counts["active_matmul"] + 6.0 * shape.num_hidden_layers * shape.num_attention_heads * (
        qk_head + shape.v_head_dim) * seq_len


def hf_architecture(shape: DeepseekShape) -> str:
    """The transformers class name of this shape; refused for a shape without one (plain multi-head attention)."""
    if shape.hf_model_type is None:
        raise ValueError("a DeepSeek shape with hf_model_type null (DeepSeekMoE-16B's plain multi-head attention, "
                         "e.g. preset deepseekmoe-16b) has no transformers class: export is refused (train it with "
                         "model.implementation native)")
    return HF_ARCHITECTURES[shape.hf_model_type]


def hf_config(shape: DeepseekShape, seq_len: int, attn_implementation: str | None = None):
    """A `transformers.DeepseekV3Config` or `DeepseekV2Config` (hf_model_type) for this shape, without multi-token
    prediction layers and with DeepSeek's interleaved rotary layout; `attn_implementation` as llama_config's."""
    import transformers

    hf_architecture(shape)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "n_shared_experts", "n_routed_experts", "routed_scaling_factor", "kv_lora_rank",
            "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "num_experts_per_tok",
            "first_k_dense_replace", "norm_topk_prob", "rms_norm_eps", "tie_word_embeddings")
    values = asdict(shape)
    kwargs = {key: values[key] for key in keys}
    kwargs.update(num_key_value_heads=shape.num_attention_heads, use_cache=False,
                  max_position_embeddings=max(seq_len, 4096),
                  rope_parameters={"rope_type": "default", "rope_theta": float(shape.rope_theta)})
    # greedy routing is group-limited routing with one group holding every expert
    groups = (shape.n_group, shape.topk_group) if shape.topk_method == "group_limited" else (1, 1)
    kwargs.update(n_group=groups[0], topk_group=groups[1])
    if shape.hf_model_type == "deepseek_v3":
        config_class = transformers.DeepseekV3Config
        kwargs.update(rope_interleave=True, num_mtp_layers=0)
    else:
        config_class = transformers.DeepseekV2Config
        kwargs.update(topk_method=HF_TOPK_METHODS["deepseek_v2"][shape.topk_method])
    kwargs.update(shape.extra)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    return config_class(**kwargs)


def build_model(shape: DeepseekShape, seq_len: int, seed: int, precision: str = "fp32", device: str = "cpu",
                attn_implementation: str | None = None, implementation: str = "transformers"):
    """A freshly initialised DeepseekV3ForCausalLM / DeepseekV2ForCausalLM (model.implementation transformers) or
    its native twin (native_deepseek.NativeDeepseekForCausalLM: same state dict and, for a seed, the same weights),
    built directly on `device` in the training precision, as llama.build_model (the router's weight and bias stay
    float32, as transformers creates them)."""
    import torch

    dtype = getattr(torch, TORCH_DTYPES[precision])
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            if implementation == "native":
                from pretrain_bench.train.models.native_deepseek import NativeDeepseekForCausalLM

                return NativeDeepseekForCausalLM(shape, attn_implementation)
            import transformers

            return getattr(transformers, hf_architecture(shape))(hf_config(shape, seq_len, attn_implementation))
    finally:
        torch.set_default_dtype(previous)


# What a rank imports to build each model.implementation, and to compile it (as llama.MODEL_LIBRARIES).
MODEL_LIBRARIES = {"native": ("pretrain_bench.train.models.native_deepseek",),
                   "transformers": ("transformers.models.deepseek_v3.modeling_deepseek_v3",
                                    "transformers.models.deepseek_v2.modeling_deepseek_v2")}
COMPILER_LIBRARIES = ("torch._dynamo", "torch._inductor.compile_fx")


def model_libraries(implementation: str, compile: bool) -> tuple[str, ...]:
    """The modules a rank imports to build the model class of model.implementation (and with train.compile, to
    compile it)."""
    return MODEL_LIBRARIES[implementation] + (COMPILER_LIBRARIES if compile else ())


class DeepseekFamily(ModelFamily):
    """The DeepSeek MoE architecture (transformers' DeepseekV3ForCausalLM or DeepseekV2ForCausalLM by the shape's
    hf_model_type, or the native twin): every MoE preset."""

    name, shape_type, presets, hf_architecture = "deepseek", DeepseekShape, PRESETS, "DeepseekV3ForCausalLM"
    flops_formula, title = FLOPS_FORMULA, "DeepSeek (MoE + MLA)"

    def card_rows(self, shape: DeepseekShape) -> list[tuple[str, str]]:
        counts = count_parameters(shape)
        attention = ("multi-head latent attention" if shape.kv_lora_rank else "multi-head attention")
        return [("active parameters per token", f"{counts['active']:,}"),
                ("attention", f"{attention}, {shape.num_attention_heads} heads, kv_lora_rank {shape.kv_lora_rank}, "
                              f"q_lora_rank {shape.q_lora_rank}"),
                ("experts", f"{shape.n_routed_experts} routed ({shape.num_experts_per_tok} per token, "
                            f"{shape.moe_intermediate_size} wide) + {shape.n_shared_experts} shared, from layer "
                            f"{shape.first_k_dense_replace + 1}; {shape.scoring_func} router"),
                ("dense FFN width (SwiGLU)", f"{shape.intermediate_size}")]

    def resolve_shape(self, preset: str, overrides: dict | None = None, tokenizer_vocab: int | None = None):
        return resolve_shape(preset, overrides, tokenizer_vocab)

    def describe(self, shape: DeepseekShape) -> dict:
        """The dense keys, and what the report's mixture-of-experts section reads: active and routed-expert
        parameters, the MoE layers and their experts, and the balancing settings."""
        counts = count_parameters(shape)
        return {**super().describe(shape), "active_parameters": counts["active"],
                "expert_parameters": counts["expert"], "moe_layers": counts["moe_layers"],
                "first_moe_layer": shape.first_k_dense_replace, "routed_experts": shape.n_routed_experts,
                "shared_experts": shape.n_shared_experts, "experts_per_token": shape.num_experts_per_tok,
                "aux_loss_alpha": shape.aux_loss_alpha, "bias_update_rate": shape.bias_update_rate,
                "force_balanced": shape.force_balanced}

    def count_parameters(self, shape: DeepseekShape) -> dict[str, int]:
        return count_parameters(shape)

    def memory_dims(self, shape: DeepseekShape) -> dict:
        """The memory model's view of a DeepSeek model: the dense layers' widths (`ffn_size` the dense FFN's,
        `kv_size` the keys and values every head keeps), the MoE layers (`moe`: experts, K, widths, parameters per
        layer, so the states split into expert and non-expert parameters) and the attention's head dims and latents
        (`attention`), from which memory.model.activation_bytes counts each layer."""
        counts = count_parameters(shape)
        heads, qk_head = shape.num_attention_heads, shape.qk_nope_head_dim + shape.qk_rope_head_dim
        moe = MoeDims(dense_layers=shape.first_k_dense_replace, routed_experts=shape.n_routed_experts,
                      experts_per_token=shape.num_experts_per_tok, expert_ffn_size=shape.moe_intermediate_size,
                      shared_ffn_size=shape.n_shared_experts * shape.moe_intermediate_size,
                      dense_layer_parameters=counts["per_dense_layer"], moe_layer_parameters=counts["per_moe_layer"],
                      expert_parameters_per_layer=shape.n_routed_experts * counts["per_expert"],
                      balance_loss=shape.aux_loss_alpha > 0, force_balanced=shape.force_balanced)
        attention = AttentionDims(heads=heads, qk_nope_head_dim=shape.qk_nope_head_dim,
                                  qk_rope_head_dim=shape.qk_rope_head_dim, v_head_dim=shape.v_head_dim,
                                  kv_lora_rank=shape.kv_lora_rank, q_lora_rank=shape.q_lora_rank)
        return {"layers": shape.num_hidden_layers, "hidden_size": shape.hidden_size,
                "kv_size": heads * (qk_head + shape.v_head_dim), "ffn_size": shape.intermediate_size,
                "vocab_size": shape.vocab_size, "moe": moe, "attention": attention}

    def flops_per_token(self, shape: DeepseekShape, seq_len: int) -> float:
        return flops_per_token(shape, seq_len)

    def hf_config(self, shape: DeepseekShape, seq_len: int, attn_implementation: str | None = None):
        return hf_config(shape, seq_len, attn_implementation)

    def keeps_fp32(self, name: str) -> bool:
        """The router's weight and its aux-loss-free bias (`model.layers.N.mlp.gate.weight`,
        `...mlp.gate.e_score_correction_bias`): the native router computes in float32 and the bias moves in steps of
        bias_update_rate, which bf16 cannot resolve; transformers loads them as saved."""
        return bool(ROUTER_WEIGHT.search(name))

    def hf_class(self, shape: DeepseekShape | None = None):
        """The transformers class of `shape` (hf_architecture, DeepseekV3ForCausalLM, without one)."""
        import transformers

        return getattr(transformers, self.hf_architecture if shape is None else hf_architecture(shape))

    def hf_class_for(self, shape: DeepseekShape):
        """The transformers class a shape is exported as (V3 or V2 by its hf_model_type; refused when None)."""
        return self.hf_class(shape)

    def build(self, shape: DeepseekShape, seq_len: int, seed: int, precision: str = "fp32", device: str = "cpu",
              attn_implementation: str | None = None, implementation: str = "transformers"):
        return build_model(shape, seq_len, seed, precision, device, attn_implementation, implementation)

    def model_libraries(self, implementation: str, compile: bool) -> tuple[str, ...]:
        return model_libraries(implementation, compile)
