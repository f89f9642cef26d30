"""What each training engine is, as data the planning reads without importing torch: `EngineSpec`, one per engine,
registered by name in ENGINE_SPECS. Everything engine-specific outside the engines' own training code lives here:
the layout of the model states (the ZeRO stage that names it, whether a stage can be chosen), the checks of the keys
that mean nothing under an engine, its config (DeepSpeed's ds_config), its memory terms and the changes the
pre-flight suggests when a run does not fit, its fit-ladder rungs, its labels in the report and the benchmark's cell
names. Nothing outside this package branches on an engine's name: it asks `engine_spec(name)`.

Adding an engine: a spec here (a subclass of EngineSpec, registered in ENGINE_SPECS), the engine class beside the
others (train/engines/<name>.py, registered in train/engines/registry.py), and its name in the schema's
train.engine enum (docs/contributing.md walks through it).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from pretrain_bench.config.schema import ConfigError, schema_enum

ENGINES = schema_enum("train", "engine")

# torch.optim.AdamW as every engine builds it (DeepSpeed's torch_adam path passes these through): torch's fused
# kernel, one pass over each parameter's state on CPU and CUDA alike. The default on CPU is the single-tensor loop,
# which makes five passes and allocates temporaries; on ZeRO-1/2's flat fp32 partition (tens of MB, out of cache)
# it cost about 10 % of a step of the bench model (bench/bench_trainer.py), fused about 1.5 %.
TORCH_ADAMW_KWARGS = {"fused": True}


@dataclass(frozen=True)
class FitChange:
    """A change of settings the pre-flight suggests when a run does not fit: its label, the fields it changes, and
    the config keys a user sets for it."""

    label: str
    changes: dict
    settings_text: str


class EngineSpec:
    """One engine as the planning sees it. Subclasses set the class attributes and override what differs."""

    name: str = ""
    title: str = ""  # the engine's name in the report: "DDP", "FSDP2", "DeepSpeed"
    # The ZeRO stage that names a fixed layout of parameters, gradients and optimizer states (DDP replicates all
    # three: ZeRO-0's layout; FSDP shards all three: ZeRO-3's), or None where train.zero_stage chooses it.
    fixed_stage: int | None = None
    default_stage: int = 0  # train.zero_stage when the config leaves it null
    layout: str = ""  # the fixed layout in words, for the error that refuses another stage
    offloads: bool = False  # takes train.offload_optimizer / offload_param and train.deepspeed
    zero_partitioned: bool = False  # the memory model's ZeRO formulas (ZeRO paper §5) apply, stage by stage
    shards_states: bool = False  # a torch engine's states are sharded over the ranks (else replicated)
    # torch.compile may compile the whole native model (FSDP2 wraps each decoder block, so it compiles blocks)
    compiles_whole_model: bool = True
    # splits the routed experts of a mixture-of-experts model over train.expert_parallel ranks
    expert_parallel: bool = False
    state_formula: str = ""  # the memory model's formula of the states, for a torch engine

    def resolve_stage(self, zero_stage: int | None) -> int:
        """train.zero_stage as a run uses it: the stage set, or the engine's where it is null."""
        return self.default_stage if zero_stage is None else zero_stage

    def label(self, zero_stage: int, offload_optimizer: str = "none") -> str:
        """The setup's name in the report's tables: 'DDP', 'FSDP2', 'DeepSpeed ZeRO-2 + optimizer offload'."""
        return self.title

    def layout_label(self, zero_stage: int) -> str:
        """The layout in a scaling series' label: 'ZeRO-2', 'DDP', 'FSDP2'."""
        return self.title

    def short_label(self, zero_stage: int) -> str:
        """The layout in a pre-flight line: 'ZeRO-2', 'DDP', 'FSDP'."""
        return self.name.upper()

    def cell_name(self, gpus: int, zero_stage: int, precision: str, comm_backend: str) -> str:
        """A benchmark cell's name before its suffixes: the engine fixes the layout, so no ZeRO stage in it."""
        return f"{self.name}-ranks{gpus}-{precision}-{comm_backend}"

    def check(self, s) -> None:
        """Keys that mean nothing under this engine are refused with the reason, never silently ignored."""
        if s.zero_stage != self.fixed_stage:
            raise ConfigError(f"train.zero_stage {s.zero_stage} means nothing under train.engine {self.name}: "
                              f"{self.layout}. Leave train.zero_stage out (or null: the engine's "
                              f"{self.fixed_stage}), or set train.engine: deepspeed for ZeRO-{s.zero_stage}")
        for key in ("offload_optimizer", "offload_param"):
            if getattr(s, key) != "none":
                raise ConfigError(f"train.{key} {getattr(s, key)} means nothing under train.engine {self.name}: "
                                  "offloading is DeepSpeed's (ZeRO-Offload/Infinity); set it to none or use "
                                  "train.engine: deepspeed")
        if s.deepspeed:
            raise ConfigError(f"train.deepspeed {sorted(s.deepspeed)} means nothing under train.engine {self.name}: "
                              "it is merged into DeepSpeed's config; remove it or use train.engine: deepspeed")

    def check_expert_parallel(self, s) -> None:
        """train.expert_parallel above 1 only under an engine that splits the experts over the ranks."""
        if s.expert_parallel == 1:
            return
        if not self.expert_parallel:
            able = [spec.name for spec in ENGINE_SPECS.values() if spec.expert_parallel]
            where = f"use train.engine {' or '.join(able)}" if able else "no engine builds it yet"
            raise ConfigError(f"train.expert_parallel {s.expert_parallel} is not supported with train.engine "
                              f"{self.name} yet ({where}): set train.expert_parallel: 1")
        if s.precision == "fp16":
            raise ConfigError(f"train.expert_parallel {s.expert_parallel} does not run with train.precision fp16: "
                              "its loss scaler would find an overflow in one rank's experts only and skip the step "
                              "there alone; use bf16 or fp32")

    def check_expert_model(self, expert_parallel: int, shape, what: str) -> None:
        """What splitting the experts under this engine asks of the model `shape` (named `what`) beyond routed
        experts (models.registry.check_expert_parallel): nothing here."""

    def layouts(self, device: str) -> list[tuple[int, str]]:
        """(ZeRO stage, optimizer offload) the benchmark's search tries under this engine."""
        return [(self.fixed_stage, "none")]

    def checkpoint_bytes(self, psi: int, precision: str, zero_stage: int) -> int:
        """Bytes of one checkpoint on disk, all ranks together: fp32 parameters and the two AdamW moments, 4Ψ + 8Ψ,
        in whatever precision the engine computes."""
        return 12 * psi

    def state_bytes(self, psi: int, ranks: int) -> dict:
        """Bytes per rank of parameters, gradients and AdamW states of a torch engine: fp32 parameters whatever the
        compute precision (4Ψ), fp32 gradients (4Ψ, the reduction's dtype) and AdamW's two moments (8Ψ); replicated,
        or sharded over the ranks."""
        n = ranks if self.shards_states else 1
        return {"params": 4 * psi // n, "grads": 4 * psi // n, "optimizer": 8 * psi // n}

    def fit_changes(self, zero_stage: int, offload_optimizer: str, offload_param: str) -> list[FitChange]:
        """What the pre-flight suggests, in order, when a run under this engine does not fit (activation
        checkpointing, which every engine has, is added by the memory model)."""
        return [FitChange("DeepSpeed ZeRO-3 with optimizer offload",
                          {"engine": "deepspeed", "zero_stage": 3, "offload_optimizer": "cpu"},
                          "train.engine: deepspeed, train.zero_stage: 3, train.offload_optimizer: cpu")]

    def offload_rungs(self, s) -> list[dict]:
        """train.memory_fit auto's offload rungs (changes of settings, in order) on CUDA; none where the engine does
        not offload."""
        return []


class DDPSpec(EngineSpec):
    name, title, fixed_stage, default_stage = "ddp", "DDP", 0, 0
    expert_parallel = True  # train/engines/expert_shards.py
    layout = "DDP replicates parameters, gradients and optimizer states on every rank (ZeRO-0's layout)"
    state_formula = (
        "16Ψ (4Ψ fp32 params + 4Ψ fp32 grads, DDP's buckets themselves + 8Ψ AdamW), replicated on every rank")

    def fit_changes(self, zero_stage, offload_optimizer, offload_param):
        return [FitChange("FSDP", {"engine": "fsdp", "zero_stage": 3}, "train.engine: fsdp, train.zero_stage: 3"),
                *super().fit_changes(zero_stage, offload_optimizer, offload_param)]


# The engine whose one-rank run is the plain training loop the source articles compare N cards against: DDP on one
# rank (its all-reduce over a single rank moves nothing), the benchmark's plain single-device baseline.
PLAIN_BASELINE = "ddp"


class FSDPSpec(EngineSpec):
    name, title, fixed_stage, default_stage = "fsdp", "FSDP2", 3, 3
    expert_parallel = True  # train/engines/expert_shards.py (the split experts outside fully_shard)
    layout = "FSDP shards parameters, gradients and optimizer states across the ranks (ZeRO-3's layout)"
    shards_states = True
    compiles_whole_model = False
    state_formula = "16Ψ/N (4Ψ/N fp32 params + 4Ψ/N fp32 grads + 8Ψ/N AdamW), sharded by FSDP"


class DeepSpeedSpec(EngineSpec):
    name, title, fixed_stage = "deepspeed", "DeepSpeed", None
    default_stage = 2  # train.zero_stage null under DeepSpeed: ZeRO-2, the source articles' setup
    offloads = True
    zero_partitioned = True

    def label(self, zero_stage, offload_optimizer="none"):
        return f"DeepSpeed ZeRO-{zero_stage}" + (" + optimizer offload" if offload_optimizer != "none" else "")

    def short_label(self, zero_stage):
        return f"ZeRO-{zero_stage}"

    layout_label = short_label

    def cell_name(self, gpus, zero_stage, precision, comm_backend):
        return f"ranks{gpus}-zero{zero_stage}-{precision}-{comm_backend}"

    expert_parallel = True  # DeepSpeed's AutoEP (engines/autoep.py)

    def check(self, s) -> None:
        owned = owned_deepspeed_keys(s.deepspeed)
        if owned:
            raise ConfigError("train.deepspeed sets what the pipeline owns: " + "; ".join(owned))

    def check_expert_parallel(self, s) -> None:
        super().check_expert_parallel(s)
        if s.expert_parallel == 1:
            return
        # AutoEP is tested here at ZeRO 1-3 without offload (tests/integration/test_expert_parallel_run.py)
        if s.zero_stage == 0:
            raise ConfigError(f"train.expert_parallel {s.expert_parallel} under train.engine deepspeed needs "
                              "train.zero_stage 1, 2 or 3 (DeepSpeed's AutoEP splits the experts through ZeRO's "
                              "expert param groups; at ZeRO-0 use train.engine ddp)")
        if s.offload_optimizer != "none" or s.offload_param != "none":
            raise ConfigError(f"train.expert_parallel {s.expert_parallel} under train.engine deepspeed does not run "
                              "with train.offload_optimizer or train.offload_param (not built with DeepSpeed's "
                              "AutoEP here): set them to none")

    def check_expert_model(self, expert_parallel: int, shape, what: str) -> None:
        """AutoEP's layer routes as the native one does (and takes its bias) with DeepSeek-V3's sigmoid router, but
        has no balance loss and no forced routing: they would be dropped without a word, so they are refused."""
        where = f"train.expert_parallel {expert_parallel} under train.engine deepspeed"
        if shape.scoring_func != "sigmoid":
            raise ConfigError(f"{where} takes DeepSeek-V3's sigmoid router (DeepSpeed's AutoEP preset deepseek_v3), "
                              f"and {what} scores with {shape.scoring_func}: use train.engine ddp or fsdp")
        if shape.aux_loss_alpha > 0:
            raise ConfigError(f"{where} trains without the sequence-wise balance loss (DeepSpeed's AutoEP layer has "
                              f"none), and {what} has model.overrides aux_loss_alpha {shape.aux_loss_alpha}: set it "
                              "to 0 (the bias update, bias_update_rate, still balances) or use train.engine ddp or "
                              "fsdp")
        if shape.force_balanced:
            raise ConfigError(f"{where} cannot force balanced routing (DeepSpeed's AutoEP layer routes by its "
                              "scores): set model.overrides force_balanced: false or use train.engine ddp or fsdp")

    def layouts(self, device):
        # CPU optimizer offload at stages 1-3 on CUDA only: on a CPU run the states live in host RAM already
        offloaded = [(stage, "cpu") for stage in (1, 2, 3)] if device == "cuda" else []
        return [(stage, "none") for stage in range(4)] + offloaded

    def checkpoint_bytes(self, psi, precision, zero_stage):
        # the module once in the training precision (mp_rank_00_model_states.pt) and every rank's optimizer
        # partition (fp32 master copy and Adam moments, K Ψ as in the memory model); 7B mixed: 2Ψ + 12Ψ ≈ 97 GB
        param_b = 4 if precision == "fp32" else 2
        opt_b = (8 if zero_stage in (0, 3) else 12) if precision == "fp32" else 12
        return int((param_b + opt_b) * psi)

    def fit_changes(self, zero_stage, offload_optimizer, offload_param):
        changes = []
        if offload_optimizer != "cpu":
            changes.append(FitChange(
                "optimizer offload", {"zero_stage": max(zero_stage, 2), "offload_optimizer": "cpu"},
                "train.offload_optimizer: cpu" + ("" if zero_stage >= 2 else ", train.zero_stage: 2")))
        if zero_stage != 3:
            changes.append(FitChange("ZeRO-3", {"zero_stage": 3}, "train.zero_stage: 3"))
            changes.append(FitChange("ZeRO-3 with optimizer offload", {"zero_stage": 3, "offload_optimizer": "cpu"},
                                     "train.zero_stage: 3, train.offload_optimizer: cpu"))
        if zero_stage != 3 or offload_param != "cpu":
            changes.append(FitChange("ZeRO-3 with optimizer and parameter offload",
                                     {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
                                     "train.zero_stage: 3, train.offload_optimizer: cpu, train.offload_param: cpu"))
        return changes

    def offload_rungs(self, s):
        rungs = []
        if s.zero_stage < 3 and s.offload_optimizer == "none" and s.offload_param == "none":
            rungs.append({"zero_stage": 3})  # every state partitioned across the GPUs, none on the host
        if s.offload_optimizer == "none":
            rungs.append({"zero_stage": max(s.zero_stage, 2), "offload_optimizer": "cpu"})
        if (s.zero_stage, s.offload_optimizer) != (3, "cpu") and s.offload_param == "none":
            rungs.append({"zero_stage": 3, "offload_optimizer": "cpu"})
        if (s.zero_stage, s.offload_optimizer, s.offload_param) != (3, "cpu", "cpu"):
            rungs.append({"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"})
        if (s.zero_stage, s.offload_optimizer, s.offload_param) != (3, "nvme", "nvme"):
            rungs.append({"zero_stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"})
        return rungs

    def config(self, s, device: str, total_steps: int, fused_adam: bool = False, pin_memory: bool = True,
               comms_logger: bool = True) -> dict:
        """DeepSpeed's JSON config for these settings (see deepspeed_config)."""
        return deepspeed_config(s, device, total_steps, fused_adam, pin_memory, comms_logger)


ENGINE_SPECS: dict[str, EngineSpec] = {spec.name: spec for spec in (DeepSpeedSpec(), DDPSpec(), FSDPSpec())}
assert tuple(ENGINE_SPECS) == ENGINES, "the schema's train.engine enum names the engines registered here, in order"


def engine_spec(name: str) -> EngineSpec:
    """The spec of train.engine `name`; an unknown name is refused naming the key and the engines there are."""
    if name not in ENGINE_SPECS:
        raise ConfigError(f"train.engine {name!r} is not one of {list(ENGINES)}")
    return ENGINE_SPECS[name]


def resolve_zero_stage(engine: str, zero_stage: int | None) -> int | None:
    """train.zero_stage as a run uses it: the stage set, or where it is null the engine's layout (DDP 0, FSDP 3) or
    DeepSpeed's default. An unknown engine keeps null (check_engine names it)."""
    return ENGINE_SPECS[engine].resolve_stage(zero_stage) if engine in ENGINE_SPECS else zero_stage


def check_engine(s) -> None:
    """train.engine is known, the keys that mean nothing under it are refused, and so is expert parallelism where
    the engine does not build it."""
    spec = engine_spec(s.engine)
    spec.check(s)
    spec.check_expert_parallel(s)


# ds_config keys that decide what trains (precision, ZeRO stage and offload, optimizer and schedule, batch, the
# gradient's reduction) or that the pipeline needs for its own measurements, in every spelling DeepSpeed 0.19.8 reads
# (deepspeed/runtime/config.py, precision_config.py, zero/config.py): train.deepspeed may not set them, and the error
# names the pipeline key to use instead, so summary.json's precision, zero_stage and batch are what ran. A nested
# key is "parent.child".
_PRECISION = "train.precision"
_DATA_PARALLEL = "nothing: the pipeline trains data-parallel over all train.gpus × train.nodes ranks"
OWNED_DEEPSPEED_KEYS = {
    "train_batch_size": "train.global_batch_size (or micro_batch_size × grad_accum_steps × ranks)",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum_steps",
    "managed_gradient_accumulation": "train.grad_accum_steps (the engine accumulates its micro-steps itself)",
    "gradient_clipping": "train.grad_clip",
    "optimizer": "train.lr, train.weight_decay, train.adam_betas and train.adam_eps",
    "zero_allow_untested_optimizer": "train.lr, train.weight_decay, train.adam_betas and train.adam_eps (the "
                                     "optimizer is the pipeline's AdamW)",
    "zero_force_ds_cpu_optimizer": "train.offload_optimizer (DeepSpeed's CPU Adam runs with it)",
    "scheduler": "train.lr_schedule, train.warmup_steps, train.min_lr and train.decay_fraction",
    "fp16": _PRECISION + " (fp16, bf16 or fp32)",
    "bf16": _PRECISION + " (fp16, bf16 or fp32)",
    "bfloat16": _PRECISION + ": bf16 (bfloat16 is DeepSpeed's older name of bf16)",
    "amp": _PRECISION,
    "torch_autocast": _PRECISION + " (the DDP and FSDP engines train bf16/fp16 through autocast)",
    "data_types": _PRECISION + " (data_types sets the gradient-accumulation and parameter dtypes)",
    "gradient_allreduce_op": "nothing: every engine averages gradients over the ranks",
    "zero_optimization.stage": "train.zero_stage",
    "zero_optimization.offload_optimizer": "train.offload_optimizer (and train.nvme_path)",
    "zero_optimization.offload_param": "train.offload_param (and train.nvme_path)",
    "zero_optimization.cpu_offload": "train.offload_optimizer (cpu_offload is DeepSpeed's older name of it)",
    "zero_optimization.cpu_offload_param": "train.offload_param (cpu_offload_param is DeepSpeed's older name of it)",
    "zero_optimization.cpu_offload_use_pin_memory": "train.offload_optimizer / train.offload_param",
    "zero_optimization.zenflow": "nothing: ZenFlow skips and delays optimizer updates of the pipeline's AdamW",
    "tensor_parallel": _DATA_PARALLEL,
    "sequence_parallel_size": _DATA_PARALLEL,
    "expert_parallel": _DATA_PARALLEL,
    "activation_checkpointing": "train.activation_checkpointing",
    "comms_logger": "nothing: the pipeline's communication share (summary comm_fraction) is measured with it",
    "checkpoint": "train.allow_reshape",
}


def _instead(key: str) -> str:
    """'train.deepspeed.<key>: set <pipeline key> instead' (or 'remove it (<why>)' where no key replaces it)."""
    use = OWNED_DEEPSPEED_KEYS[key]
    return f"train.deepspeed.{key}: " + (f"remove it ({use.removeprefix('nothing: ')})" if use.startswith("nothing: ")
                                         else f"set {use} instead")


def owned_deepspeed_keys(extra: dict) -> list[str]:
    """The keys of a train.deepspeed mapping that the pipeline owns, as "train.deepspeed.<key>: set <key> instead"
    texts."""
    found = []
    for key, value in extra.items():
        if key in OWNED_DEEPSPEED_KEYS:
            found.append(_instead(key))
        elif key == "zero_optimization" and not isinstance(value, dict):
            # DeepSpeed reads `true` as ZeRO stage 1 (and a number as nothing it can parse)
            found.append(f"train.deepspeed.zero_optimization: {json.dumps(value)} is not a mapping "
                         f"(DeepSpeed reads true as "
                         f"ZeRO stage 1): set train.zero_stage instead, and tune ZeRO in a mapping "
                         f"(zero_optimization: {{reduce_bucket_size: ...}})")
        elif isinstance(value, dict):
            found += [_instead(f"{key}.{child}") for child in value if f"{key}.{child}" in OWNED_DEEPSPEED_KEYS]
    return found


def _merge(base: dict, extra: dict) -> dict:
    """base with extra's values; mappings are merged key by key (so zero_optimization keeps its stage)."""
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) \
            else value
    return merged


def deepspeed_config(s, device: str, total_steps: int, fused_adam: bool = False,
                     pin_memory: bool = True, comms_logger: bool = True) -> dict:
    """The DeepSpeed JSON config for these settings (written next to the run as ds_config.json), with
    train.deepspeed merged in. The learning-rate schedule is not in it: the trainer hands DeepSpeed a LambdaLR over
    `learning_rate`, because DeepSpeed has no warmup-stable-decay and its schedules warm up in different ways.

    fused_adam: DeepSpeed's FusedAdam is prebuilt in this install; without it (and without offload, where
    DeepSpeedCPUAdam runs) torch's own AdamW is used, which needs no compiler.
    pin_memory: pin offloaded host buffers (CUDA only); the launcher turns it off where torch would round them.
    comms_logger: time every collective (it synchronises each one: on for benchmark cells and CPU runs only).
    """
    zero: dict = {"stage": s.zero_stage}
    if s.zero_stage >= 1:
        zero.update(overlap_comm=device == "cuda", contiguous_gradients=True, reduce_scatter=True)
    for key in ("offload_optimizer", "offload_param"):
        target = getattr(s, key)
        if target != "none":
            zero[key] = {"device": target, "pin_memory": device == "cuda" and pin_memory}
            if target == "nvme":
                zero[key]["nvme_path"] = s.nvme_path
    ds = {
        "train_micro_batch_size_per_gpu": s.micro_batch_size,
        "gradient_accumulation_steps": s.grad_accum_steps,
        "train_batch_size": s.derived_global_batch,
        "gradient_clipping": s.grad_clip,
        "steps_per_print": 10**9,  # our own progress line replaces DeepSpeed's
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer synchronises the device at the start and end of every micro-step
        # (utils/timer.py ThroughputTimer, with timers.throughput.synchronized); the trainer times steps itself.
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": s.lr,
                "betas": list(s.adam_betas),
                "eps": s.adam_eps,
                "weight_decay": s.weight_decay,
                # FusedAdam needs CUDA and, unless prebuilt, nvcc at the first step; DeepSpeed's torch_adam switch
                # selects torch.optim.AdamW instead, with torch's fused kernel (TORCH_ADAMW_KWARGS).
                **({"torch_adam": True, **TORCH_ADAMW_KWARGS}
                   if s.offload_optimizer == "none" and (device == "cpu" or not fused_adam) else {}),
            },
        },
        "comms_logger": {"enabled": comms_logger, "verbose": False, "prof_all": comms_logger, "debug": False},
    }
    if s.precision == "fp16":
        # Dynamic loss scaling: loss_scale 0 means dynamic in DeepSpeed.
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                          "hysteresis": 2, "min_loss_scale": 1}
    elif s.precision == "bf16":
        ds["bf16"] = {"enabled": True}
    if s.activation_checkpointing:
        ds["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False}
    if s.expert_parallel > 1:
        # DeepSpeed's AutoEP replaces each MoE layer (model.layers.N.mlp: a `gate` router and fused 3-D `experts`,
        # transformers' DeepseekV3 layout, which the native model keeps) with its own, the experts split over
        # expert_parallel ranks (engines/autoep.py keeps the model's load counts and bias update on it)
        ds["expert_parallel"] = {"enabled": True, "autoep_size": s.expert_parallel, "preset_model": "deepseek_v3"}
    return _merge(ds, s.deepspeed)
