"""Training settings: the `train.*` config as a typed object, the plan config (what a training run reads of the
whole config, typed), and the pre-launch checks.

Everything here is pure Python (no torch import) so the Snakefile can reject a bad configuration before any job
starts, and the launcher can repeat the checks once it knows the real device.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

from pretrain_bench.config.checks import missing_trackers
from pretrain_bench.config.schema import (
    BenchSettings,
    ConfigError,
    ModelSettings,
    ReportSettings,
    ShardSettings,
    TokenizerSettings,
    default_field,
    keys_with,
    schema_default,
    schema_enum,
)
from pretrain_bench.core.devices import nvidia_smi_memory
from pretrain_bench.train.engines.spec import check_engine, resolve_zero_stage

LR_SCHEDULES = schema_enum("train", "lr_schedule")
VERIFY_MODES = ("full", "sampled")  # train.verify_checkpoints: how a checkpoint is verified before it is trusted


@dataclass(frozen=True)
class TrainSettings:
    """The `train:` block of the config. What each key means, its bounds and its default: the `description`,
    limits and `default` of train.<key> in schemas/config.schema.yaml, the only place they are written.

    The groups a key belongs to are its field's metadata (`config.schema.keys_with`):
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
    expert_parallel: int = default_field("train", "expert_parallel")
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
        if self.expert_parallel == 1:
            # left out at its default, so the plan config and resume fingerprint of a run without expert
            # parallelism are what they were before the key existed (its held checkpoints still resume)
            del values["expert_parallel"]
        return values


RESUMABLE_KEYS = keys_with(TrainSettings, "fingerprint", False)
CELL_IRRELEVANT_KEYS = keys_with(TrainSettings, "cell", False)
TRAINS_FURTHER_KEYS = keys_with(TrainSettings, "trains_further")
FIT_KEYS = keys_with(TrainSettings, "fit")


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
    if s.world_size % s.expert_parallel:
        raise ConfigError(f"train.expert_parallel {s.expert_parallel} does not divide the {s.world_size} ranks "
                          f"(train.gpus {s.gpus} × train.nodes {s.nodes}): each group of expert_parallel ranks "
                          "splits the experts between them")
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


@dataclass(frozen=True)
class PlanConfig:
    """The part of the validated config a training run reads, typed: the name, the model and train blocks, and of the
    tokenizer, benchmark, report and shards blocks the keys their settings tag plan=True (the other fields keep their
    defaults). `as_dict` is the plan config as the plan rules' params and plan.json hold it (Snakemake reruns a plan
    when it changes; the resume fingerprint digests it), so an edit anywhere else never replans."""

    name: str
    model: ModelSettings
    train: TrainSettings
    tokenizer: TokenizerSettings
    benchmark: BenchSettings
    report: ReportSettings
    shards: ShardSettings = ShardSettings()
    cell: bool = False  # a benchmark cell's: its train block leaves out the keys a timing never reads

    def as_dict(self) -> dict:
        train = self.train.as_dict()
        if self.cell:
            train = {key: value for key, value in train.items() if key not in CELL_IRRELEVANT_KEYS}
        # shards: only the keys set to other than their default, so that a plan config written before they existed is
        # the same (an edit of them replans, as one of train.verify_checkpoints does)
        shards = {key: value for key, value in _planned(self.shards).items()
                  if value != schema_default("shards", key)}
        return {"name": self.name, "model": self.model.as_dict(), "train": train,
                "tokenizer": _planned(self.tokenizer), "benchmark": _planned(self.benchmark),
                "report": _planned(self.report), **({"shards": shards} if shards else {})}

    @classmethod
    def of(cls, name: str, model: ModelSettings, train: TrainSettings, tokenizer: TokenizerSettings,
           benchmark: BenchSettings, report: ReportSettings, shards: ShardSettings) -> PlanConfig:
        """From a config's blocks, keeping of the tokenizer, benchmark, report and shards blocks only what a run
        reads (the rest at its default): the same object whichever way it was made, so nothing reads a key the plan
        rule's params leave out."""
        def planned(settings):
            return type(settings)(**_planned(settings))

        return cls(name, model, train, planned(tokenizer), planned(benchmark), planned(report), planned(shards))

    @classmethod
    def from_dict(cls, record: dict) -> PlanConfig:
        """From a plan config as `as_dict` writes it (plan.json's `config`, a plan rule's params)."""
        train = record["train"]
        return cls(name=record["name"], model=ModelSettings.from_config(record["model"]),
                   train=TrainSettings.from_config(train), tokenizer=TokenizerSettings(**record["tokenizer"]),
                   benchmark=BenchSettings(**record["benchmark"]), report=ReportSettings(**record["report"]),
                   shards=ShardSettings(**record.get("shards", {})),
                   cell=any(key not in train for key in CELL_IRRELEVANT_KEYS))

    def for_cell(self, train: TrainSettings) -> PlanConfig:
        """A benchmark cell's plan config: this one with the cell's train settings (cell_settings)."""
        return replace(self, train=train, cell=True)


def _planned(settings) -> dict:
    """The fields of a settings block a training run reads (tagged plan=True)."""
    return {key: getattr(settings, key) for key in keys_with(type(settings), "plan")}
