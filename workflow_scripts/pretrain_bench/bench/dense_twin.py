"""The dense LLaMA twin of a DeepSeek mixture-of-experts shape: the same depth, width, heads and vocabulary, and the
SwiGLU width that gives the same training FLOPs per token as the MoE model's active path (each family's own
flops_per_token, through the registry). bench/bench_moe_vs_dense.py times the two against each other: tokens/s at
equal FLOPs per token is what the MoE model's routing, dispatch, smaller GEMMs and latent attention cost beyond a
dense model's."""
from __future__ import annotations

from pretrain_bench.train.models import deepseek, llama
from pretrain_bench.train.models.registry import model_family

# The twin's FFN width is a multiple of this (CPU GEMMs prefer round sizes); the FLOPs it leaves unmatched are
# reported beside the timing (flops_mismatch), a few tenths of a percent for tiny-moe.
WIDTH_MULTIPLE = 16


def dense_twin(shape: deepseek.DeepseekShape, seq_len: int) -> llama.ModelShape:
    """A LLaMA shape with `shape`'s layers, hidden size, heads (every head its own key and value), vocabulary, norm
    and tying, whose intermediate_size makes llama.flops_per_token nearest to deepseek.flops_per_token(shape)
    at `seq_len`: the dense count is linear in the FFN width (6 FLOPs per matmul parameter, 3 × hidden × width per
    layer: PaLM appendix B, flops.FLOPS_FORMULA)."""
    if shape.hidden_size % shape.num_attention_heads:
        raise ValueError(f"hidden_size {shape.hidden_size} is not divisible by num_attention_heads "
                         f"{shape.num_attention_heads}: no LLaMA twin with the same heads")
    target = model_family(shape).flops_per_token(shape, seq_len)
    base = llama.ModelShape(shape.num_hidden_layers, shape.hidden_size, shape.num_attention_heads,
                            shape.num_attention_heads, 0, shape.vocab_size, rope_theta=shape.rope_theta,
                            rms_norm_eps=shape.rms_norm_eps, tie_word_embeddings=shape.tie_word_embeddings)
    without_ffn = model_family(base).flops_per_token(base, seq_len)
    per_width = 6.0 * 3 * shape.hidden_size * shape.num_hidden_layers  # FLOPs per token per unit of FFN width
    width = max(WIDTH_MULTIPLE, round((target - without_ffn) / per_width / WIDTH_MULTIPLE) * WIDTH_MULTIPLE)
    return llama.ModelShape(**{**base.__dict__, "intermediate_size": width})


def flops_mismatch(shape: deepseek.DeepseekShape, twin: llama.ModelShape, seq_len: int) -> float:
    """The twin's FLOPs per token ÷ the MoE shape's, minus 1 (0.01: the dense model does 1 % more)."""
    return model_family(twin).flops_per_token(twin, seq_len) / model_family(shape).flops_per_token(shape, seq_len) - 1.0
