"""Training settings: the `train.*` config as a typed object, pre-launch checks and the DeepSpeed config.

Everything here is pure Python (no torch import) so the Snakefile can reject a bad configuration before any job
starts, and the launcher can repeat the checks once it knows the real device.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields

from pretrain_bench.config.checks import missing_trackers
from pretrain_bench.config.schema import ConfigError, default_field, keys_with, schema_enum
from pretrain_bench.core.devices import nvidia_smi_memory

LR_SCHEDULES = schema_enum("train", "lr_schedule")
VERIFY_MODES = ("full", "sampled")  # train.verify_checkpoints: how a checkpoint is verified before it is trusted


@dataclass(frozen=True)
class TrainSettings:
    """The `train:` block of the config. What each key means, its bounds and its default: the `description`,
    limits and `default` of train.<key> in schemas/config.schema.yaml, the only place they are written.

    The groups a key belongs to are its field's metadata (`config_types.keys_with`):
    fingerprint=False  may change between a checkpoint and the run that resumes it (RESUMABLE_KEYS)
    cell=False         means nothing to a benchmark cell: it keeps no checkpoints, is never restarted, and spends its
                       few steps on timing, not on held-out evaluation (CELL_IRRELEVANT_KEYS)
    trains_further     raised, trains a run further without touching the checkpoints it has kept (TRAINS_FURTHER_KEYS)
    fit                a train.memory_fit rung may change it; the model, precision, global batch and data stay as
                       asked (FIT_KEYS)
    """

    gpus: int = default_field("train", "gpus", fingerprint=False)  # "auto": resolve_gpus, without a gpu resource
    nodes: int = default_field("train", "nodes", fingerprint=False)
    rdzv_endpoint: str | None = default_field("train", "rdzv_endpoint", fingerprint=False)
    device: str = default_field("train", "device")
    engine: str = default_field("train", "engine")
    comm_backend: str = default_field("train", "comm_backend")
    zero_stage: int = default_field("train", "zero_stage", fit=True)  # null: the engine's (resolve_zero_stage)
    precision: str = default_field("train", "precision")
    offload_optimizer: str = default_field("train", "offload_optimizer", fit=True)
    offload_param: str = default_field("train", "offload_param", fit=True)
    nvme_path: str | None = default_field("train", "nvme_path", fingerprint=False)
    memory_fit: str = default_field("train", "memory_fit", fingerprint=False)
    activation_checkpointing: bool = default_field("train", "activation_checkpointing", fit=True)
    compile: bool = default_field("train", "compile", fingerprint=False)
    micro_batch_size: int = default_field("train", "micro_batch_size", fit=True)
    grad_accum_steps: int = default_field("train", "grad_accum_steps", fit=True)
    global_batch_size: int | None = default_field("train", "global_batch_size", fingerprint=False)
    max_steps: int = default_field("train", "max_steps", fingerprint=False, trains_further=True)
    max_tokens: int | None = default_field("train", "max_tokens", fingerprint=False, trains_further=True)
    lr: float = default_field("train", "lr")
    min_lr: float = default_field("train", "min_lr")
    warmup_steps: int = default_field("train", "warmup_steps")
    lr_schedule: str = default_field("train", "lr_schedule")
    decay_fraction: float = default_field("train", "decay_fraction")
    weight_decay: float = default_field("train", "weight_decay")
    adam_betas: tuple = default_field("train", "adam_betas")
    adam_eps: float = default_field("train", "adam_eps")
    grad_clip: float = default_field("train", "grad_clip")
    seed: int = default_field("train", "seed")
    checkpoint_every: int = default_field("train", "checkpoint_every", fingerprint=False, cell=False)
    keep_checkpoints: int | None = default_field("train", "keep_checkpoints", fingerprint=False, cell=False)
    warmup_timing_steps: int = default_field("train", "warmup_timing_steps", fingerprint=False)
    max_restarts: int = default_field("train", "max_restarts", fingerprint=False, cell=False)
    rank_start: str = default_field("train", "rank_start", fingerprint=False)
    collective_timeout_min: float = default_field("train", "collective_timeout_min", fingerprint=False)
    nccl_env: dict | None = default_field("train", "nccl_env", fingerprint=False)
    allow_reshape: bool = default_field("train", "allow_reshape", fingerprint=False, cell=False)
    phase_timing: bool = default_field("train", "phase_timing", fingerprint=False)
    verify_checkpoints: str = default_field("train", "verify_checkpoints", fingerprint=False)
    eval_every: int | None = default_field("train", "eval_every", fingerprint=False, cell=False)
    eval_tokens: int = default_field("train", "eval_tokens", fingerprint=False, cell=False)
    loggers: tuple = default_field("train", "loggers", fingerprint=False, cell=False)
    tracker_project: str | None = default_field("train", "tracker_project", fingerprint=False, cell=False)
    deepspeed: dict = default_field("train", "deepspeed", fingerprint=False)

    def __post_init__(self):
        # train.zero_stage null (the schema's default) is the engine's layout: resolved once, here, so every reader,
        # the resume fingerprint and the plan see a stage number
        object.__setattr__(self, "zero_stage", resolve_zero_stage(self.engine, self.zero_stage))
        # train.gpus auto (the schema's default) in settings built without a config in view: as resolve_gpus decides
        # without a `gpu` resource
        object.__setattr__(self, "gpus", resolve_gpus(self.gpus, self.device, self.nodes, None))

    @classmethod
    def from_config(cls, train: dict) -> TrainSettings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(train) - known)
        if unknown:
            raise ConfigError(f"train: unknown key(s) {unknown}")
        train = dict(train)
        if train.get("adam_betas") is not None:
            train["adam_betas"] = tuple(train["adam_betas"])  # YAML/JSON give a list; frozen settings hash a tuple
        if train.get("loggers") is not None:
            train["loggers"] = tuple(train["loggers"])
        if train.get("deepspeed") is None:
            train["deepspeed"] = {}
        return cls(**train)

    @property
    def world_size(self) -> int:
        return self.gpus * self.nodes

    @property
    def derived_global_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.world_size

    def total_steps(self, seq_len: int) -> int:
        """Optimizer steps the run makes: max_steps, or enough steps to cover max_tokens."""
        if self.max_tokens is None:
            return self.max_steps
        tokens_per_step = self.derived_global_batch * seq_len
        return max(1, -(-self.max_tokens // tokens_per_step))

    def checkpoint_steps(self, seq_len: int) -> list[int]:
        """Steps at which the run leaves a complete checkpoint that is still kept at the end."""
        total = self.total_steps(seq_len)
        steps = sorted(set(range(self.checkpoint_every, total + 1, self.checkpoint_every)) | {total})
        return steps[-self.keep_checkpoints:] if self.keep_checkpoints else steps

    def as_dict(self) -> dict:
        values = asdict(self)
        values["adam_betas"] = list(self.adam_betas)
        values["loggers"] = list(self.loggers)
        return values


RESUMABLE_KEYS = keys_with(TrainSettings, "fingerprint", False)
CELL_IRRELEVANT_KEYS = keys_with(TrainSettings, "cell", False)
TRAINS_FURTHER_KEYS = keys_with(TrainSettings, "trains_further")
FIT_KEYS = keys_with(TrainSettings, "fit")


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


def learning_rate(step: int, s: TrainSettings, total_steps: int) -> float:
    """The learning rate of optimizer step `step` (0-based: the rate the first step uses is learning_rate(0)).

    1) warm-up: linear from lr/warmup_steps to lr over warmup_steps steps (none when 0);
    2) then, until total_steps: cosine from lr to min_lr (cosine), a straight line to min_lr (linear), lr throughout
       (constant), or lr until the last decay_fraction of the steps and a straight line to min_lr over those
       (warmup-stable-decay, "WSD": Hu et al. 2024, MiniCPM §4).
    """
    warmup = min(s.warmup_steps, max(total_steps - 1, 0))
    if step < warmup:
        return s.lr * (step + 1) / warmup
    if s.lr_schedule == "constant":
        return s.lr
    if s.lr_schedule == "warmup-stable-decay":
        decay_steps = max(1, round((total_steps - warmup) * s.decay_fraction))
        start = total_steps - decay_steps
        if step < start:
            return s.lr
        progress = min(1.0, (step - start + 1) / decay_steps)
        return s.lr + (s.min_lr - s.lr) * progress
    progress = min(1.0, (step - warmup + 1) / max(1, total_steps - warmup))  # the last step reaches min_lr
    if s.lr_schedule == "linear":
        return s.lr + (s.min_lr - s.lr) * progress
    return s.min_lr + (s.lr - s.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def check_settings(s: TrainSettings, device: str | None = None, seq_len: int | None = None) -> None:
    """Reject combinations that cannot run. `device` is the resolved device (cuda|cpu) when known; `seq_len`
    (model.seq_len), when given, lets a max_tokens run be checked against its step count too."""
    if s.global_batch_size is not None and s.global_batch_size != s.derived_global_batch:
        per_step = s.micro_batch_size * s.world_size
        hint = "set train.global_batch_size: null to derive it from the other three"
        if s.global_batch_size % per_step == 0:
            hint += f", or train.grad_accum_steps: {s.global_batch_size // per_step} to keep it"
        raise ConfigError(
            f"train.global_batch_size {s.global_batch_size} is not micro_batch_size {s.micro_batch_size} × "
            f"grad_accum_steps {s.grad_accum_steps} × ranks {s.world_size} (gpus {s.gpus} × nodes {s.nodes}) "
            f"= {s.derived_global_batch}: {hint}"
        )
    check_engine(s)
    if s.verify_checkpoints not in VERIFY_MODES:
        raise ConfigError(f"train.verify_checkpoints {s.verify_checkpoints!r} is not one of {list(VERIFY_MODES)}")
    if s.offload_param != "none" and s.zero_stage != 3:
        raise ConfigError(f"train.offload_param={s.offload_param} needs train.zero_stage 3 (got {s.zero_stage})")
    if s.offload_optimizer != "none" and s.zero_stage == 0:
        raise ConfigError("train.offload_optimizer needs train.zero_stage 1, 2 or 3 (got 0)")
    if s.offload_optimizer == "nvme" and s.zero_stage != 3:
        raise ConfigError(f"train.offload_optimizer=nvme needs train.zero_stage 3 (got {s.zero_stage}): DeepSpeed "
                          "swaps optimizer states to NVMe only under ZeRO-3 (ZeRO-Infinity)")
    if s.min_lr > s.lr:
        raise ConfigError(f"train.min_lr {s.min_lr} is above train.lr {s.lr}")
    if s.max_tokens is None or seq_len:
        steps = s.total_steps(seq_len) if s.max_tokens is not None else s.max_steps
        limit = f"train.max_steps {s.max_steps}" if s.max_tokens is None else \
            f"the {steps} steps of train.max_tokens {s.max_tokens}"
        # 0 means no warm-up; any other value must leave steps at the full rate, or train.lr is never reached.
        if s.warmup_steps and s.warmup_steps >= steps:
            raise ConfigError(f"train.warmup_steps {s.warmup_steps} is not below {limit}: the learning rate would "
                              f"never reach train.lr; lower train.warmup_steps (0 for none) or raise the steps")
    if s.lr_schedule not in LR_SCHEDULES:
        raise ConfigError(f"train.lr_schedule {s.lr_schedule!r} is not one of {list(LR_SCHEDULES)}")
    if len(s.adam_betas) != 2 or not all(0 <= beta < 1 for beta in s.adam_betas):
        raise ConfigError(f"train.adam_betas {list(s.adam_betas)} must be two numbers in [0, 1)")
    missing = missing_trackers(s.loggers)
    if missing:
        raise ConfigError("; ".join(missing))
    owned = owned_deepspeed_keys(s.deepspeed)
    if owned:
        raise ConfigError("train.deepspeed sets what the pipeline owns: " + "; ".join(owned))
    device = device or (s.device if s.device != "auto" else None)
    if device == "cpu":
        if s.precision == "fp16":
            raise ConfigError(
                "train.precision fp16 is not supported on a CPU run (DeepSpeed's CPU accelerator has no fp16 "
                "loss scaling): use bf16 or fp32"
            )
        if s.comm_backend == "nccl":
            raise ConfigError("train.comm_backend nccl needs CUDA GPUs; a CPU run uses gloo")
        if "nvme" in (s.offload_optimizer, s.offload_param):
            raise ConfigError("train.offload_optimizer/offload_param nvme needs CUDA GPUs (a CPU run keeps its "
                              "states in RAM already)")
    if device == "cuda" and s.rank_start == "fork":
        raise ConfigError("train.rank_start fork is for CPU ranks: CUDA cannot be used in a process forked from one "
                          "that has initialised it, as DeepSpeed's import does; use auto or exec on CUDA")


ENGINES = schema_enum("train", "engine")
# The ZeRO stage naming each PyTorch engine's layout of the model states: DDP replicates parameters, gradients and
# optimizer states on every rank (ZeRO-0's layout); FSDP shards all three (ZeRO-3's). The memory model, the pre-flight
# and the tables read train.zero_stage that way.
ENGINE_STAGE = {"ddp": 0, "fsdp": 3}
# train.zero_stage's value under DeepSpeed when the config leaves it null: ZeRO-2, the source articles' setup.
DEEPSPEED_DEFAULT_STAGE = 2


def resolve_zero_stage(engine: str, zero_stage: int | None) -> int | None:
    """train.zero_stage as a run uses it: the stage set, or where it is null the engine's layout (ENGINE_STAGE: ddp
    0, fsdp 3) or DeepSpeed's default (DEEPSPEED_DEFAULT_STAGE). An unknown engine keeps null (check_engine names
    it)."""
    if zero_stage is not None:
        return zero_stage
    return ENGINE_STAGE.get(engine, DEEPSPEED_DEFAULT_STAGE if engine == "deepspeed" else None)


def resolve_gpus(gpus: int | str, device: str, nodes: int, gpu_resource: int | None) -> int:
    """train.gpus as ranks per node. `gpu_resource`: Snakemake's `--resources gpu=N` when given (the GPUs of the whole
    job, every node's), else None.

    auto: N divided over the nodes; without a resource, the GPUs nvidia-smi sees when `device` is cuda or auto, else
    1 (a CPU run, or a GPU config planned on a machine without GPUs). A number is kept as given, but a job asking for
    more GPUs than the resource holds is refused, naming both: Snakemake would cap the job's request and still
    launch every rank."""
    if gpus == "auto":
        if gpu_resource is not None:
            if gpu_resource < nodes:
                raise ConfigError(f"train.gpus auto: --resources gpu={gpu_resource} leaves no GPU per node for "
                                  f"train.nodes {nodes}; give at least --resources gpu={nodes}")
            return gpu_resource // nodes
        return (len(nvidia_smi_memory()) or 1) if device != "cpu" else 1
    if gpu_resource is not None and gpus * nodes > gpu_resource:
        asked = f"train.gpus {gpus}" + (f" × train.nodes {nodes} = {gpus * nodes} GPUs" if nodes > 1 else "")
        raise ConfigError(f"{asked} but --resources gpu={gpu_resource}: the job would be capped to "
                          f"{gpu_resource} GPUs and still start {gpus * nodes} ranks. Give --resources "
                          f"gpu={gpus * nodes}, or set train.gpus: auto (ranks from --resources gpu)")
    return gpus


def fill_resolved_defaults(config: dict, gpu_resource: int | None = None) -> dict:
    """In place, right after validation: a null train.zero_stage becomes the stage its engine implies
    (resolve_zero_stage), train.gpus a number of ranks per node (resolve_gpus, with Snakemake's `--resources gpu=N`
    as `gpu_resource` when given); returns config. Every reader of the validated config (the plan config, the
    benchmark matrix's axes, the cells) then sees what TrainSettings sees, and a DeepSpeed run that leaves the key out
    plans, fingerprints and digests as it did when the schema's default was 2."""
    train = config["train"]
    train["zero_stage"] = resolve_zero_stage(train["engine"], train["zero_stage"])
    train["gpus"] = resolve_gpus(train["gpus"], train["device"], train["nodes"], gpu_resource)
    return config


ENGINE_LAYOUT = {"ddp": "DDP replicates parameters, gradients and optimizer states on every rank (ZeRO-0's layout)",
                 "fsdp": "FSDP shards parameters, gradients and optimizer states across the ranks (ZeRO-3's layout)"}


def check_engine(s: TrainSettings) -> None:
    """Keys that mean nothing for train.engine are refused with the reason, never silently ignored."""
    if s.engine not in ENGINES:
        raise ConfigError(f"train.engine {s.engine!r} is not one of {list(ENGINES)}")
    if s.engine == "deepspeed":
        return
    stage = ENGINE_STAGE[s.engine]
    if s.zero_stage != stage:
        raise ConfigError(f"train.zero_stage {s.zero_stage} means nothing under train.engine {s.engine}: "
                          f"{ENGINE_LAYOUT[s.engine]}. Leave train.zero_stage out (or null: the engine's "
                          f"{stage}), or set train.engine: deepspeed for ZeRO-{s.zero_stage}")
    for key in ("offload_optimizer", "offload_param"):
        if getattr(s, key) != "none":
            raise ConfigError(f"train.{key} {getattr(s, key)} means nothing under train.engine {s.engine}: "
                              "offloading is DeepSpeed's (ZeRO-Offload/Infinity); set it to none or use "
                              "train.engine: deepspeed")
    if s.deepspeed:
        raise ConfigError(f"train.deepspeed {sorted(s.deepspeed)} means nothing under train.engine {s.engine}: "
                          "it is merged into DeepSpeed's config; remove it or use train.engine: deepspeed")


# torch.optim.AdamW as every engine builds it (DeepSpeed's torch_adam path passes these through): torch's fused
# kernel, one pass over each parameter's state on CPU and CUDA alike. The default on CPU is the single-tensor loop,
# which makes five passes and allocates temporaries; on ZeRO-1/2's flat fp32 partition (tens of MB, out of cache)
# it cost about 10 % of a step of the bench model (bench/bench_trainer.py), fused about 1.5 %.
TORCH_ADAMW_KWARGS = {"fused": True}


def deepspeed_config(s: TrainSettings, device: str, total_steps: int, fused_adam: bool = False,
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
    config = {
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
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                          "hysteresis": 2, "min_loss_scale": 1}
    elif s.precision == "bf16":
        config["bf16"] = {"enabled": True}
    if s.activation_checkpointing:
        config["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False}
    return _merge(config, s.deepspeed)
