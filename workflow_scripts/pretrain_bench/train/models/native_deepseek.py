"""model.implementation native for the DeepSeek family: multi-head latent attention and mixture-of-experts layers as
plain torch modules, without importing `transformers`.

The same model as transformers' `DeepseekV3ForCausalLM` (sigmoid router, group-limited top-k with the
auxiliary-loss-free bias) or `DeepseekV2ForCausalLM` (softmax router) for a `deepseek.DeepseekShape`: the same
parameter and buffer names and shapes (the routed experts as two 3-D tensors per layer, `experts.gate_up_proj`
(E, 2I, H) and `experts.down_proj` (E, H, I), as transformers 5 stores them), so its state dict loads into the
transformers class and back strictly; the same initialisation, drawn in transformers' order (normal(0, 0.02) for every
linear, embedding, router and expert weight, ones for the norms, zeros for the router bias). A shape without a
transformers class (hf_model_type None, kv_lora_rank None: DeepSeekMoE-16B) gets plain multi-head attention
(q_proj, k_proj, v_proj, o_proj, as DeepSeekMoE's own code names them) with RoPE over each head's last
qk_rope_head_dim dims in LLaMA's halves layout.

Beyond transformers' classes, which only run inference-style routing, this model trains the routing:
- the sequence-wise balance loss (DeepSeek-V3 report §2.1.2, eqs. 17–20), `aux_loss_alpha` × Σ over MoE layers,
  added to `.loss` in training mode and returned alone as `.aux_loss`;
- the auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2): every MoE layer counts the tokens routed to each expert
  in training forward passes (`expert_load()`, plain tensors a trainer can all-reduce), and `update_router_biases`
  moves each expert's bias by bias_update_rate × sign(mean load − its load) after an optimizer step;
- `force_balanced`: round-robin routing, every expert the same load, for benchmarks.

Written from the DeepSeek-V2 and V3 reports (Liu et al. 2024, arXiv 2405.04434 and 2412.19437) and DeepSeekMoE
(Dai et al. 2024, arXiv 2401.06066), with transformers' modeling_deepseek_v3 / _v2 (5.24) as the reference for the
numerics (float32 router, the rotary layouts, the experts' float32 weighting and sum over a token's slots).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pretrain_bench.config.checks import check_native_kernel
from pretrain_bench.train.models.expert_parallel import routed_across
from pretrain_bench.train.models.native_llama import (
    INITIALIZER_RANGE,
    NEUTRAL_EXTRA,
    RMSNorm,
    post_order,
    rope_frequencies,
    rotate_half,
)
from pretrain_bench.train.settings import ConfigError

# transformers' RMSNorm default epsilon, which the query and key/value latent norms use whatever rms_norm_eps is
LATENT_NORM_EPS = 1e-6
# The grouped GEMM of the experts: torch.nn.functional.grouped_mm (torch >= 2.10), else torch._grouped_mm
GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
# Experts.kernel: "auto" (grouped GEMM where grouped_mm_usable, else the loop), "grouped_mm" or "loop"
EXPERT_KERNELS = ("auto", "grouped_mm", "loop")


def check_native(shape, attn_implementation: str | None) -> None:
    """Refuse what the native model does not implement, naming the key: a kernel other than sdpa/eager, and config
    fields beyond the shape (yarn RoPE scaling, another activation, attention biases, ...)."""
    check_native_kernel(attn_implementation)
    unsupported = sorted(set(shape.extra) - NEUTRAL_EXTRA)
    if unsupported:
        raise ConfigError(f"model.implementation native builds DeepSeek's default architecture (plain RoPE, SiLU, no "
                          f"biases) and does not implement the config field(s) {unsupported}: set "
                          "model.implementation transformers")


@dataclass
class MoeCausalLMOutput:
    """What the forward pass returns: `.logits` (B, T, vocab); `.loss` when labels were given (cross-entropy, plus
    `.aux_loss` in training mode); `.aux_loss`, the sequence-wise balance loss already × aux_loss_alpha (None when
    alpha is 0 or in eval mode)."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


class RotaryAngles(nn.Module):
    """The rotary angles position × theta_i of positions 0..T-1 (RoFormer §3.2.2), in float32, over the
    qk_rope_head_dim rotated dims of a head."""

    def __init__(self, rope_dim: int, theta: float):
        super().__init__()
        self.rope_dim, self.theta = rope_dim, theta
        self.register_buffer("inv_freq", rope_frequencies(rope_dim, theta), persistent=False)

    def reset_parameters(self) -> None:
        self.inv_freq.copy_(rope_frequencies(self.rope_dim, self.theta))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return positions[..., None].float() * self.inv_freq.to(device=positions.device, dtype=torch.float32)


