"""Training settings: the `train.*` config as a typed object, pre-launch checks and the DeepSpeed config.

Everything here is pure Python (no torch import) so the Snakefile can reject a bad configuration before any job
starts, and the launcher can repeat the checks once it knows the real device.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key and the reason."""


LR_SCHEDULES = ("cosine", "linear", "constant", "warmup-stable-decay")


@dataclass(frozen=True)
class TrainSettings:
    """The `train:` block of the config (see schemas/config.schema.yaml for bounds)."""

    gpus: int = 1  # ranks per node
    nodes: int = 1  # nodes
    rdzv_endpoint: str | None = None  # host:port of the c10d rendezvous when nodes > 1 (None: derived under SLURM)
    device: str = "auto"  # auto | cuda | cpu
    engine: str = "deepspeed"  # deepspeed | ddp | fsdp (see engines.py)
    comm_backend: str = "nccl"  # nccl | gloo
    zero_stage: int = 2  # DeepSpeed ZeRO stage 0-3
    precision: str = "bf16"  # fp16 | bf16 | fp32
    offload_optimizer: str = "none"  # none | cpu | nvme (nvme: ZeRO-3 only)
    offload_param: str = "none"  # none | cpu | nvme (ZeRO-3 only)
    nvme_path: str | None = None  # folder for NVMe offload (None: <state>/nvme, filled in by the plan)
    memory_fit: str = "auto"  # auto: pick settings that fit when the asked ones do not | strict: stop
    activation_checkpointing: bool = False  # recompute activations in backward
    micro_batch_size: int = 8  # samples per rank per micro-step
    grad_accum_steps: int = 1  # micro-steps per optimizer step
    global_batch_size: int | None = None  # samples per optimizer step (None: derived)
    max_steps: int = 1000  # optimizer steps
    max_tokens: int | None = None  # stop after this many tokens instead of max_steps
    lr: float = 3e-4  # peak learning rate
    min_lr: float = 3e-5  # learning rate at the end of the decay (cosine, linear, warmup-stable-decay)
    warmup_steps: int = 100  # linear warm-up steps
    lr_schedule: str = "cosine"  # cosine | linear | constant | warmup-stable-decay (see learning_rate)
    decay_fraction: float = 0.2  # warmup-stable-decay: share of the steps spent decaying at the end
    weight_decay: float = 0.1  # AdamW decoupled weight decay
    adam_betas: tuple = (0.9, 0.95)  # AdamW (beta1, beta2)
    adam_eps: float = 1e-8  # AdamW epsilon
    grad_clip: float = 1.0  # global gradient-norm clip (0 = off)
    seed: int = 1234  # weights and data order
    checkpoint_every: int = 500  # steps between checkpoints
    keep_checkpoints: int | None = None  # keep the last N complete checkpoints (None: all)
    warmup_timing_steps: int = 5  # steps left out of steady-state timing
    max_restarts: int = 0  # torchrun --max-restarts
    collective_timeout_min: float = 60.0  # torch.distributed timeout of every collective and barrier
    nccl_env: dict | None = None  # environment for NCCL runs (NCCL_P2P_DISABLE, TORCH_NCCL_ASYNC_ERROR_HANDLING …)
    allow_reshape: bool = False  # accept a checkpoint saved at another world size
    phase_timing: bool = True  # forward/backward/optimizer seconds per step (CUDA events: no synchronisation)
    verify_checkpoints: str = "sampled"  # before a resume: sampled (sizes + sampled sha256) | full (every byte)
    eval_every: int | None = None  # held-out loss every N steps during training (None: off)
    eval_tokens: int = 65536  # held-out target tokens per evaluation during training (a fixed slice of val)
    deepspeed: dict = field(default_factory=dict)  # merged into ds_config.json (keys the pipeline owns refused)

    @classmethod
    def from_config(cls, train: dict) -> "TrainSettings":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(train) - known)
        if unknown:
            raise ConfigError(f"train: unknown key(s) {unknown}")
        train = dict(train)
        if train.get("adam_betas") is not None:
            train["adam_betas"] = tuple(train["adam_betas"])  # YAML/JSON give a list; frozen settings hash a tuple
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
        return values


