"""Pre-flight memory model: will a run fit, and if not, what would?

Per rank (GPU, or the host for a CPU run) a run needs
    model states (ZeRO paper)  + activations (estimate)  + DeepSpeed buffers  + runtime overhead,
and, while the model is built, the whole unpartitioned model in the training precision (model.build_model builds
it directly on the rank's device and in that dtype, so no fp32 copy ever exists in host RAM on a CUDA run).
Offloaded states live in host RAM (`cpu`) or on the disk at train.nvme_path (`nvme`, ZeRO-Infinity).
Every term carries its formula so the report can print it beside what was measured. Pure Python: the Snakefile
calls this at DAG time (no torch import) and `plan.make_plan` calls it before a run allocates anything.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pretrain_bench.config.schema import BenchSettings, ModelSettings, TokenizerSettings
from pretrain_bench.core import devices
from pretrain_bench.train.engines.spec import engine_spec
from pretrain_bench.train.models.family import AttentionDims, MoeDims
from pretrain_bench.train.models.registry import model_family, model_shape
from pretrain_bench.train.settings import ConfigError, PlanConfig, TrainSettings

GIB = 1024**3
GB = 10**9

# Bytes a rank holds beyond tensors the model accounts for. CPU: peak RSS of an idle rank (interpreter, torch,
# DeepSpeed, transformers, gloo) measured at ~0.45-0.65 GiB on Linux. CUDA: the CUDA context and allocator slack,
# which torch.cuda.max_memory_allocated does not count but the device must still hold.
RUNTIME_BYTES = {"cpu": int(0.6 * GIB), "cuda": int(1.0 * GIB)}
# Host RAM of a CUDA rank process (CUDA libraries, pinned staging) besides the offloaded states.
CUDA_RANK_HOST_BYTES = int(2.0 * GIB)
# DeepSpeed's default reduce_bucket_size (elements): ZeRO-1/2 keep one gradient bucket of this size, two with
# overlap_comm (on for CUDA in settings.deepspeed_config). CUDA allocates it whole; on CPU only the pages the
# gradients touch become resident, so the bucket counts as min(bucket, Ψ).
REDUCE_BUCKET_ELEMENTS = 500_000_000
PREFETCH_BUCKET_ELEMENTS = 50_000_000  # ZeRO-3 stage3_prefetch_bucket_size default
# ZeRO-Infinity's pinned host staging buffers (DeepSpeed runtime/zero/offload_config.py defaults): parameter swap
# buffers buffer_count 5 × buffer_size 1e8 elements (16-bit), and optimizer swap buffers buffer_count 4 × one
# sub-group (stage3 sub_group_size 1e9 elements, at most the rank's partition) × 4 bytes (fp32).
NVME_PARAM_BUFFER_ELEMENTS = 5 * 100_000_000
NVME_OPTIMIZER_BUFFERS = 4
SUB_GROUP_ELEMENTS = 1_000_000_000
PARAMS_IN_CPU_ELEMENTS = 1_000_000_000  # offload_param.max_in_cpu default: parameters ZeRO-Infinity keeps in RAM

STATE_FORMULAS = {
    # ZeRO paper (Rajbhandari et al. 2020, §3.1 and Fig. 1): mixed-precision Adam holds 2Ψ (16-bit params) +
    # 2Ψ (16-bit grads) + KΨ with K = 12 (fp32 master params, momentum, variance).
    "mixed": {0: "16Ψ (2Ψ params + 2Ψ grads + 12Ψ Adam/master)", 1: "4Ψ + 12Ψ/N", 2: "2Ψ + 14Ψ/N",
              3: "16Ψ/N"},
    # fp32 (derived for DeepSpeed): stage 0 is plain AdamW, 4Ψ params + 4Ψ grads + 8Ψ momentum/variance; ZeRO-1/2
    # also clone an fp32 "master" copy of their partition (stage_1_and_2.py, single_partition_of_fp32_groups), so
    # K = 12 again; ZeRO-3 updates its fp32 partition in place (no copy), K = 8.
    "fp32": {0: "16Ψ (4Ψ params + 4Ψ grads + 8Ψ Adam)", 1: "8Ψ + 12Ψ/N", 2: "4Ψ + 16Ψ/N", 3: "16Ψ/N"},
}
ACTIVATION_FORMULA = (
    "tokens × [L × (b·(6H + 2H_kv + 4F) + 4·2H) + V·(b + 8)] bytes, tokens = micro batch × seq_len, "
    "b = bytes per activation (2 for fp16/bf16, 4 for fp32, where the logits need no fp32 copy: V·8): per layer "
    "the RMSNorm inputs and fp32 copies, Q/K/V, attention output (SDPA keeps no s² scores), SwiGLU "
    "gate/up/act/product; logits plus their fp32 copy and log-softmax (adapted from Korthikanti et al. 2022 to "
    "LLaMA blocks without dropout); with activation checkpointing L × b·H layer inputs + one layer recomputed"
)
# A DeepSeek model (RunShape.moe / RunShape.attention set) replaces the per-layer term, layer by layer; the rest of
# ACTIVATION_FORMULA (logits, embedding output, checkpointing) stays. Its text, for the report, beside its value in
# moe_layer_activations / attention_activations.
MOE_ACTIVATION_FORMULA = (
    "per layer: attention (MLA: b·(2H + 2r_q + (r_kv + d_rope) + r_kv + 2·n_h·D_qk + n_h·(D_nope + D_v) + n_h·D_qk "
    "+ n_h·D_v) + 4·(H + r_q + r_kv): norm input and output, the query latent and its norm, q_b's output and the "
    "rotated q, the key/value latent with the shared rotary key and its norm, kv_b's keys and values, the rotated k, "
    "the attention output; plain multi-head attention b·(2H + 4·n_h·D_qk + 2·n_h·D_v)) + FFN (dense: b·(2H + 4F) + "
    "4H; MoE: b·(2H + f·K·(2H + 4I) + 4·I_s) + 4H + 4·(H if b = 2) + 4·E·(1 + balance loss): the K dispatched "
    "copies of each token through its experts' SwiGLU, f = EP·min(K, E/EP)/K on the busiest expert-parallel rank (1 "
    "without expert parallelism), the shared experts' SwiGLU I_s = n_shared·I wide, the router's fp32 "
    "input and scores); with activation checkpointing L × b·H layer inputs + the largest layer recomputed"
)


@dataclass(frozen=True)
class RunShape:
    """What the memory model needs to know about one run."""

    parameters: int  # Ψ, all trainable parameters
    layers: int  # L
    hidden_size: int  # H
    kv_size: int  # H_kv = key/value heads × head dim
    ffn_size: int  # F, SwiGLU intermediate width
    vocab_size: int  # V
    seq_len: int
    micro_batch_size: int
    ranks: int  # N, data-parallel ranks (gpus × nodes)
    zero_stage: int
    precision: str  # fp16 | bf16 | fp32
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_param: str = "none"  # none | cpu | nvme (ZeRO-3)
    activation_checkpointing: bool = False
    device: str = "cuda"  # cuda | cpu
    pinned_rounding: bool = False  # pinned host buffers rounded up to powers of two (see PINNED_ROUNDING)
    engine: str = "deepspeed"  # deepspeed | ddp | fsdp (train.engine)
    moe: MoeDims | None = None  # a mixture-of-experts model's layers (None: dense)
    attention: AttentionDims | None = None  # DeepSeek's attention (None: LLaMA's, H wide with H_kv keys/values)
    expert_parallel: int = 1  # EP: ranks each MoE layer's experts are split over (1: every rank holds all)

    @property
    def largest_parameter(self) -> int:
        """Elements of the largest single parameter: the embedding / LM head (V × H), an FFN matrix (H × F), or a
        MoE layer's fused gate_up_proj (E, 2I, H) of the experts a rank holds."""
        dense = max(self.vocab_size * self.hidden_size, self.hidden_size * self.ffn_size,
                    self.hidden_size * self.hidden_size)
        return max(dense, self.held_experts(self.moe.largest_expert_tensor)) if self.moe else dense

    # ---- mixture of experts: expert vs non-expert parameters --------------------------------------------------

    def expert_group(self) -> tuple[int, int]:
        """(EP, N/EP): with expert parallelism each rank holds 1/EP of every MoE layer's experts, replicated over the
        N/EP ranks of its expert-data-parallel group, over which ZeRO and FSDP partition their states. The one place
        EP enters the memory model (train.expert_parallel, which the DDP engine builds; 1: every rank holds all
        of them)."""
        if self.ranks % self.expert_parallel:
            raise ValueError(f"{self.ranks} ranks do not divide into expert parallelism {self.expert_parallel}")
        return self.expert_parallel, self.ranks // self.expert_parallel

    @property
    def receive_factor(self) -> float:
        """f: the most (token, slot) pairs one rank's experts can receive in a MoE layer, ÷ the balanced share (the
        pairs its own tokens send). The dispatch drops no token (no capacity factor), so nothing bounds a rank below
        every token of its EP group sending it min(K, E/EP) pairs: f = EP·min(K, E/EP)/K. 1 without expert
        parallelism or with force-balanced routing. Not a rare case early in training: in the tiny-moe demo at EP 2
        the busiest rank of some layer received every pair of a step (docs/benchmarks/2026-12-08-moe-memory.md)."""
        if not self.moe or self.expert_parallel == 1 or self.moe.force_balanced:
            return 1.0
        k = self.moe.experts_per_token
        return self.expert_parallel * min(k, self.moe.routed_experts // self.expert_parallel) / k

    @property
    def dispatched_pairs(self) -> int:
        """The (token, slot) pairs one rank's micro-batch sends through a MoE layer's dispatch: tokens × K."""
        return self.micro_batch_size * self.seq_len * self.moe.experts_per_token

    def all_to_all_bytes(self) -> int:
        """Bytes one rank sends by all-to-all in one micro-batch with expert parallelism (0 without): every MoE
        layer's dispatch and combine, forward and backward, each moving the rank's tokens × K rows of H elements, of
        which the 1/EP bound for its own experts stay; a balanced load (the count exchange's few bytes left out)."""
        if not self.moe or self.expert_parallel == 1:
            return 0
        b = 4 if self.precision == "fp32" else 2
        moe_layers = self.layers - self.moe.dense_layers
        away = (self.expert_parallel - 1) / self.expert_parallel  # the pairs bound for other ranks' experts
        return int(4 * moe_layers * self.dispatched_pairs * self.hidden_size * b * away)

    @property
    def held_parameters(self) -> int:
        """The parameters one rank's model holds: every non-expert one and its expert-parallel slice of the experts
        (Ψ at EP 1)."""
        return self.non_expert_parameters + self.held_experts(self.expert_parameters)

    def held_experts(self, elements: int) -> int:
        """Of `elements` routed-expert parameters, those one rank's expert-parallel slice holds (÷ EP)."""
        return elements // self.expert_group()[0]

    @property
    def moe_layers(self) -> int:
        return self.layers - self.moe.dense_layers if self.moe else 0

    @property
    def expert_parameters(self) -> int:
        """Ψ_E, the routed experts' parameters of the whole model (0 for a dense model)."""
        return self.moe_layers * self.moe.expert_parameters_per_layer if self.moe else 0

    @property
    def non_expert_parameters(self) -> int:
        """Ψ − Ψ_E: embeddings, head, attention, dense FFNs, routers, shared experts, norms."""
        return self.parameters - self.expert_parameters

    @property
    def gather_unit(self) -> int:
        """Elements ZeRO-3 and FSDP gather at once for compute: the largest decoder layer, a MoE layer with all of its
        routed experts this rank's slice holds (each layer's experts are one fused parameter pair, gathered whole)."""
        moe = self.moe
        if moe is None:
            return _per_layer_params(self)
        units = [moe.dense_layer_parameters] if moe.dense_layers else []
        if self.moe_layers:
            units.append(moe.moe_layer_parameters - moe.expert_parameters_per_layer
                         + self.held_experts(moe.expert_parameters_per_layer))
        return max(units)


@dataclass(frozen=True)
class Estimate:
    """Predicted bytes per rank (device memory; host RAM for a CPU run) and per rank on the host."""

    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    runtime: int
    init: int  # the whole model on the device while it is built and before ZeRO partitions it
    host_states: int  # offloaded states and staging buffers per rank (host RAM)
    state_formula: str
    buffer_formula: str
    disk_states: int = 0  # states per rank offloaded to NVMe (train.nvme_path)
    # Of params + grads + optimizer (on the device) and host_states: the routed experts' share (0 for a dense model)
    expert_states: int = 0
    expert_host_states: int = 0
    all_to_all_bytes: int = 0  # sent by all-to-all per micro-batch with expert parallelism (RunShape.all_to_all_bytes)

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def non_expert_states(self) -> int:
        """The device's model states of everything but the routed experts (all of them for a dense model)."""
        return self.model_states - self.expert_states

    @property
    def per_rank(self) -> int:
        """Peak bytes one rank needs on its device."""
        return max(self.model_states + self.activations + self.buffers, self.init) + self.runtime

    def as_dict(self) -> dict:
        return {**asdict(self), "model_states": self.model_states, "non_expert_states": self.non_expert_states,
                "per_rank": self.per_rank}


@dataclass(frozen=True)
class Budget:
    """Memory this machine offers: per GPU (cuda) and host RAM; for a CPU run the host is the device."""

    device: str
    device_bytes: int  # per GPU; for cpu the host RAM shared by all ranks
    device_source: str
    host_bytes: int | None  # None: unknown (planning for GPUs this machine does not have)
    host_source: str
    gpu_count: int | None = None  # None: not detected
    disk_bytes: int | None = None  # free bytes at train.nvme_path (None: not known)
    disk_source: str = "not checked"

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Verdict:
    fits: bool
    need_bytes: int  # per GPU (cuda) or all ranks together (cpu)
    have_bytes: int
    host_need_bytes: int
    host_fits: bool
    text: str
    disk_need_bytes: int = 0
    disk_fits: bool = True


# torch's caching host allocator rounds every pinned block up to a power of two (CachingHostAllocator.h,
# PowerOf2Ceil) unless the allocator option pinned_max_round_threshold_mb says otherwise; the launcher sets that
# option where torch has it and otherwise turns DeepSpeed's pin_memory off, so a run's pinned buffers are exact.
PINNED_ROUNDING_NOTE = "pinned host buffers rounded up to powers of two (torch CachingHostAllocator)"


def pow2ceil(value: int) -> int:
    return 1 << (int(value) - 1).bit_length() if value > 1 else int(value)


def offload_host_terms(psi: int, ranks: int, precision: str, largest: int, pinned_rounding: bool = False) -> dict:
    """Host bytes per rank of ZeRO-1/2 with the optimizer offloaded to CPU, term by term (DeepSpeed 0.19.8
    runtime/zero/stage_1_and_2.py), as {term: (bytes, source)}."""
    n = ranks
    param_b = 4 if precision == "fp32" else 2
    terms = {
        # :560 the fp32 master partition, cloned from the 16-bit partition onto the host (pinned :565)
        "master": (4 * psi / n, "fp32 master partition 4Ψ/N (stage_1_and_2.py:560, pinned :565)"),
        # DeepSpeedCPUAdam's exp_avg and exp_avg_sq, fp32, on the host (not pinned)
        "adam": (8 * psi / n, "Adam moments 8Ψ/N (DeepSpeedCPUAdam state)"),
        # :940 the fp32 gradient partition the CPU optimizer reads (pinned)
        "grads": (4 * psi / n, "fp32 gradient partition 4Ψ/N (stage_1_and_2.py:940, pinned)"),
        # :566-573 a 16-bit copy of the partition, staging updated weights back to the device (pinned)
        "param_buffer": (param_b * psi / n, f"{param_b}-byte parameter buffer {param_b}Ψ/N (stage_1_and_2.py:566, "
                                            "pinned :572)"),
        # :653-658 the largest parameter's gradient, 16-bit, staged on the host (pinned)
        "grad_staging": (param_b * largest, "largest gradient staged on the host (stage_1_and_2.py:653, pinned :657)"),
    }
    if pinned_rounding:
        pinned = ("master", "grads", "param_buffer", "grad_staging")
        excess = sum(pow2ceil(terms[t][0]) - terms[t][0] for t in pinned)
        terms["pinned_rounding"] = (excess, PINNED_ROUNDING_NOTE)
    return {name: (int(value), source) for name, (value, source) in terms.items()}


# torch.isinf(x) is `x.abs() == inf` (ATen TensorCompare.cpp): a 16-bit abs() copy and a bool result, 3 bytes per
# element of a half tensor at once (measured: peak RSS rises 3.06 bytes per element on CPU, torch 2.13).
ISINF_BYTES_PER_ELEMENT = {"fp16": 3}


def stage3_offload_host_terms(psi: int, ranks: int, precision: str, largest: int, pinned_rounding: bool = False,
                              offload_param: str = "none", offload_optimizer: str = "cpu") -> dict:
    """Host bytes per rank of ZeRO-3 with the optimizer offloaded to CPU or NVMe, term by term (DeepSpeed 0.19.8
    runtime/zero/stage3.py; with either offload the optimizer's device `self.device` is the CPU, :333), as
    {term: (bytes, source)}. The last term is the largest transient, held only while it runs. pinned_rounding
    covers the CPU offload's own pinned buffers (ZeRO-Infinity's swap buffers are counted exact)."""
    n = ranks
    b = 4 if precision == "fp32" else 2  # gradient_accumulation_dtype is the training dtype
    part = psi / n
    if offload_optimizer == "nvme":
        # :1210-1230 a sub-group closes once its partitions reach sub_group_size, so the largest holds at most
        # sub_group_size + one parameter's partition
        group = min(SUB_GROUP_ELEMENTS + largest / n, part)
        terms = {
            # :1306 one fp32 buffer sized by the largest sub-group's whole parameters (ds_numel, N × its
            # partition), narrowed as every swapped sub-group's .grad (:1344) and kept for the run
            "grads": (4 * n * group, "fp32 gradient buffer of the largest sub-group's whole parameters, every "
                                     "sub-group's .grad (stage3.py:1306, :1344)"),
            # swap_tensor/optimizer_utils.py:187 buffer_count (4) pinned buffers of the largest sub-group, fp32,
            # that the master and Adam moments are swapped through
            "swap_buffers": (NVME_OPTIMIZER_BUFFERS * group * 4, "optimizer swap buffers 4 × largest sub-group, "
                                                                 "fp32 (optimizer_utils.py:187, pinned)"),
        }
    else:
        terms = {
            # :1158 the fp32 master partition of each sub-group, `.to(cpu, fp32).clone()` (not pinned)
            "master": (4 * part, "fp32 master partition 4Ψ/N (stage3.py:1158, not pinned)"),
            # DeepSpeedCPUAdam's exp_avg and exp_avg_sq on the master partition, created at the first step
            "adam": (8 * part, "Adam moments 8Ψ/N (DeepSpeedCPUAdam state)"),
            # :1338 one fp32 gradient buffer per sub-group, pinned (:1340), kept as the master's `.grad` (:1342)
            "grads": (4 * part, "fp32 gradient partition per sub-group 4Ψ/N, the master's .grad (stage3.py:1338, "
                                "pinned :1340)"),
        }
    # :791 the flat gradient-partition buffer every reduce-scatter lands in, on self.device (pinned :795)
    terms["grad_partition_buffer"] = (b * part, f"{b}-byte flat gradient-partition buffer {b}Ψ/N (stage3.py:791, "
                                                "pinned :795)")
    if offload_param == "cpu":
        # :906 the 16-bit parameter partition, flat and pinned on the host
        terms["param_buffer"] = (b * part, f"{b}-byte parameter partition {b}Ψ/N (stage3.py:906, pinned)")
    elif offload_param == "nvme":
        # :900-907 up to offload_param.max_in_cpu (1e9) elements of the partition stay on the host, pinned, beside
        # the parameter swapper's buffers (offload_config.py: buffer_count 5 × buffer_size 1e8)
        terms["param_buffer"] = (b * min(PARAMS_IN_CPU_ELEMENTS, part) + NVME_PARAM_BUFFER_ELEMENTS * b,
                                 f"{b}-byte parameters kept on the host, at most max_in_cpu 1e9 (stage3.py:906), "
                                 "+ parameter swap buffers 5 × 1e8")
    if pinned_rounding and offload_optimizer == "cpu":
        excess = (_subgroup_rounding(part) * 4 + pow2ceil(int(b * part)) - b * part
                  + (pow2ceil(int(b * part)) - b * part if offload_param == "cpu" else 0))
        terms["pinned_rounding"] = (excess, PINNED_ROUNDING_NOTE)
    # Transients, one at a time: at the accumulation boundary each parameter's gradient is cast to fp32 before the
    # copy into the master's .grad (:1456); in fp16 the overflow check runs isinf and isnan over the flat
    # gradient-partition buffer (:3013-3014) while every state above is held.
    transients = [(4 * largest / n, "fp32 cast of the largest gradient partition (stage3.py:1456)")]
    if precision in ISINF_BYTES_PER_ELEMENT:
        k = ISINF_BYTES_PER_ELEMENT[precision]
        transients.append((k * part, f"overflow check's isinf over the flat gradient buffer, {k}Ψ/N "
                                     "(stage3.py:3013: abs() copy + bool result)"))
    terms["transient"] = max(transients)
    return {name: (int(value), source) for name, (value, source) in terms.items()}


def _subgroup_rounding(elements: float) -> float:
    """Elements added by rounding each sub-group's pinned buffer (sub_group_size elements each, the rest last) up to
    a power of two."""
    full, rest = divmod(int(elements), SUB_GROUP_ELEMENTS)
    return full * (pow2ceil(SUB_GROUP_ELEMENTS) - SUB_GROUP_ELEMENTS) + (pow2ceil(rest) - rest if rest else 0)


def model_state_bytes(psi: int, ranks: int, stage: int, precision: str, offload_optimizer: str = "none",
                      offload_param: str = "none", largest: int = 0, pinned_rounding: bool = False) -> dict:
    """Bytes per rank of parameters, gradients and optimizer states, and the parts offloaded to host or NVMe.

    `largest` (elements of the largest parameter) adds the host staging buffer of ZeRO-1/2 CPU offload; the
    host figure then follows offload_host_terms term by term."""
    n = ranks
    if precision == "fp32":
        param_b, grad_b, opt_b = 4, 4, (8 if stage in (0, 3) else 12)
    else:
        param_b, grad_b, opt_b = 2, 2, 12
    params = param_b * psi / n if stage == 3 else param_b * psi
    grads = grad_b * psi / n if stage >= 2 else grad_b * psi
    optimizer = opt_b * psi / n if stage >= 1 else opt_b * psi
    offloaded = {"cpu": 0.0, "nvme": 0.0}
    if offload_optimizer != "none" and stage >= 1:
        # ZeRO-Offload / ZeRO-Infinity: optimizer states (and, from stage 2, the fp32 gradient partition, which
        # stays in host RAM even when the optimizer states are swapped to NVMe) leave the device.
        offloaded[offload_optimizer] += optimizer
        optimizer = 0.0
        if stage >= 2:
            offloaded["cpu"] += 4 * psi / n
            grads = 0.0
        if offload_optimizer == "nvme":  # pinned swap buffers, one fp32 sub-group each
            offloaded["cpu"] += NVME_OPTIMIZER_BUFFERS * min(SUB_GROUP_ELEMENTS, psi / n) * 4
    if offload_param != "none" and stage == 3:
        offloaded[offload_param] += params
        params = 0.0
        if offload_param == "nvme":
            offloaded["cpu"] += NVME_PARAM_BUFFER_ELEMENTS * param_b
    host_terms = None
    if offload_optimizer == "cpu" and stage in (1, 2):
        host_terms = offload_host_terms(psi, n, precision, largest, pinned_rounding)
    elif offload_optimizer in ("cpu", "nvme") and stage == 3:
        host_terms = stage3_offload_host_terms(psi, n, precision, largest, pinned_rounding, offload_param,
                                               offload_optimizer)
    if host_terms is not None:
        offloaded["cpu"] = sum(value for value, _ in host_terms.values())
    formula = STATE_FORMULAS["fp32" if precision == "fp32" else "mixed"][stage]
    where = {"cpu": "host RAM", "nvme": "NVMe (train.nvme_path)"}
    if stage == 3 and offload_optimizer == "cpu" and host_terms is not None:
        persistent = sum(v for name, (v, _) in host_terms.items() if name not in ("transient", "pinned_rounding"))
        formula = (f"{'0' if offload_param == 'cpu' else f'{param_b}Ψ/N'} on the device, "
                   f"{persistent * n / psi:.0f}Ψ/N in host RAM (stage3.py: fp32 master, fp32 .grad, "
                   f"gradient-partition buffer, Adam moments) + the largest transient")
    elif offload_optimizer != "none" and stage >= 1:
        formula += f" with the optimizer part in {where[offload_optimizer]}"
    if offload_param != "none" and stage == 3:
        formula += f" and the parameters in {where[offload_param]}"
    return {"params": int(params), "grads": int(grads), "optimizer": int(optimizer), "host": int(offloaded["cpu"]),
            "disk": int(offloaded["nvme"]), "formula": formula, "host_terms": host_terms}


# Host terms sized by one largest tensor or sub-group, allocated once and reused by every parameter group: when the
# expert and the non-expert states are added up, the larger of each counts, not both.
SHARED_HOST_TERMS = ("grad_staging", "transient", "swap_buffers")


def run_state_bytes(run: RunShape) -> dict:
    """model_state_bytes of a run, ZeRO's formula over the non-expert parameters (N ranks) plus the same formula
    over the routed experts a rank's expert-parallel slice holds (Ψ_E/EP, partitioned over its N/EP-rank
    expert-data-parallel group; DeepSpeed's MoE param groups): states_ne(Ψ − Ψ_E, N) + states_e(Ψ_E/EP, N/EP). A
    dense model is the first term alone. Adds `expert` and `expert_host`: the second term's device and host bytes."""
    kwargs = dict(stage=run.zero_stage, precision=run.precision, offload_optimizer=run.offload_optimizer,
                  offload_param=run.offload_param, pinned_rounding=run.pinned_rounding)
    if run.moe is None:
        return {**model_state_bytes(run.parameters, run.ranks, largest=run.largest_parameter, **kwargs),
                "expert": 0, "expert_host": 0}
    ep, expert_ranks = run.expert_group()
    largest_expert = run.held_experts(run.moe.largest_expert_tensor)
    dense = replace(run, moe=None)  # the non-expert parameters' largest tensor (V × H, a dense FFN matrix)
    non_expert = model_state_bytes(run.non_expert_parameters, run.ranks, largest=dense.largest_parameter, **kwargs)
    expert = model_state_bytes(run.held_experts(run.expert_parameters), expert_ranks, largest=largest_expert,
                               **kwargs)
    host_terms = None
    if non_expert["host_terms"] is not None:
        host_terms = {}
        for name in dict.fromkeys([*non_expert["host_terms"], *expert["host_terms"]]):
            a, source = non_expert["host_terms"].get(name, (0, None))
            b, other = expert["host_terms"].get(name, (0, None))
            host_terms[name] = (max(a, b) if name in SHARED_HOST_TERMS else a + b, source or other)
    host = sum(v for v, _ in host_terms.values()) if host_terms else non_expert["host"] + expert["host"]
    formula = (f"non-expert Ψ_ne = Ψ − Ψ_E: {non_expert['formula']}; routed experts Ψ_E ÷ EP {ep} over "
               f"N/EP = {expert_ranks} rank{'s' * (expert_ranks > 1)}: {expert['formula']}")
    merged = {key: non_expert[key] + expert[key] for key in ("params", "grads", "optimizer", "disk")}
    return {**merged, "host": host, "formula": formula, "host_terms": host_terms,
            "expert": expert["params"] + expert["grads"] + expert["optimizer"],
            "expert_host": host - non_expert["host"]}  # what the experts add to the host


def checkpoint_bytes(psi: int, precision: str, zero_stage: int, engine: str = "deepspeed") -> int:
    """Bytes of one checkpoint on disk, all ranks together (the engine's: EngineSpec.checkpoint_bytes)."""
    return engine_spec(engine).checkpoint_bytes(psi, precision, zero_stage)


def activation_bytes(run: RunShape) -> int:
    """Activation memory of one micro-batch on one rank (see ACTIVATION_FORMULA)."""
    b = 4 if run.precision == "fp32" else 2
    tokens = run.micro_batch_size * run.seq_len
    h, kv, f = run.hidden_size, run.kv_size, run.ffn_size
    logits = run.vocab_size * (b + 8) if b == 2 else run.vocab_size * 8  # fp32 logits need no .float() copy
    if run.moe is not None or run.attention is not None:  # DeepSeek: attention + FFN, layer by layer
        dense = attention_activations(run, b) + b * (2 * h + 4 * f) + 4 * h
        moe = attention_activations(run, b) + moe_ffn_activations(run, b) if run.moe else 0
        dense_layers = run.moe.dense_layers if run.moe else run.layers
        largest = max([dense] * (dense_layers > 0) + [moe] * (run.layers > dense_layers))
        all_layers = dense_layers * dense + (run.layers - dense_layers) * moe
    else:
        largest = b * (6 * h + 2 * kv + 4 * f) + 4 * 2 * h
        all_layers = run.layers * largest
    if run.activation_checkpointing:
        layers = run.layers * b * h + largest  # every layer's input + the largest layer recomputed
    else:
        layers = all_layers
    return int(tokens * (layers + logits + 3 * b * h))  # + embedding output and final norm


def attention_activations(run: RunShape, b: int) -> int:
    """Bytes per token one DeepSeek attention block (with its pre-norm) keeps for the backward (MOE_ACTIVATION_FORMULA,
    native_deepseek.LatentAttention / MultiHeadAttention; SDPA keeps no s² scores): b bytes per activation."""
    h, a = run.hidden_size, run.attention
    n, qk, rope, v = a.heads, a.qk_nope_head_dim + a.qk_rope_head_dim, a.qk_rope_head_dim, a.v_head_dim
    if a.kv_lora_rank is None:
        # norm input and output; q and k projected, then rotated copies; v; the attention output
        return b * (2 * h + 4 * n * qk + 2 * n * v) + 4 * h
    r_q, r_kv = a.q_lora_rank or 0, a.kv_lora_rank
    per_token = (2 * h  # norm input, normed x (q_a/q_proj and kv_a's input)
                 + 2 * r_q  # q_a's output (the q_a_layernorm's input) and the normed query latent (q_b's input)
                 + n * qk  # q_b's output, kept whole by the rotary's view of q_rot
                 + (r_kv + rope)  # kv_a_proj_with_mqa's output: the latent and the shared rotary key
                 + r_kv  # the normed latent (kv_b's input)
                 + n * (a.qk_nope_head_dim + v)  # kv_b's output, k_nope and v (v a view SDPA keeps)
                 + 2 * n * qk  # q and k concatenated with their rotated parts (SDPA's inputs)
                 + n * v)  # the attention output (o_proj's input)
    return b * per_token + 4 * (h + r_q + r_kv)  # fp32 copies in the three RMSNorms


def moe_ffn_activations(run: RunShape, b: int) -> int:
    """Bytes per token one MoE FFN block (with its pre-norm) keeps for the backward (MOE_ACTIVATION_FORMULA,
    native_deepseek.MoE / Experts): each token dispatched K times, every copy through one expert's SwiGLU (its input
    row, gate and up, silu, product, down's output, weighted in fp32 for the sum), the shared experts' SwiGLU over
    every token, and the router's fp32 input and E scores per token."""
    h, moe = run.hidden_size, run.moe
    k, i, shared, experts = moe.experts_per_token, moe.expert_ffn_size, moe.shared_ffn_size, moe.routed_experts
    # per dispatched copy: input row + down's output (H each), gate/up/silu/product; with expert parallelism the
    # busiest rank computes up to receive_factor times its own tokens' pairs
    routed = k * (2 * h + 4 * i) * run.receive_factor
    router = (4 * h if b != 4 else 0) + 4 * experts * (1 + moe.balance_loss)  # x.float(); scores (+ normalised)
    return int(b * (2 * h + routed + 4 * shared) + 4 * h + router)


def buffer_terms(run: RunShape) -> dict:
    """DeepSpeed's working buffers on the device, term by term, as {term: (bytes, source)}."""
    grad_b = 4 if run.precision == "fp32" else 2
    # the parameters whose gradients this rank reduces: with expert parallelism its own slice of the experts
    psi, largest = run.held_parameters, run.largest_parameter
    # A parameter's gradient is reduced whole, so the reduce bucket holds at least the largest one: with fused
    # experts that is a MoE layer's gate_up_proj (E, 2I, H), far above 5e8 elements for DeepSeek-V3 (7.5e9).
    reduce_elements = max(REDUCE_BUCKET_ELEMENTS, largest) if run.moe else REDUCE_BUCKET_ELEMENTS
    if run.zero_stage == 3:
        # ZeRO-3 gathers a module's parameters whole before its forward, and prefetches up to 5e7 elements ahead; a
        # MoE layer's experts are one fused parameter pair, so the gathered unit is that layer (gather_unit).
        gathered = max(PREFETCH_BUCKET_ELEMENTS, run.gather_unit) if run.moe else PREFETCH_BUCKET_ELEMENTS
        elements = reduce_elements + gathered
        if run.device == "cpu":
            elements = min(elements, psi)
        # coalesced_collectives.py:122 reduce_scatter_coalesced torch.cat's the bucket's gradients into one flat
        # copy for the reduce-scatter (stage3.py:1931), held while it runs
        flat = min(reduce_elements, psi)
        label = ("ZeRO-3 reduce bucket (5e8 elements, at least the largest gradient) + the gathered unit (a MoE "
                 "layer with its fused experts, at least the 5e7-element prefetch bucket)" if run.moe
                 else "ZeRO-3 reduce + prefetch buckets (5e8 + 5e7 elements)")
        return {"buckets": (elements * grad_b, label),
                "reduce_scatter_copy": (flat * grad_b, "flat copy of the reduce bucket for the reduce-scatter "
                                                       "(coalesced_collectives.py:122)")}
    copies = 2 if (run.device == "cuda" and run.zero_stage >= 1) else 1
    elements = reduce_elements if run.device == "cuda" else min(reduce_elements, psi)
    if run.zero_stage == 0:
        elements = min(reduce_elements, psi)
    label = "gradient bucket" + (" × 2 (overlap_comm)" if copies == 2 else "")
    label += ", reduce_bucket_size 5e8 elements" + (" (at least the largest gradient)" if run.moe else "")
    terms = {"buckets": (copies * elements * grad_b, label)}
    if run.zero_stage in (1, 2):
        if run.offload_optimizer == "cpu":
            # :659 a device buffer of the largest gradient for the copy to the host; :1886 its norm in fp64
            # (get_norm_dtype) and an fp32 copy for the host transfer, both transient, at the same moment
            terms["offload_staging"] = (largest * grad_b, "offload gradient buffer, largest parameter "
                                                          "(stage_1_and_2.py:659)")
            terms["norm_copies"] = (largest * (8 + 4), "fp64 norm + fp32 copy of the largest gradient "
                                                       "(stage_1_and_2.py:1886, get_norm_dtype)")
        else:
            # :2684 the gradient norm casts each partition piece to fp64 (get_norm_dtype), at the optimizer step
            piece = min(largest, -(-psi // run.ranks))
            if run.device == "cpu":
                # The bucket is freed at the end of the backward (:924 _release_ipg_buffers, from backward_epilogue),
                # before the step makes this copy, and on CPU the freed pages leave the RSS: the two never add, so
                # the copy counts only by what it exceeds the bucket by (a ZeRO-2 fp32 rank's RSS rose by the bucket
                # in the backward and not again in the step: docs/benchmarks/2026-12-08-moe-memory.md).
                # CUDA's caching allocator keeps the bucket's block reserved, and a larger copy cannot reuse it.
                terms["norm_copies"] = (max(0, piece * 8 - terms["buckets"][0]),
                                        "fp64 copy of the largest gradient piece for the norm at the step, beyond "
                                        "the bucket the backward freed (stage_1_and_2.py:2684, get_norm_dtype)")
            else:
                terms["norm_copies"] = (piece * 8, "fp64 copy of the largest gradient piece for the norm "
                                                   "(stage_1_and_2.py:2684, get_norm_dtype)")
    if run.moe and run.expert_parallel > 1:
        terms["ep_exchange"] = ep_exchange(run, grad_b)
    return {name: (int(value), source) for name, (value, source) in terms.items()}


def ep_exchange(run: RunShape, b: int) -> tuple[int, str]:
    """The expert-parallel dispatch's rows to send and the rows received, held together while it runs (one layer
    at a time): the rank's tokens × K rows, and up to receive_factor times as many received, H wide."""
    return (int(run.dispatched_pairs * run.hidden_size * b * (1 + run.receive_factor)),
            f"expert-parallel dispatch: the rank's token × K rows sent and up to {run.receive_factor:g}× as many "
            "received (receive_factor), H wide")


def buffer_bytes(run: RunShape) -> tuple[int, str]:
    """The sum of buffer_terms and their sources, for the report's formula column."""
    terms = buffer_terms(run)
    return sum(value for value, _ in terms.values()), "; ".join(source for _, source in terms.values())


def root_parameters(run: RunShape) -> int:
    """Parameters outside the decoder layers: embeddings, LM head (unless tied) and the final norm."""
    if run.moe:
        return (run.parameters - run.moe.dense_layers * run.moe.dense_layer_parameters
                - run.moe_layers * run.moe.moe_layer_parameters)
    return run.parameters - run.layers * _per_layer_params(run)


def torch_state_bytes(psi: int, ranks: int, engine: str) -> dict:
    """Bytes per rank of parameters, gradients and AdamW states under DDP (replicated) or FSDP (sharded)."""
    return engine_spec(engine).state_bytes(psi, ranks)


def torch_engine_terms(run: RunShape) -> tuple[dict, dict]:
    """(states, buffers) per rank of a DDP or FSDP run: states {term: bytes} (with `expert`, the routed experts'
    share, for a MoE model), buffers {term: (bytes, source)}."""
    b = 4 if run.precision == "fp32" else 2
    states = torch_state_bytes(run.non_expert_parameters, run.ranks, run.engine)
    if run.moe:  # the routed experts a rank's slice holds: FSDP shards them over the N ranks at EP 1; split over EP
        # ranks, both engines keep the slice whole, replicated over its expert-data-parallel group (ExpertShards)
        ep, expert_ranks = run.expert_group()
        expert = engine_spec(run.engine).state_bytes(run.held_experts(run.expert_parameters),
                                                     expert_ranks if ep == 1 else 1)
        states = {key: states[key] + expert[key] for key in states} | {"expert": sum(expert.values())}
    psi = run.held_parameters
    buffers = {}
    if run.moe and run.expert_parallel > 1:
        buffers["ep_exchange"] = ep_exchange(run, b)
    if not engine_spec(run.engine).shards_states:
        if run.precision != "fp32":
            # autocast casts each fp32 weight once per forward; the 16-bit copies are saved for the backward
            buffers["autocast_copies"] = (2 * psi, "autocast's 16-bit weight copies, 2Ψ, kept for the backward")
        return states, buffers
    # FSDP2 wraps each decoder block: the unit it gathers is a layer, for a MoE layer with its fused experts (split
    # over expert-parallel ranks, the experts stay outside FSDP and are not gathered)
    layer, root = run.gather_unit, root_parameters(run)
    if run.moe and run.expert_parallel > 1:
        layer = max(run.gather_unit - run.held_experts(run.moe.expert_parameters_per_layer),
                    run.moe.dense_layer_parameters if run.moe.dense_layers else 0)
    buffers |= {
        # the root module (embeddings, head, final norm) stays gathered from its forward to its backward
        "root_gathered": (root * b, f"root module gathered in {run.precision} (embeddings, head, norm)"),
        # one decoder layer gathered for compute and the next prefetched
        "layers_gathered": (2 * layer * b, "two decoder layers gathered (current + prefetched)"),
        # the gathered layer's gradient, and its fp32 copy for the reduce-scatter
        "layer_gradient": (layer * b + (layer * 4 if b != 4 else 0),
                           "one layer's unsharded gradient (+ fp32 for the reduce-scatter)"),
    }
    return states, buffers


def estimate(run: RunShape) -> Estimate:
    spec = engine_spec(run.engine)
    local = run.held_parameters  # the model one rank builds
    if not spec.zero_partitioned:
        states, buffers = torch_engine_terms(run)
        state_formula = spec.state_formula
        if run.moe:
            ep, expert_ranks = run.expert_group()
            state_formula = (f"{spec.state_formula}; Ψ = Ψ_ne + Ψ_E, the routed experts Ψ_E ÷ EP {ep} over "
                             f"N/EP = {expert_ranks} rank{'s' * (expert_ranks > 1)}")
            if ep > 1 and spec.shards_states:
                state_formula = (f"{spec.state_formula} over the non-expert Ψ_ne; the routed experts Ψ_E ÷ EP {ep} "
                                 f"kept whole outside FSDP, 16 bytes each, on each of the N/EP = {expert_ranks} "
                                 f"rank{'s' * (expert_ranks > 1)} holding them")
        return Estimate(params=int(states["params"]), grads=int(states["grads"]),
                        optimizer=int(states["optimizer"]), activations=activation_bytes(run),
                        buffers=int(sum(v for v, _ in buffers.values())), runtime=RUNTIME_BYTES[run.device],
                        # the whole model is built in fp32 on the rank's device before DDP/FSDP take it
                        init=4 * local, host_states=0, state_formula=state_formula,
                        buffer_formula="; ".join(src for _, src in buffers.values()) or "none beyond the states",
                        expert_states=int(states.get("expert", 0)), all_to_all_bytes=run.all_to_all_bytes())
    states = run_state_bytes(run)
    buffers, buffer_formula = buffer_bytes(run)
    # model.build_model builds the whole model on the rank's device in the training dtype (one copy, b·Ψ) before
    # DeepSpeed partitions it; nothing is built in fp32 first, on the host or elsewhere.
    init = (4 if run.precision == "fp32" else 2) * local
    return Estimate(params=states["params"], grads=states["grads"], optimizer=states["optimizer"],
                    activations=activation_bytes(run), buffers=buffers, runtime=RUNTIME_BYTES[run.device],
                    init=init, host_states=states["host"], state_formula=states["formula"],
                    buffer_formula=buffer_formula, disk_states=states["disk"], expert_states=states["expert"],
                    expert_host_states=states["expert_host"], all_to_all_bytes=run.all_to_all_bytes())


# ---- figures the pre-flight assumed ------------------------------------------------------------------------------

def is_assumed(source: str) -> bool:
    """Whether a hardware figure comes from the config (benchmark.*, report.*) standing in for a machine that is
    not measured here, rather than from this machine."""
    return source.startswith(("benchmark.", "report.")) or "no GPU detected here" in source


def labelled(source: str) -> str:
    """A figure's source, prefixed 'assumed: ' where the pre-flight assumed it (`is_assumed`)."""
    return f"assumed: {source}" if is_assumed(source) else source


def assumed_mark(source: str) -> str:
    """' (assumed)' after a figure the pre-flight assumed (`is_assumed`), else nothing."""
    return " (assumed)" if is_assumed(source) else ""


def judge(est: Estimate, run: RunShape, budget: Budget) -> Verdict:
    """Does the estimate fit the budget? On CUDA per GPU, host RAM and NVMe disk for all ranks; on CPU all ranks
    share RAM."""
    n = run.ranks
    disk_need = n * est.disk_states
    disk_fits = not disk_need or budget.disk_bytes is None or disk_need <= budget.disk_bytes
    disk_text = ""
    if disk_need:
        have = budget.disk_source
        if budget.disk_bytes is not None:
            have = f"has {gib(budget.disk_bytes)} GiB free{assumed_mark(budget.disk_source)}"
        disk_text = f"; NVMe {gib(disk_need)} GiB for {n} rank{'s' * (n > 1)}, {have}"
    if run.device == "cpu":
        need = n * (est.per_rank + est.host_states)
        fits = need <= budget.host_bytes and disk_fits
        text = (f"needs {gib(need)} GiB ({n} rank{'s' * (n > 1)} × {gib(est.per_rank + est.host_states)} GiB), "
                f"has {gib(budget.host_bytes)} GiB host RAM{assumed_mark(budget.host_source)}{disk_text}")
        return Verdict(fits, need, budget.host_bytes, need, need <= budget.host_bytes, text, disk_need, disk_fits)
    # Host RAM: each rank process (CUDA libraries, staging) plus what it offloaded; the model is built on the GPU.
    host_need = n * (est.host_states + CUDA_RANK_HOST_BYTES)
    host_fits = budget.host_bytes is None or host_need <= budget.host_bytes
    fits = est.per_rank <= budget.device_bytes and host_fits and disk_fits
    text = (f"needs {gib(est.per_rank)} GiB per GPU, has {gib(budget.device_bytes)} GiB"
            f"{assumed_mark(budget.device_source)}")
    if budget.host_bytes is None:
        if est.host_states:
            text += f"; host RAM {gib(host_need)} GiB for {n} rank{'s' * (n > 1)} (not checked: {budget.host_source})"
    elif not host_fits or est.host_states:
        text += (f"; host RAM {gib(host_need)} GiB for {n} rank{'s' * (n > 1)}, has {gib(budget.host_bytes)} GiB"
                 f"{assumed_mark(budget.host_source)}")
    return Verdict(fits, est.per_rank, budget.device_bytes, host_need, host_fits, text + disk_text, disk_need,
                   disk_fits)


def gib(value: float) -> str:
    return f"{value / GIB:,.1f}"


# ---- from the config -------------------------------------------------------------------------------------------

def config_vocab_size(tokenizer: TokenizerSettings, model: ModelSettings) -> int:
    """The vocabulary the model will have, known before the shards exist: an adopted tokenizer's (tokenizer.path, or
    model.init_from's own tokenizer; the same rows the tokenizer stage will report: largest id + 1, a pad token added
    when it has none), else the BPE's tokenizer.vocab_size."""
    from pretrain_bench.data.tokenizer import adopted_tokenizer_path

    path = adopted_tokenizer_path(tokenizer.path, model.init_from)
    if path:
        from pretrain_bench.data.tokenizer import adopt_tokenizer, tokenizer_info

        key = "tokenizer.path" if tokenizer.path else "model.init_from's tokenizer"
        try:
            return tokenizer_info(*adopt_tokenizer(Path(path)))["vocab_size"]
        except Exception as error:  # tokenizers raises a bare Exception for a file it cannot parse
            raise ConfigError(f"{key} {path}: {error}") from error
    return tokenizer.vocab_size


def run_shape(config: PlanConfig, settings: TrainSettings, device: str, vocab_size: int | None = None) -> RunShape:
    """What the memory model needs of a run: the model of the plan config `config` (model.init_from: the shape of
    the model in its config.json, which the weights fix) with the layout of `settings`."""
    model = config.model
    shape = model_shape(model, vocab_size or config_vocab_size(config.tokenizer, model))
    family = model_family(shape)
    counts = family.count_parameters(shape)
    return RunShape(parameters=counts["total"], **family.memory_dims(shape), seq_len=model.seq_len,
                    micro_batch_size=settings.micro_batch_size, ranks=settings.world_size,
                    zero_stage=settings.zero_stage, precision=settings.precision,
                    offload_optimizer=settings.offload_optimizer, offload_param=settings.offload_param,
                    activation_checkpointing=settings.activation_checkpointing, device=device,
                    engine=settings.engine, expert_parallel=settings.expert_parallel)


def host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def free_disk_bytes(path: str | Path) -> int:
    """Free bytes on the file system that holds `path` (its nearest existing parent: it may not exist yet)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def detect_budget(device: str, bench: BenchSettings, nvme_path: str | Path | None = None) -> Budget:
    """Memory of this machine: nvidia-smi's free memory per GPU, physical RAM, free disk at `nvme_path`.

    When a CUDA run is planned on a machine without GPUs, the machine it is meant for is described by
    benchmark.device_memory_gib, benchmark.host_memory_gib and benchmark.disk_gib (the articles' 3 × 24 GiB box
    with 128 GB of RAM and a 2 TB disk in config.yaml); a machine with GPUs is measured.
    """
    host, host_source = host_memory_bytes(), "physical RAM of this machine"
    disk, disk_source = None, "not checked"
    if nvme_path is not None:
        disk, disk_source = free_disk_bytes(nvme_path), f"free space at {nvme_path}"
    if device == "cpu":
        return Budget("cpu", host, host_source, host, host_source, None, disk, disk_source)
    sizes = devices.nvidia_smi_memory()
    if sizes:
        # what is free, not the total: a desktop card driving a display, or one shared with another job, has less
        free = devices.nvidia_smi_free_memory()
        if len(free) == len(sizes):
            least = min(range(len(free)), key=free.__getitem__)
            return Budget("cuda", free[least], f"nvidia-smi memory.free: smallest of {len(sizes)} GPU(s) "
                          f"({free[least] / GIB:.1f} of {sizes[least] / GIB:.1f} GiB free)", host, host_source,
                          len(sizes), disk, disk_source)
        return Budget("cuda", min(sizes), f"nvidia-smi: smallest of {len(sizes)} GPU(s)", host, host_source,
                      len(sizes), disk, disk_source)
    # No GPU here: this machine's RAM and disk say nothing about the GPU machine's.
    return planned_budget(bench, nvme_path)


def planned_budget(bench: BenchSettings, nvme_path: str | Path | None = None,
                   why: str = "no GPU detected here") -> Budget:
    """The GPU machine a run is planned for, as the benchmark keys describe it (device_memory_gib, host_memory_gib,
    disk_gib: the articles' box in config.yaml): what detect_budget uses where no GPU is detected. `why` says, in
    each figure's source, why the keys stand for the machine."""
    host, host_source = None, "no GPU here, set benchmark.host_memory_gib to check the GPU machine's RAM"
    disk, disk_source = None, "not checked"
    if bench.host_memory_gib:
        host, host_source = int(bench.host_memory_gib * GIB), f"benchmark.host_memory_gib, {why}"
    if bench.disk_gib:
        disk, disk_source = int(bench.disk_gib * GIB), f"benchmark.disk_gib, {why}"
    elif nvme_path is not None:
        disk, disk_source = None, "not checked: no GPU here, set benchmark.disk_gib"
    return Budget("cuda", int(bench.device_memory_gib * GIB), f"benchmark.device_memory_gib, {why}", host,
                  host_source, None, disk, disk_source)


# ---- what would fit ----------------------------------------------------------------------------------------------

def alternatives(run: RunShape, budget: Budget, max_gpus: int = 1024) -> list[dict]:
    """Settings that change what a run needs, each with its prediction; those that fit first."""
    options = []

    def consider(label: str, changed: RunShape, settings_text: str):
        est = estimate(changed)
        verdict = judge(est, changed, budget)
        options.append({"label": label, "settings": settings_text, "fits": verdict.fits, "text": verdict.text,
                        "host_need_bytes": verdict.host_need_bytes, "per_rank_bytes": est.per_rank})

    spec = engine_spec(run.engine)
    for change in spec.fit_changes(run.zero_stage, run.offload_optimizer, run.offload_param):
        consider(change.label, replace(run, **change.changes), change.settings_text)
    if not run.activation_checkpointing:
        consider("activation checkpointing", replace(run, activation_checkpointing=True),
                 "train.activation_checkpointing: true")
    if not spec.zero_partitioned:
        return sorted(options, key=lambda o: not o["fits"])
    layers = _max_layers(run, budget)
    if layers and layers < run.layers:
        smaller = _fewer_layers(run, layers)
        consider(f"fewer layers ({layers} of {run.layers})", smaller,
                 f"model.overrides: {{num_hidden_layers: {layers}}} ({smaller.parameters / 1e9:,.2f}e9 parameters)")
    if run.device == "cuda":
        for gpus in range(run.ranks + 1, max_gpus + 1):
            more = replace(run, ranks=gpus, zero_stage=3)
            if judge(estimate(more), more, budget).fits:
                consider(f"ZeRO-3 on {gpus} GPUs", more, f"train.zero_stage: 3, train.gpus × nodes = {gpus}")
                break
    return sorted(options, key=lambda o: not o["fits"])


def _per_layer_params(run: RunShape) -> int:
    h, kv, f = run.hidden_size, run.kv_size, run.ffn_size
    return 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h


def _fewer_layers(run: RunShape, layers: int) -> RunShape:
    """The run with only its first `layers` decoder layers (model.overrides num_hidden_layers): a MoE model loses its
    MoE layers first, which come after the dense ones."""
    if run.moe is None:
        return replace(run, layers=layers, parameters=run.parameters - (run.layers - layers) * _per_layer_params(run))
    moe = run.moe
    dense = min(moe.dense_layers, layers)
    removed = ((moe.dense_layers - dense) * moe.dense_layer_parameters
               + (run.moe_layers - (layers - dense)) * moe.moe_layer_parameters)
    return replace(run, layers=layers, parameters=run.parameters - removed, moe=replace(moe, dense_layers=dense))


def _max_layers(run: RunShape, budget: Budget) -> int:
    best = 0
    for layers in range(1, run.layers + 1):
        smaller = _fewer_layers(run, layers)
        if judge(estimate(smaller), smaller, budget).fits:
            best = layers
        else:
            break
    return best


def explain(run: RunShape, est: Estimate, verdict: Verdict, budget: Budget, what: str) -> str:
    """The pre-flight message: the figures, then what would fit."""
    where = "per GPU" if run.device == "cuda" else "per rank"
    lines = [
        f"pre-flight: {what} is predicted not to fit: {verdict.text} ({labelled(budget.device_source)}).",
        f"  model states alone need {est.model_states / GB:,.1f} GB ({gib(est.model_states)} GiB) {where} "
        f"for Ψ = {run.parameters / 1e9:,.2f}e9 parameters, "
        f"{engine_spec(run.engine).short_label(run.zero_stage)}, {run.precision}, "
        f"N = {run.ranks} ({'ZeRO paper: ' if engine_spec(run.engine).zero_partitioned else ''}{est.state_formula});",
        f"  plus activations ~{gib(est.activations)} GiB (micro batch {run.micro_batch_size} × seq_len "
        f"{run.seq_len}), buffers {gib(est.buffers)} GiB ({est.buffer_formula}), runtime {gib(est.runtime)} GiB.",
        "What would fit:",
    ]
    options = alternatives(run, budget)
    for option in options:
        mark = "fits" if option["fits"] else "does not fit"
        lines.append(f"  - {option['label']}: {option['settings']} → {option['text']} [{mark}]")
    if not any(o["fits"] for o in options):
        lines.append("  (none of the single changes above is enough on this machine)")
    lines.append("Set benchmark.force: true to launch anyway.")
    return "\n".join(lines)


# ---- checkpoint export and evaluation ------------------------------------------------------------------------

def export_and_evaluation_host_bytes(run: RunShape, export_dtype: str, eval_precision: str | None = None) -> int:
    """Host bytes one export job (rule export_final) or evaluation job (rule evaluate: export, then the export
    loaded) holds at its peak, for Snakemake's mem_mb.

    Export (export.cast_state_dict): every weight cast to `export_dtype` + the largest parameter in fp32 while it is
    gathered and cast; the checkpoint's files are mapped, and their pages are page cache the kernel can reclaim.
    Evaluation afterwards: AutoModelForCausalLM.from_pretrained loads the export in `eval_precision` on the host
    before moving it to its device, after the export's tensors are freed, so the larger of the two counts. Plus the
    process itself (RUNTIME_BYTES["cpu"]). Evaluation activations on a CPU device are not counted.
    """
    bytes_of = {"fp32": 4, "bf16": 2, "fp16": 2}
    export = run.parameters * bytes_of[export_dtype] + 4 * run.largest_parameter
    loaded = run.parameters * bytes_of[eval_precision] if eval_precision else 0
    return max(export, loaded) + RUNTIME_BYTES["cpu"]