def rotary_tables(angles: torch.Tensor, layout: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rotation tables of (1, T, D/2) `angles` for a rotary `layout`: "v3" (transformers' DeepseekV3): cos, sin
    (1, T, D/2) in the model's dtype, taken from the (1, T, D) tables it computes; "v2" (DeepseekV2): e^(i·angle)
    (1, T, D/2) complex64, and None; "halves" (LLaMA's): cos, sin (1, T, D) in the model's dtype."""
    if layout == "v2":
        return torch.polar(torch.ones_like(angles), angles), None
    full = torch.cat((angles, angles), dim=-1)  # (1, T, D)
    cos, sin = full.cos().to(dtype), full.sin().to(dtype)
    if layout == "v3":
        half = angles.shape[-1]
        return cos[..., :half], sin[..., :half]  # (1, T, D/2)
    return cos, sin


def apply_rotary(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor | None], layout: str) -> torch.Tensor:
    """Rotate (B, heads, T, D) rotary parts by their positions' angles (rotary_tables). DeepSeek's weights pair dims
    (2i, 2i+1), rotated by theta_i: "v3" returns the pairs' first then second elements (transformers'
    apply_rotary_pos_emb_interleave: a permutation of the dims that queries and keys share, so the scores are the
    same), "v2" keeps them interleaved, computed as complex products in float32 (transformers' apply_rotary_emb);
    "halves" pairs dim i with i + D/2 (LLaMA, DeepSeekMoE)."""
    if layout == "v2":
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (B, heads, T, D/2): x_2i + i·x_2i+1
        return torch.view_as_real(pairs * tables[0].unsqueeze(1)).flatten(3).to(x.dtype)  # (B, heads, T, D)
    cos, sin = tables[0].unsqueeze(1), tables[1].unsqueeze(1)  # (1, 1, T, D/2) or (1, 1, T, D)
    if layout == "halves":
        return x * cos + rotate_half(x) * sin
    even, odd = x[..., 0::2], x[..., 1::2]  # (B, heads, T, D/2)
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


def attention_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, kernel: str) -> torch.Tensor:
    """Causal attention of (B, heads, T, Dqk) queries and keys over (B, heads, T, Dv) values: torch's
    scaled_dot_product_attention, or the reference kernel (matmul, causal mask, softmax in float32, matmul)."""
    length = q.shape[2]
    if kernel == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=length > 1, scale=scale)  # (B, heads, T, Dv)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale  # (B, heads, T, T)
    future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)  # (B, heads, T, Dv)


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2 §2.1.2–2.1.3): keys and values decompressed per head from one
    kv_lora_rank latent (kv_a_proj_with_mqa → kv_a_layernorm → kv_b_proj), with a decoupled rotary key of
    qk_rope_head_dim dims shared by all heads; queries from q_proj or their own low-rank path (q_a_proj →
    q_a_layernorm → q_b_proj)."""

    def __init__(self, shape, kernel: str, layout: str):
        super().__init__()
        self.heads, self.kernel, self.layout = shape.num_attention_heads, kernel, layout
        self.nope, self.rope, self.v_dim = shape.qk_nope_head_dim, shape.qk_rope_head_dim, shape.v_head_dim
        self.rank = shape.kv_lora_rank
        qk_head = self.nope + self.rope
        hidden, width = shape.hidden_size, self.heads * qk_head
        if shape.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, width, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, shape.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(shape.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(shape.q_lora_rank, width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, hidden, bias=False)
        self.scale = qk_head ** -0.5  # no yarn mscale: plain RoPE (DeepSeek-V2 §2.1.3 scales by 1/sqrt(Dqk))

    def forward(self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        batch, length, _ = x.shape
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)  # (B, T, heads·Dqk)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # (B, T, heads·Dqk)
        q = q.view(batch, length, self.heads, -1).transpose(1, 2)  # (B, heads, T, Dqk)
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)  # (B, heads, T, nope), (B, heads, T, rope)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)  # (B, T, R), (B, T, rope)
        k_rot = k_rot.view(batch, 1, length, self.rope)  # (B, 1, T, rope): one rotary key for every head
        q_rot, k_rot = apply_rotary(q_rot, tables, self.layout), apply_rotary(k_rot, tables, self.layout)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))  # (B, T, heads·(nope + Dv))
        kv = kv.view(batch, length, self.heads, -1).transpose(1, 2)  # (B, heads, T, nope + Dv)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # (B, heads, T, nope), (B, heads, T, Dv)
        k = torch.cat((k_nope, k_rot.expand(-1, self.heads, -1, -1)), dim=-1)  # (B, heads, T, Dqk)
        q = torch.cat((q_nope, q_rot), dim=-1)  # (B, heads, T, Dqk)
        out = attention_kernel(q, k, v, self.scale, self.kernel)  # (B, heads, T, Dv)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))  # (B, T, hidden)


class MultiHeadAttention(nn.Module):
    """Plain causal multi-head attention (DeepSeekMoE): every head its own key and value, RoPE over each head's last
    qk_rope_head_dim query/key dims (all of them in DeepSeekMoE-16B, whose qk_nope_head_dim is 0)."""

    def __init__(self, shape, kernel: str, layout: str):
        super().__init__()
        self.heads, self.kernel, self.layout = shape.num_attention_heads, kernel, layout
        self.nope, self.rope, self.v_dim = shape.qk_nope_head_dim, shape.qk_rope_head_dim, shape.v_head_dim
        qk_width, v_width = self.heads * (self.nope + self.rope), self.heads * self.v_dim
        self.q_proj = nn.Linear(shape.hidden_size, qk_width, bias=False)
        self.k_proj = nn.Linear(shape.hidden_size, qk_width, bias=False)
        self.v_proj = nn.Linear(shape.hidden_size, v_width, bias=False)
        self.o_proj = nn.Linear(v_width, shape.hidden_size, bias=False)
        self.scale = (self.nope + self.rope) ** -0.5

    def forward(self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, -1).transpose(1, 2)  # (B, heads, T, Dqk)
        k = self.k_proj(x).view(batch, length, self.heads, -1).transpose(1, 2)  # (B, heads, T, Dqk)
        v = self.v_proj(x).view(batch, length, self.heads, -1).transpose(1, 2)  # (B, heads, T, Dv)
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        k_nope, k_rot = k.split([self.nope, self.rope], dim=-1)
        q = torch.cat((q_nope, apply_rotary(q_rot, tables, self.layout)), dim=-1)  # (B, heads, T, Dqk)
        k = torch.cat((k_nope, apply_rotary(k_rot, tables, self.layout)), dim=-1)  # (B, heads, T, Dqk)
        out = attention_kernel(q, k, v, self.scale, self.kernel)  # (B, heads, T, Dv)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))  # (B, T, hidden)


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): down(silu(gate(x)) * up(x)), `width` wide."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Top-k expert choice for each token, in float32 (`weight` and `e_score_correction_bias` stay float32 under any
    dtype cast of the model, as transformers keeps them).

    softmax (DeepSeek-V2 eq. 10, DeepSeekMoE): s = softmax(u·e); greedy top-k, or group-limited (V2 §2.2.3: the
    topk_group groups with the best single score, the others' scores set to 0); weights s of the chosen experts.
    sigmoid (DeepSeek-V3 eqs. 13–16): s = sigmoid(u·e); experts chosen by s + b (b: the aux-loss-free bias, used for
    the choice only) greedily, or within the topk_group groups whose two best s + b sum highest (the others -inf);
    weights s (without b) of the chosen experts. Then normalised to sum 1 when norm_topk_prob, × routed_scaling_factor.
    """

    def __init__(self, shape):
        super().__init__()
        self.experts, self.top_k = shape.n_routed_experts, shape.num_experts_per_tok
        self.scoring, self.method = shape.scoring_func, shape.topk_method
        self.groups, self.top_groups = shape.n_group, shape.topk_group
        self.normalise, self.scaling = shape.norm_topk_prob, shape.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.experts, shape.hidden_size, dtype=torch.float32))
        if self.scoring == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(self.experts, dtype=torch.float32))
        else:  # DeepSeek-V2's router has no bias (nor transformers' DeepseekV2TopkRouter a buffer for one)
            self.e_score_correction_bias = None

    def _apply(self, fn, recurse=True):
        """A dtype cast of the model (model.to(torch.bfloat16)) leaves the bias float32 (its value unrounded): the
        bias update adds steps of bias_update_rate, which bf16 could not resolve."""
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        moved = self.e_score_correction_bias
        if bias is not None and moved.dtype != torch.float32:
            self._buffers["e_score_correction_bias"] = bias.to(device=moved.device, dtype=torch.float32)
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores (N, E) float32, weights (N, K) float32, expert indices (N, K)) of (N, hidden) tokens."""
        logits = F.linear(x.float(), self.weight.float())  # (N, E)
        if self.scoring == "softmax":
            scores = logits.softmax(dim=-1, dtype=torch.float32)  # (N, E)
            choice = scores
            if self.method == "group_limited":
                best = scores.view(-1, self.groups, self.experts // self.groups).max(dim=-1).values  # (N, G)
                choice = scores.masked_fill(~self.group_mask(best), 0.0)
            weights, indices = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)  # (N, K), (N, K)
        else:
            scores = logits.sigmoid()  # (N, E)
            choice = scores + self.e_score_correction_bias  # (N, E): the bias steers the choice only
            if self.method == "group_limited":
                best = choice.view(-1, self.groups, self.experts // self.groups).topk(2, dim=-1)[0].sum(dim=-1)
                choice = choice.masked_fill(~self.group_mask(best), float("-inf"))  # (N, E)
            indices = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]  # (N, K)
            weights = scores.gather(1, indices)  # (N, K)
        if self.normalise:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return scores, weights * self.scaling, indices

    def group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """(N, E) True for the experts of each token's topk_group best groups ((N, G) `group_scores`)."""
        chosen = torch.topk(group_scores, k=self.top_groups, dim=-1, sorted=False)[1]  # (N, topk_group)
        groups = torch.zeros_like(group_scores).scatter_(1, chosen, 1.0)  # (N, G)
        size = self.experts // self.groups
        return groups.unsqueeze(-1).expand(-1, self.groups, size).reshape(-1, self.experts).bool()  # (N, E)


def grouped_mm_usable(x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> bool:
    """Whether torch's grouped GEMM runs here: on CPU in any float dtype, on CUDA (compute capability 8.0 or more)
    in bf16, and under torch.compile in bf16 only (transformers' _can_use_grouped_mm); its kernels want every row
    stride and base address 16-byte aligned."""
    if GROUPED_MM is None:
        return False
    if x.device.type == "cuda":
        usable = x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    else:
        usable = x.device.type == "cpu"
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        usable = False
    size = x.element_size()
    return usable and all(w.dtype == x.dtype and w.data_ptr() % 16 == 0 and all(n * size % 16 == 0 for n in w.shape[1:])
                          for w in weights)


class Experts(nn.Module):
    """The routed experts of one MoE layer, each a SwiGLU FFN, held as transformers 5 holds them: `gate_up_proj`
    (E, 2I, H: gate rows then up rows) and `down_proj` (E, H, I). Computed batched: the (token, slot) pairs sorted
    by expert, then one grouped GEMM per projection (`kernel` "grouped_mm"), or a loop over the experts (never
    over tokens) with index_select / index_add ("loop"); "auto" takes the grouped GEMM where grouped_mm_usable.
    Each pair's output is weighted in float32 and a token's K outputs summed in float32, as transformers does."""

    def __init__(self, count: int, hidden: int, width: int):
        super().__init__()
        self.count = count
        self.gate_up_proj = nn.Parameter(torch.empty(count, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(count, hidden, width))
        self.kernel = "auto"
        # expert parallelism (expert_parallel.shard_experts): this rank holds `count` of the layer's experts and
        # exchanges the pairs with the ranks holding the others; None: every expert is here
        self.parallel = None

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.parallel is not None:
            return routed_across(self, x, indices, weights)
        tokens, top_k = indices.shape
        slots = indices.reshape(-1)  # (S,) the expert of each (token, slot) pair, S = N·K
        order = torch.sort(slots)[1]  # (S,) the pairs grouped by expert
        counts = torch.bincount(slots, minlength=self.count)  # (E,)
        kernel = self.kernel
        if kernel == "auto":
            kernel = "grouped_mm" if grouped_mm_usable(x, (self.gate_up_proj, self.down_proj)) else "loop"
        if kernel == "grouped_mm":
            return self.grouped(x, order, counts, top_k, weights.reshape(-1)).to(x.dtype)  # (N, H)
        out = self.loop(x, order, counts, top_k, weights.reshape(-1))  # (S, H) float32
        return out.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)  # (N, H)

    def grouped(self, x: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, top_k: int,
                weights: torch.Tensor, projections: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Both projections as grouped GEMMs over the expert-sorted pairs, each pair's output weighted and added to
        its token's row: (N, H) float32.

        The gather is index_select and the combine index_add_ straight into the tokens' rows (their backward passes
        are index_add_ and index_select): indexing the rows with x[...] and putting the pairs back in (token, slot)
        order with out[inverse] had both backward passes run index_put_ with accumulation, 4.9 of a tiny-moe
        step's 120 ms on 2 CPU threads (docs/benchmarks/2026-12-07-moe-vs-dense.md). A token's K outputs are
        still summed in float32; with K = 2 the result is bit for bit the same (a + b = b + a). On CUDA index_add_
        adds with atomics, as the index_put_ it replaces did in the backward pass: with K > 2 the order of a token's
        sum may vary between runs unless torch.use_deterministic_algorithms is on."""
        gate_up_proj, down_proj = projections or (self.gate_up_proj, self.down_proj)  # (cast: grouped_rows)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)  # (E,) end of each expert's rows
        token_of_pair = order // top_k  # (S,) the token of each expert-sorted pair
        rows = x.index_select(0, token_of_pair).to(gate_up_proj.dtype)  # (S, H)
        gate, up = GROUPED_MM(rows, gate_up_proj.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)  # (S, I)
        out = GROUPED_MM(F.silu(gate) * up, down_proj.transpose(-2, -1), offs=offsets)  # (S, H)
        out = out * weights.index_select(0, order).unsqueeze(-1)  # (S, H) float32
        combined = torch.zeros(x.shape[0], out.shape[-1], dtype=out.dtype, device=out.device)  # (N, H)
        return combined.index_add_(0, token_of_pair, out)

    def grouped_rows(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The unweighted outputs (R, H) of (R, H) `rows` already in expert order, `counts` (E,) rows per expert
        (the rows expert parallelism received): grouped GEMMs, or one expert at a time. Rows in 16 bits without
        autocast (FSDP's mixed precision, which leaves the split experts out and so fp32) take the weights cast to
        their dtype, as FSDP casts every other parameter."""
        weights = (self.gate_up_proj, self.down_proj)
        if rows.dtype != weights[0].dtype and not torch.is_autocast_enabled(rows.device.type):
            weights = tuple(w.to(rows.dtype) for w in weights)
        if self.kernel == "grouped_mm" or (self.kernel == "auto" and len(rows) and grouped_mm_usable(rows, weights)):
            ones = torch.ones(len(rows), dtype=torch.float32, device=rows.device)  # × 1 and + 0: exact
            return self.grouped(rows, torch.arange(len(rows), device=rows.device), counts, 1, ones,
                                weights).to(rows.dtype)
        parts, start = [], 0
        for expert, end in enumerate(torch.cumsum(counts, dim=0).tolist()):  # one host sync per layer
            if end > start:
                gate, up = F.linear(rows[start:end], weights[0][expert]).chunk(2, dim=-1)  # (n_e, I)
                parts.append(F.linear(F.silu(gate) * up, weights[1][expert]))  # (n_e, H)
            start = end
        return torch.cat(parts) if parts else rows.new_zeros(0, rows.shape[-1])

    def loop(self, x: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, top_k: int,
             weights: torch.Tensor) -> torch.Tensor:
        """One expert at a time over its pairs; weighted (S, H) float32 in (token, slot) order."""
        out = torch.zeros(order.numel(), x.shape[-1], dtype=torch.promote_types(x.dtype, weights.dtype),
                          device=x.device)  # (S, H)
        start = 0
        for expert, end in enumerate(torch.cumsum(counts, dim=0).tolist()):  # one host sync per layer
            if end > start:
                pairs = order[start:end]  # (n_e,) this expert's (token, slot) pairs
                rows = x.index_select(0, pairs // top_k)  # (n_e, H)
                gate, up = F.linear(rows, self.gate_up_proj[expert]).chunk(2, dim=-1)  # (n_e, I)
                y = F.linear(F.silu(gate) * up, self.down_proj[expert])  # (n_e, H)
                out.index_add_(0, pairs, y * weights.index_select(0, pairs).unsqueeze(-1))
            start = end
        return out


def balanced_routing(tokens: int, top_k: int, experts: int, scaling: float,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """force_balanced: token t to experts (t·K + j) mod E for j < K, weight 1/K × scaling each (indices (N, K),
    weights (N, K) float32): every expert gets N·K/E pairs (exactly, when E divides N·K)."""
    indices = (torch.arange(tokens, device=device).unsqueeze(1) * top_k
               + torch.arange(top_k, device=device)) % experts  # (N, K)
    weights = torch.full((tokens, top_k), scaling / top_k, dtype=torch.float32, device=device)
    return indices, weights


def sequence_balance_loss(scores: torch.Tensor, indices: torch.Tensor, batch: int) -> torch.Tensor:
    """DeepSeek-V3 report eqs. 17–20, without α: per sequence of T tokens, f_i = E / (K·T) · #{t: t chose i},
    P_i = 1/T Σ_t s'_{i,t} with s' the scores normalised over the experts, L = Σ_i f_i·P_i; the mean over the
    batch's sequences. (N, E) float32 `scores`, (N, K) `indices`, N = batch × T."""
    experts, top_k = scores.shape[-1], indices.shape[-1]
    probs = (scores / scores.sum(dim=-1, keepdim=True)).view(batch, -1, experts)  # (B, T, E)
    length = probs.shape[1]
    chosen = indices.reshape(batch, -1)  # (B, T·K)
    picks = torch.zeros(batch, experts, dtype=torch.float32, device=scores.device).scatter_add_(
        1, chosen, torch.ones_like(chosen, dtype=torch.float32))  # (B, E)
    fraction = picks * experts / (top_k * length)  # (B, E) f_i, no gradient
    return (fraction * probs.mean(dim=1)).sum(dim=-1).mean()


class MoE(nn.Module):
    """A DeepSeekMoE layer (DeepSeekMoE §3; DeepSeek-V3 eq. 12): x → Σ_{chosen i} g_i · FFN_i(x) + shared(x), the
    shared experts one SwiGLU FFN n_shared × moe_intermediate wide. Counts the tokens routed to each expert in
    training forward passes (`load`) for the bias update."""

    def __init__(self, shape):
        super().__init__()
        self.top_k, self.count = shape.num_experts_per_tok, shape.n_routed_experts
        self.alpha, self.force_balanced = shape.aux_loss_alpha, shape.force_balanced
        self.experts = Experts(shape.n_routed_experts, shape.hidden_size, shape.moe_intermediate_size)
        self.gate = Router(shape)
        self.shared_experts = MLP(shape.hidden_size, shape.moe_intermediate_size * shape.n_shared_experts)
        # A plain tensor, not a buffer: DDP's buffer broadcast would overwrite every rank's own counts with rank 0's
        self.load = torch.zeros(self.count, dtype=torch.int64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output (B, T, H), α × this layer's sequence-wise balance loss or None) of (B, T, H) `x`."""
        batch, length, hidden = x.shape
        flat = x.reshape(-1, hidden)  # (N, H)
        scores, weights, indices = self.gate(flat)  # (N, E), (N, K), (N, K)
        if self.force_balanced:
            indices, weights = balanced_routing(flat.shape[0], self.top_k, self.count, self.gate.scaling, x.device)
        if self.training:
            self.record_load(indices)
        routed = self.experts(flat, indices, weights).view(batch, length, hidden)
        aux = None
        if self.training and self.alpha > 0:
            aux = self.alpha * sequence_balance_loss(scores, indices, batch)
        return routed + self.shared_experts(x), aux

    @torch.compiler.disable
    @torch.no_grad()
    def record_load(self, indices: torch.Tensor) -> None:
        """Add this forward pass's tokens per expert to `load`; not when activation checkpointing recomputes the
        forward pass inside the backward pass (a graph task is running then), which would count them twice."""
        if torch._C._current_graph_task_id() != -1:
            return
        if self.load.device != indices.device:
            self.load = self.load.to(indices.device)
        self.load += torch.bincount(indices.reshape(-1), minlength=self.count)


class DecoderBlock(nn.Module):
    """One pre-norm transformer block: x + attention(norm(x)), then + ffn(norm(x)), the FFN dense (the first
    first_k_dense_replace blocks) or a MoE layer; returns (x, the MoE layer's balance loss or None)."""

    def __init__(self, shape, index: int, kernel: str, layout: str):
        super().__init__()
        attention = MultiHeadAttention if shape.kv_lora_rank is None else LatentAttention
        self.self_attn = attention(shape, kernel, layout)
        if index >= shape.first_k_dense_replace:
            self.mlp = MoE(shape)
        else:
            self.mlp = MLP(shape.hidden_size, shape.intermediate_size)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def forward(self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor | None]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x + self.self_attn(self.input_layernorm(x), tables)
        if isinstance(self.mlp, MoE):
            out, aux = self.mlp(self.post_attention_layernorm(x))
            return x + out, aux
        return x + self.mlp(self.post_attention_layernorm(x)), None


class DeepseekBody(nn.Module):
    """Embedding, decoder blocks (`layers`, which per-block compile and FSDP's wrapping walk) and the final norm."""

    def __init__(self, shape, kernel: str):
        super().__init__()
        self.layout = "halves" if shape.kv_lora_rank is None else ("v2" if shape.hf_model_type == "deepseek_v2"
                                                                     else "v3")
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderBlock(shape, index, kernel, self.layout)
                                    for index in range(shape.num_hidden_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.rotary_emb = RotaryAngles(shape.qk_rope_head_dim, shape.rope_theta)
        self.checkpoint_block = None  # gradient_checkpointing_enable: torch's checkpoint with the engine's kwargs

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.embed_tokens(input_ids)  # (B, T, hidden)
        positions = torch.arange(input_ids.shape[1], device=x.device).unsqueeze(0)  # (1, T)
        tables = rotary_tables(self.rotary_emb(positions), self.layout, x.dtype)
        aux_total = None
        for block in self.layers:
            if self.checkpoint_block is not None and self.training:
                x, aux = self.checkpoint_block(block, x, tables)
            else:
                x, aux = block(x, tables)
            if aux is not None:
                aux_total = aux if aux_total is None else aux_total + aux
        return self.norm(x), aux_total


class NativeDeepseekForCausalLM(nn.Module):
    """DeepSeek causal LM with DeepseekV3ForCausalLM's (or V2's) module tree (`model.embed_tokens`,
    `model.layers[i].self_attn.kv_b_proj`, `model.layers[i].mlp.experts.gate_up_proj`, `...mlp.gate.weight`, ...,
    `lm_head`), built from a `deepseek.DeepseekShape`.

    What a trainer calls beyond the forward pass: `update_router_biases(load=None)` after each optimizer step (a
    no-op when bias_update_rate is 0; with data parallelism pass the load all-reduced over the ranks,
    `expert_load()` summed); `expert_load()` / `reset_expert_load()` for the load since the last update, and
    `max_violation(load)` for its imbalance."""

    def __init__(self, shape, attn_implementation: str | None = None):
        super().__init__()
        check_native(shape, attn_implementation)
        self.config = shape  # read as model.config.tie_word_embeddings / .vocab_size, as on a transformers model
        self.attn_implementation = attn_implementation or "sdpa"  # transformers' default choice with torch >= 2.1
        # transformers' order of random draws (as native_llama): the body built and initialised, then the head
        self.model = initialise(DeepseekBody(shape, self.attn_implementation))
        self.lm_head = initialise(nn.Linear(shape.hidden_size, shape.vocab_size, bias=False))
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.bias_update_rate = shape.bias_update_rate
        # the balance loss of the training forward passes since the last reset: sum and count (plain tensors, as
        # MoE.load: a report figure, not model state)
        self.aux_sum, self.aux_passes = torch.zeros((), dtype=torch.float64), 0
        # MoE layers an engine replaced with its own (DeepSpeed's AutoEP: engines.autoep.ReplacedMoE), each with the
        # `load` and `gate.e_score_correction_bias` the balancing reads; empty while the model's own layers run
        self.moe_stand_ins: list = []

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """Recompute each decoder block's activations in the backward pass (train.activation_checkpointing), with
        torch's checkpoint and these keyword arguments (None: non-reentrant, transformers' default)."""
        kwargs = {"use_reentrant": False} if gradient_checkpointing_kwargs is None else gradient_checkpointing_kwargs
        self.model.checkpoint_block = functools.partial(checkpoint, **kwargs)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> MoeCausalLMOutput:
        hidden, aux_loss = self.model(input_ids)
        if aux_loss is not None and self.training:
            self.record_aux(aux_loss)
        logits = self.lm_head(hidden)  # (B, T, vocab)
        loss = None
        if labels is not None:  # transformers' causal-LM loss: predict token t+1 from t, -100 ignored
            targets = F.pad(labels, (0, 1), value=-100)[:, 1:]  # (B, T): the last position predicts nothing
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                   ignore_index=-100)
            if aux_loss is not None:
                loss = loss + aux_loss
        return MoeCausalLMOutput(logits=logits, loss=loss, aux_loss=aux_loss)

    @torch.compiler.disable
    @torch.no_grad()
    def record_aux(self, aux_loss: torch.Tensor) -> None:
        """Add one training forward pass's balance loss (α applied) to the mean `aux_loss_mean` reports. This
        forward runs once per micro-batch: activation checkpointing recomputes the blocks, not this."""
        if self.aux_sum.device != aux_loss.device:
            self.aux_sum = self.aux_sum.to(aux_loss.device)
        self.aux_sum += aux_loss.detach().double()
        self.aux_passes += 1

    def aux_loss_mean(self) -> torch.Tensor | None:
        """The mean balance loss (α × Σ over the MoE layers of the sequence-wise loss, as trained on) of the
        training forward passes since the last reset, a 0-d float64 tensor; None when none computed one (the loss is
        off at aux_loss_alpha 0)."""
        return self.aux_sum / self.aux_passes if self.aux_passes else None

    def router_bias_norms(self) -> list[float] | None:
        """The L2 norm of each MoE layer's auxiliary-loss-free bias (e_score_correction_bias), in depth order; None
        for routers without one (softmax scoring)."""
        biases = [layer.gate.e_score_correction_bias for layer in self.moe_layers()]
        if not biases or biases[0] is None:
            return None
        return [float(bias.norm()) for bias in biases]

    def moe_layers(self) -> list[MoE]:
        """The MoE layers, in depth order (or what stands in for them where an engine replaced them)."""
        return [block.mlp for block in self.model.layers if isinstance(block.mlp, MoE)] or self.moe_stand_ins

    def expert_load(self) -> torch.Tensor:
        """(MoE layers, routed experts) int64: tokens routed to each expert in training forward passes since the
        last reset (this rank's only: sum it over the data-parallel ranks, e.g. dist.all_reduce, for the global
        load)."""
        layers = self.moe_layers()
        return torch.stack([layer.load for layer in layers]) if layers else torch.zeros(0, 0, dtype=torch.int64)

    def reset_expert_load(self) -> None:
        """Zero every MoE layer's token counts, and the balance loss's running mean."""
        for layer in self.moe_layers():
            layer.load.zero_()
        self.aux_sum.zero_()
        self.aux_passes = 0

    @torch.no_grad()
    def update_router_biases(self, load: torch.Tensor | None = None) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing (§2.1.2), after an optimizer step: b_i += γ · sign(mean load
        − load_i) per MoE layer, from `load` ((MoE layers, E): the load summed over the data-parallel ranks, so
        every rank moves its biases alike) or this rank's `expert_load()`; then the counts restart. A no-op when
        bias_update_rate γ is 0 (the counts are then kept: reset them with reset_expert_load)."""
        if not self.bias_update_rate:
            return
        load = self.expert_load() if load is None else load
        for layer, counts in zip(self.moe_layers(), load):
            bias = layer.gate.e_score_correction_bias
            counts = counts.to(device=bias.device, dtype=torch.float32)
            bias += self.bias_update_rate * torch.sign(counts.mean() - counts)
        self.reset_expert_load()


def max_violation(load: torch.Tensor) -> torch.Tensor:
    """MaxVio (DeepSeek-V3 report §4.5.2, after Wang et al. 2024): (max_i load_i − mean load) / mean load per MoE
    layer of a (layers, E) `load`; 0 for a perfectly balanced layer (and for one that saw no tokens)."""
    load = load.float()
    mean = load.mean(dim=-1)
    return torch.where(mean > 0, (load.max(dim=-1).values - mean) / mean.clamp(min=1e-12), torch.zeros_like(mean))


@torch.no_grad()
def initialise(module: nn.Module) -> nn.Module:
    """transformers' initialisation for DeepSeek (DeepseekV3PreTrainedModel._init_weights), each module after its
    children (PreTrainedModel.initialize_weights' order): normal(0, 0.02) for linear and embedding weights, for the
    router weight and for the experts' gate_up_proj then down_proj; zeros for the router bias; ones for norms."""
    for part in post_order(module):
        if isinstance(part, (nn.Linear, nn.Embedding)):
            part.weight.normal_(mean=0.0, std=INITIALIZER_RANGE)
        elif isinstance(part, RMSNorm):
            part.weight.fill_(1.0)
        elif isinstance(part, RotaryAngles):
            part.reset_parameters()
        elif isinstance(part, Router):
            part.weight.normal_(mean=0.0, std=INITIALIZER_RANGE)
            if part.e_score_correction_bias is not None:
                part.e_score_correction_bias.zero_()
        elif isinstance(part, Experts):
            part.gate_up_proj.normal_(mean=0.0, std=INITIALIZER_RANGE)
            part.down_proj.normal_(mean=0.0, std=INITIALIZER_RANGE)
    return module