# ds_config keys the pipeline sets from its own config keys (or needs for its measurements): train.deepspeed may not
# set them, and the error names the key to use instead. A nested key is "parent.child".
OWNED_DEEPSPEED_KEYS = {
    "train_batch_size": "train.global_batch_size (or micro_batch_size × grad_accum_steps × ranks)",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum_steps",
    "gradient_clipping": "train.grad_clip",
    "optimizer": "train.lr, train.weight_decay, train.adam_betas and train.adam_eps",
    "scheduler": "train.lr_schedule, train.warmup_steps, train.min_lr and train.decay_fraction",
    "fp16": "train.precision",
    "bf16": "train.precision",
    "amp": "train.precision",
    "zero_optimization.stage": "train.zero_stage",
    "zero_optimization.offload_optimizer": "train.offload_optimizer (and train.nvme_path)",
    "zero_optimization.offload_param": "train.offload_param (and train.nvme_path)",
    "activation_checkpointing": "train.activation_checkpointing",
    "comms_logger": "nothing: the pipeline's communication share (summary comm_fraction) is measured with it",
    "checkpoint": "train.allow_reshape",
}


def owned_deepspeed_keys(extra: dict) -> list[str]:
    """The keys of a train.deepspeed mapping that the pipeline owns, as "train.deepspeed.<key>: use <key>" texts."""
    found = []
    for key, value in extra.items():
        if key in OWNED_DEEPSPEED_KEYS:
            found.append(f"train.deepspeed.{key}: set {OWNED_DEEPSPEED_KEYS[key]} instead")
        elif isinstance(value, dict):
            found += [f"train.deepspeed.{key}.{child}: set {OWNED_DEEPSPEED_KEYS[f'{key}.{child}']} instead"
                      for child in value if f"{key}.{child}" in OWNED_DEEPSPEED_KEYS]
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
    if s.verify_checkpoints not in ("sampled", "full"):
        raise ConfigError(f"train.verify_checkpoints {s.verify_checkpoints!r} is not sampled or full")
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


ENGINES = ("deepspeed", "ddp", "fsdp")
# The ZeRO stage naming each PyTorch engine's layout of the model states: DDP replicates parameters, gradients and
# optimizer states on every rank (ZeRO-0's layout); FSDP shards all three (ZeRO-3's). The memory model, the pre-flight
# and the tables read train.zero_stage that way.
ENGINE_STAGE = {"ddp": 0, "fsdp": 3}
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
                          f"{ENGINE_LAYOUT[s.engine]}. Set train.zero_stage: {stage}, or train.engine: deepspeed "
                          f"for ZeRO-{s.zero_stage}")
    for key in ("offload_optimizer", "offload_param"):
        if getattr(s, key) != "none":
            raise ConfigError(f"train.{key} {getattr(s, key)} means nothing under train.engine {s.engine}: "
                              "offloading is DeepSpeed's (ZeRO-Offload/Infinity); set it to none or use "
                              "train.engine: deepspeed")
    if s.deepspeed:
        raise ConfigError(f"train.deepspeed {sorted(s.deepspeed)} means nothing under train.engine {s.engine}: "
                          "it is merged into DeepSpeed's config; remove it or use train.engine: deepspeed")


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
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": s.lr,
                "betas": list(s.adam_betas),
                "eps": s.adam_eps,
                "weight_decay": s.weight_decay,
                # FusedAdam needs CUDA and, unless prebuilt, nvcc at the first step; DeepSpeed's torch_adam switch
                # selects torch.optim.AdamW instead.
                **({"torch_adam": True} if s.offload_optimizer == "none" and (device == "cpu" or not fused_adam)
                   else {}),
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
