"""Model shapes (LLaMA architecture via `transformers`) and parameter counting.

Presets name real shapes: `deepseek-7b` is DeepSeek-LLM-7B-Base (30 layers, hidden 4096, 32 heads, FFN 11008,
vocab 102400); `llama-1b` follows TinyLlama-1.1B; `llama-125m` a GPT-3-small-sized LLaMA; `tiny` a few million
parameters for CPU runs.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace


@dataclass(frozen=True)
class ModelShape:
    """Shape of a LLaMA-architecture causal LM."""

    num_hidden_layers: int  # transformer blocks (L)
    hidden_size: int  # model width (H)
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # key/value heads (grouped-query attention when < query heads)
    intermediate_size: int  # SwiGLU FFN width
    vocab_size: int | None  # None: take the tokenizer's vocabulary size
    rope_theta: float = 10000.0  # rotary embedding base
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    tie_word_embeddings: bool = False  # share input embedding and LM head
    extra: dict = field(default_factory=dict)  # any other LlamaConfig field from model.overrides


PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(4, 192, 6, 6, 512, None, tie_word_embeddings=True),
    "llama-125m": ModelShape(12, 768, 12, 12, 2048, 32000),
    "llama-1b": ModelShape(22, 2048, 32, 4, 5632, 32000),
    "deepseek-7b": ModelShape(30, 4096, 32, 32, 11008, 102400),
}


def resolve_shape(preset: str, overrides: dict | None = None, tokenizer_vocab: int | None = None) -> ModelShape:
    """Preset + overrides; the vocabulary is the preset's, or the tokenizer's when the preset leaves it open."""
    if preset not in PRESETS:
        raise ValueError(f"model.preset: unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    shape = PRESETS[preset]
    known = {f.name for f in fields(ModelShape)} - {"extra"}
    overrides = dict(overrides or {})
    extra = {k: overrides.pop(k) for k in list(overrides) if k not in known}
    shape = replace(shape, **overrides, extra={**shape.extra, **extra})
    if shape.vocab_size is None:
        shape = replace(shape, vocab_size=tokenizer_vocab)
    if shape.vocab_size is not None and tokenizer_vocab is not None and shape.vocab_size < tokenizer_vocab:
        raise ValueError(
            f"model vocab_size {shape.vocab_size} is smaller than the tokenizer's {tokenizer_vocab}: "
            "set model.overrides.vocab_size or tokenizer.vocab_size"
        )
    if shape.hidden_size % shape.num_attention_heads:
        raise ValueError(
            f"model: hidden_size {shape.hidden_size} is not divisible by num_attention_heads "
            f"{shape.num_attention_heads}"
        )
    if shape.num_attention_heads % shape.num_key_value_heads:
        raise ValueError(
            f"model: num_attention_heads {shape.num_attention_heads} is not divisible by num_key_value_heads "
            f"{shape.num_key_value_heads}"
        )
    return shape


def count_parameters(shape: ModelShape) -> dict[str, int]:
    """Exact parameter count of `LlamaForCausalLM` with this shape (no bias terms), without building it."""
    h, v, f = shape.hidden_size, shape.vocab_size, shape.intermediate_size
    head_dim = h // shape.num_attention_heads
    kv = shape.num_key_value_heads * head_dim
    attention = h * h + 2 * h * kv + h * h  # q, k, v, o projections
    mlp = 3 * h * f  # gate, up, down (SwiGLU)
    norms = 2 * h
    per_layer = attention + mlp + norms
    embedding = v * h
    head = 0 if shape.tie_word_embeddings else v * h
    total = shape.num_hidden_layers * per_layer + embedding + head + h  # + final norm
    # Parameters that take part in a matmul per token: everything but the input embedding lookup, plus the LM
    # head even when it shares the embedding's weights (it is still a vocab × hidden matmul).
    matmul = total - embedding + (embedding if shape.tie_word_embeddings else 0)
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding, "per_layer": per_layer,
            "matmul": matmul}


def llama_config(shape: ModelShape, seq_len: int):
    """A `transformers.LlamaConfig` for this shape."""
    from transformers import LlamaConfig

    kwargs = {k: v for k, v in asdict(shape).items() if k != "extra"}
    kwargs.update(shape.extra)
    return LlamaConfig(max_position_embeddings=max(seq_len, 2048), use_cache=False, **kwargs)


TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def build_model(shape: ModelShape, seq_len: int, seed: int, precision: str = "fp32", device: str = "cpu"):
    """A freshly initialised `LlamaForCausalLM`, built directly on `device` in the training precision.

    One copy of the weights in the dtype training uses, where training uses it: a 7B model on 3 CUDA ranks needs no
    host RAM to be built (an fp32 build on the host first took 4Ψ bytes per rank), and a CPU rank holds 2Ψ in
    bf16 instead of 4Ψ + 2Ψ while DeepSpeed casts. Initialisation draws from the seeded generator of that device.
    """
    import torch
    from transformers import LlamaForCausalLM

    dtype = getattr(torch, TORCH_DTYPES[precision])
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(llama_config(shape, seq_len))
    finally:
        torch.set_default_dtype(previous)
    return model
