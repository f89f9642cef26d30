"""model.implementation native: the LLaMA architecture as plain torch modules, without importing `transformers`.

The same model as transformers' `LlamaForCausalLM` for the shapes this package builds (RMSNorm before attention and
before the SwiGLU MLP, rotary position embeddings of the default kind, grouped-query attention, no bias terms, the LM
head optionally tied to the input embedding): the same parameter names and shapes, so its state dict loads into
`LlamaForCausalLM` and back strictly, checkpoints and the HF export do not depend on which class trained them, and
the same initialisation (normal(0, 0.02) for every linear and embedding weight, ones for the norms, drawn in
transformers' order so one seed gives the same weights in either class). What it saves is start-up: a rank that
builds it never imports transformers (README, "The model class").

Written from the LLaMA papers' architecture (Touvron et al. 2023) and transformers' modeling_llama as the reference
for the numerics (float32 RMSNorm, rotary tables computed in float32, float32 softmax in the eager kernel).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pretrain_bench.config.checks import check_native_kernel
from pretrain_bench.train.settings import ConfigError

# LlamaConfig's default initializer_range: the standard deviation of every linear and embedding weight at init.
INITIALIZER_RANGE = 0.02
# ModelShape.extra (LlamaConfig fields from model.overrides or an init_from config.json) that leave this model's maths
# and weights as they are; any other extra field is refused rather than silently ignored.
NEUTRAL_EXTRA = frozenset({"max_position_embeddings", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id"})


def check_native(shape, attn_implementation: str | None) -> None:
    """Refuse what the native model does not implement, naming the key: a kernel other than sdpa/eager, and
    LlamaConfig fields beyond the shape (llama3 RoPE scaling, another activation, biases, ...)."""
    check_native_kernel(attn_implementation)
    unsupported = sorted(set(shape.extra) - NEUTRAL_EXTRA)
    if unsupported:
        raise ConfigError(f"model.implementation native builds the default LLaMA (default RoPE, SiLU, no biases) and "
                          f"does not implement the LlamaConfig field(s) {unsupported}: set model.implementation "
                          "transformers")


@dataclass
class CausalLMOutput:
    """What the forward pass returns: `.logits` (B, T, vocab), and `.loss` when labels were given (as transformers'
    CausalLMOutputWithPast, which the training step, the held-out evaluation and the engines read)."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in float32 and scaled in the input's dtype."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """RoFormer (Su et al. 2021) §3.2.2: theta_i = base^(-2i/d) for i < d/2, in float32."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


class RotaryEmbedding(nn.Module):
    """The cos/sin tables of rotary position embeddings for positions 0..T-1 (computed each forward in float32)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", rope_frequencies(head_dim, theta), persistent=False)

    def reset_parameters(self) -> None:
        self.inv_freq.copy_(rope_frequencies(self.head_dim, self.theta))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float32)  # (1, T, D/2)
        angles = torch.cat((angles, angles), dim=-1)  # (1, T, D): the halves layout of LLaMA's HF weights
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, heads, T, D) queries or keys by their positions' angles ((1, T, D) tables)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Causal grouped-query self-attention (Ainslie et al. 2023): `num_key_value_heads` key/value heads shared by
    groups of query heads."""

    def __init__(self, shape, kernel: str):
        super().__init__()
        self.heads, self.kv_heads = shape.num_attention_heads, shape.num_key_value_heads
        self.head_dim = shape.hidden_size // self.heads
        self.kernel = kernel
        width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.q_proj = nn.Linear(shape.hidden_size, width, bias=False)
        self.k_proj = nn.Linear(shape.hidden_size, kv_width, bias=False)
        self.v_proj = nn.Linear(shape.hidden_size, kv_width, bias=False)
        self.o_proj = nn.Linear(width, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        scale = self.head_dim ** -0.5
        if self.kernel == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=length > 1, scale=scale,
                                                 enable_gqa=self.heads != self.kv_heads)  # (B, H, T, D)
        else:
            out = self.eager_attention(q, k, v, scale)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))  # (B, T, hidden)

    def eager_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """The reference kernel: matmul, causal mask, softmax in float32, matmul."""
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, H, T, D)
        scores = torch.matmul(q, k.transpose(2, 3)) * scale  # (B, H, T, T)
        length = q.shape[2]
        future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(weights, v)


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, shape):
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    """One pre-norm transformer block: x + attention(norm(x)), then + mlp(norm(x))."""

    def __init__(self, shape, kernel: str):
        super().__init__()
        self.self_attn = Attention(shape, kernel)
        self.mlp = MLP(shape)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    """Embedding, decoder blocks (`layers`, which per-block compile and FSDP's wrapping walk) and the final norm."""

    def __init__(self, shape, kernel: str):
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderBlock(shape, kernel) for _ in range(shape.num_hidden_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(shape.hidden_size // shape.num_attention_heads, shape.rope_theta)
        self.checkpoint_block = None  # gradient_checkpointing_enable: torch's checkpoint with the engine's kwargs

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (B, T, hidden)
        positions = torch.arange(input_ids.shape[1], device=x.device).unsqueeze(0)  # (1, T)
        cos, sin = self.rotary_emb(x, positions)
        for block in self.layers:
            if self.checkpoint_block is not None and self.training:
                x = self.checkpoint_block(block, x, cos, sin)
            else:
                x = block(x, cos, sin)
        return self.norm(x)


class NativeLlamaForCausalLM(nn.Module):
    """LLaMA causal LM with `LlamaForCausalLM`'s module tree (`model.embed_tokens`, `model.layers[i].self_attn.q_proj`,
    ..., `lm_head`), built from a `model.ModelShape`."""

    def __init__(self, shape, attn_implementation: str | None = None):
        super().__init__()
        check_native(shape, attn_implementation)
        self.config = shape  # read as model.config.tie_word_embeddings / .vocab_size, as on a transformers model
        self.attn_implementation = attn_implementation or "sdpa"  # transformers' default choice with torch >= 2.1
        # transformers' order of random draws, so one seed gives `LlamaForCausalLM`'s weights: the body is built
        # (torch's default inits) and initialised, then the head is built and initialised (each PreTrainedModel's
        # post_init initialises its own modules when it is constructed).
        self.model = initialise(LlamaBody(shape, self.attn_implementation))
        self.lm_head = initialise(nn.Linear(shape.hidden_size, shape.vocab_size, bias=False))
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """Recompute each decoder block's activations in the backward pass (train.activation_checkpointing), with
        torch's checkpoint and these keyword arguments (None: non-reentrant, transformers' default)."""
        kwargs = {"use_reentrant": False} if gradient_checkpointing_kwargs is None else gradient_checkpointing_kwargs
        self.model.checkpoint_block = functools.partial(checkpoint, **kwargs)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> CausalLMOutput:
        logits = self.lm_head(self.model(input_ids))  # (B, T, vocab)
        loss = None
        if labels is not None:  # transformers' causal-LM loss: predict token t+1 from t, -100 ignored
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return CausalLMOutput(logits=logits, loss=loss)


@torch.no_grad()
def initialise(module: nn.Module) -> nn.Module:
    """transformers' initialisation for LLaMA (PreTrainedModel._init_weights), each module after its children
    (PreTrainedModel.initialize_weights' order): normal(0, 0.02) for linear and embedding weights, ones for norms."""
    for part in post_order(module):
        if isinstance(part, (nn.Linear, nn.Embedding)):
            part.weight.normal_(mean=0.0, std=INITIALIZER_RANGE)
        elif isinstance(part, RMSNorm):
            part.weight.fill_(1.0)
        elif isinstance(part, RotaryEmbedding):
            part.reset_parameters()
    return module


def post_order(module: nn.Module):
    """Every module below and including `module`, children before their parent (nn.Module.apply's order)."""
    for child in module.children():
        yield from post_order(child)
    yield module
