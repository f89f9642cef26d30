"""The interface every model family implements (`ModelFamily`): what the rest of the pipeline asks of a model without
knowing its architecture. A family owns its shape type and presets, its parameter count, its FLOPs per token (with
the formula's text for the report, from the same place as its value), its HF config and class for the export, and how
a rank builds it. Families are registered by name in registry.py; `model_family(shape)` finds a shape's family by the
shape's type, so no caller branches on an architecture.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class MoeDims:
    """What the memory model (memory.model.RunShape.moe) needs of a mixture-of-experts model's layers: the first
    `dense_layers` layers have a dense SwiGLU FFN (RunShape.ffn_size wide), every later one routed + shared experts."""

    dense_layers: int  # layers with a dense FFN before the MoE layers (first_k_dense_replace)
    routed_experts: int  # E, routed experts per MoE layer
    experts_per_token: int  # K, routed experts each token is sent to
    expert_ffn_size: int  # I, one expert's SwiGLU width (moe_intermediate_size)
    shared_ffn_size: int  # I_s = n_shared × I: the shared experts, run as one SwiGLU FFN
    dense_layer_parameters: int  # one dense layer: attention, FFN, norms
    moe_layer_parameters: int  # one MoE layer: attention, router, shared experts, norms and all E routed experts
    expert_parameters_per_layer: int  # E × 3·H·I: gate_up_proj (E, 2I, H) and down_proj (E, H, I), fused tensors
    balance_loss: bool = False  # the sequence-wise balance loss keeps the router's normalised scores (aux_loss_alpha)
    force_balanced: bool = False  # routing forced to an even spread (train benchmarks): every rank receives its share

    @property
    def largest_expert_tensor(self) -> int:
        """Elements of gate_up_proj (E, 2I, H), all experts' gate and up rows as one parameter: 2/3 of the layer's."""
        return self.expert_parameters_per_layer // 3 * 2


@dataclass(frozen=True)
class AttentionDims:
    """DeepSeek's attention as the activation term needs it: multi-head latent attention (DeepSeek-V2 §2.1), or
    plain multi-head attention when kv_lora_rank is None; every head its own keys and values."""

    heads: int  # n_h
    qk_nope_head_dim: int  # D_nope, per-head query/key dims without rotary embedding
    qk_rope_head_dim: int  # d_rope, per-head query/key dims with it (one shared rotary key in MLA)
    v_head_dim: int  # D_v
    kv_lora_rank: int | None  # r_kv, the key/value latent; None: plain multi-head attention
    q_lora_rank: int | None  # r_q, the query latent; None: one q_proj


class ModelFamily:
    """One model architecture family. Subclasses set the class attributes and implement the methods."""

    name: str = ""
    title: str = ""  # how the model card names the architecture ("LLaMA")
    shape_type: type = object  # the dataclass of this family's shapes (a shape's type names its family)
    presets: dict = {}  # model.preset name → shape (the schema's model.preset enum lists every family's)
    hf_architecture: str = ""  # the transformers class an export is saved as and loads back with
    flops_formula: str = ""  # flops_per_token's formula, as the report prints it

    def resolve_shape(self, preset: str, overrides: dict | None = None, tokenizer_vocab: int | None = None):
        """The shape of `preset` with model.overrides applied (the vocabulary the tokenizer's where the preset leaves
        it open); raises ValueError naming the key of a shape that cannot be built."""
        raise NotImplementedError

    def count_parameters(self, shape) -> dict[str, int]:
        """Parameter counts: at least `total`, `non_embedding` and `matmul` (those in matrix multiplies, for FLOPs);
        a family whose tokens see only some parameters (mixture of experts) adds `active` and `active_matmul`."""
        raise NotImplementedError

    def describe(self, shape) -> dict:
        """What summary.json and the report name the shape by: layers, hidden_size, heads, vocab_size."""
        return {"layers": shape.num_hidden_layers, "hidden_size": shape.hidden_size,
                "heads": shape.num_attention_heads, "vocab_size": shape.vocab_size}

    def card_rows(self, shape) -> list[tuple[str, str]]:
        """The model card's architecture rows beyond parameters, layers, width and vocabulary: (label, value)."""
        return []

    def memory_dims(self, shape) -> dict:
        """What the memory model's activation term needs of a layer, as widths per token: `layers`, `hidden_size`,
        `kv_size` (keys and values kept for attention's backward), `ffn_size` (the FFN width a token passes through)
        and `vocab_size` (memory.model.activation_bytes, ACTIVATION_FORMULA); a mixture-of-experts family adds `moe`
        (MoeDims) and one whose attention is not LLaMA's `attention` (AttentionDims)."""
        raise NotImplementedError

    def model_libraries(self, implementation: str, compile: bool) -> tuple[str, ...]:
        """The modules a rank imports to build this family's class of model.implementation (and with train.compile,
        the compiler's), imported once before CPU ranks are forked (forked_ranks.preload)."""
        raise NotImplementedError

    def flops_per_token(self, shape, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward) at sequence length `seq_len` (flops_formula)."""
        raise NotImplementedError

    def hf_config(self, shape, seq_len: int, attn_implementation: str | None = None):
        """The transformers config of this shape (the export's config.json)."""
        raise NotImplementedError

    def keeps_fp32(self, name: str) -> bool:
        """Whether an exported weight stays float32 whatever the export dtype (a router's, whose choices a 16-bit
        rounding would change); none by default."""
        return False

    def hf_class(self, shape=None):
        """The transformers model class a shape is exported as (by default hf_architecture), imported when asked."""
        import transformers

        return getattr(transformers, self.hf_architecture)

    def build(self, shape, seq_len: int, seed: int, precision: str = "fp32", device: str = "cpu",
              attn_implementation: str | None = None, implementation: str = "transformers"):
        """A freshly initialised model of this shape on `device`, in the training precision."""
        raise NotImplementedError


def preset_with_overrides(presets: dict, preset: str, overrides: dict | None, tokenizer_vocab: int | None):
    """A family's preset shape with model.overrides applied: keys that are not fields of the shape go to its `extra`
    (the HF config's other fields), and the vocabulary is the preset's, or the tokenizer's when the preset leaves it
    open (None); a vocabulary smaller than the tokenizer's is refused. The family checks the result."""
    if preset not in presets:
        raise ValueError(f"model.preset: unknown preset {preset!r}; choose one of {sorted(presets)}")
    shape = presets[preset]
    known = {f.name for f in fields(shape)} - {"extra"}
    overrides = dict(overrides or {})
    extra = {k: overrides.pop(k) for k in list(overrides) if k not in known}
    shape = replace(shape, **overrides, extra={**shape.extra, **extra})
    if shape.vocab_size is None:
        shape = replace(shape, vocab_size=tokenizer_vocab)
    if shape.vocab_size is not None and tokenizer_vocab is not None and shape.vocab_size < tokenizer_vocab:
        raise ValueError(f"model vocab_size {shape.vocab_size} is smaller than the tokenizer's {tokenizer_vocab}: "
                         "set model.overrides.vocab_size or tokenizer.vocab_size")
    return shape
