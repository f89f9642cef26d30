"""summary.json: what one training run or one benchmark repeat measured, as one versioned type.

The trainer builds its summary through `RunSummary` (so a field it writes is a field declared here) and every
reader reads the file through `RunSummary.read`. A file of another version, or with other keys, is refused with the
command that writes it anew: the pipeline regenerates its outputs, so no reader keeps branches for older files.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from pretrain_bench.core.io import key_differences

# Raised whenever the fields below change (a key added, renamed or given another meaning).
SUMMARY_VERSION = 5


class SummaryError(ValueError):
    """A summary.json this code cannot read: another version, missing or unknown keys."""


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """summary.json of a training run (role pretrain) or a benchmark repeat (role bench)."""

    version: int = SUMMARY_VERSION  # the layout of this file (SUMMARY_VERSION when written)
    name: str  # the config's name
    role: str  # pretrain (the main run) or bench (a benchmark cell's repeat)
    engine: str  # train.engine: deepspeed, ddp or fsdp
    world_size: int  # ranks
    nodes: int  # machines the ranks ran on
    device: str  # cuda or cpu
    zero_stage: int  # as the engine ran it
    offload_optimizer: str  # none, cpu or nvme
    offload_param: str  # none, cpu or nvme
    precision: str  # fp16, bf16 or fp32, as the engine ran it
    # how the device ran that precision where not natively (bf16 on a CPU without bf16 matmuls, emulated: several
    # times slower than fp32, devices.emulated_bf16_note); None where it is native
    precision_note: str | None
    comm_backend: str  # nccl or gloo
    micro_batch_size: int
    grad_accum_steps: int
    global_batch_size: int  # micro batch × accumulation × ranks
    seq_len: int
    deepspeed_overrides: dict  # train.deepspeed, as merged into ds_config.json
    steps: int  # optimizer steps of the run
    tokens_per_step: int
    tokens: int  # steps × tokens per step
    tokens_per_s: float | None  # global, steady state (warm-up and steps skipped for fp16 overflow excluded)
    step_time_s: dict  # {median, min, max, mean} over the steady-state steps
    phase_time_s: dict  # {forward, backward, optimizer}: medians, None where train.phase_timing is off
    steady_steps: int
    warmup_timing_steps: int
    peak_mem_bytes: list  # per rank (None for a rank no record has)
    # CUDA: per rank, the tensors' own peak (torch.cuda.max_memory_allocated), beside peak_mem_bytes (the allocator's
    # reserved peak); None on CPU
    peak_mem_allocated_bytes: list | None
    peak_mem_kind: str  # what was measured (the allocator's reserved peak or peak RSS)
    model: dict  # preset, parameters, non_embedding_parameters, matmul_parameters, layers, hidden_size, heads, vocab,
    # attn_implementation (the attention kernel it ran), implementation (model.implementation: the class it built)
    flops_per_token: float
    flops_formula: str
    peak_flops_per_rank: float | None
    peak_flops_source: str
    mfu: float | None  # model FLOPs utilisation, a fraction; None with mfu_note saying why
    mfu_note: str | None
    comm_fraction: float | None  # communication time ÷ step time; None with comm_method saying why
    comm_method: str
    expert_parallel: int  # train.expert_parallel: ranks each MoE layer's routed experts are split over (1: none)
    # a MoE model's all-to-all time (dispatch and combine, forward and backward) ÷ step time, timed like the
    # all-reduces; None where no experts are split over ranks
    all_to_all_fraction: float | None
    loss: dict  # {first, last, min}
    skipped_steps: int  # optimizer steps skipped for an fp16 loss-scale overflow; left out of every timed figure
    oversubscribed: bool  # more ranks than CPU cores
    threads_per_rank: int
    resumed_from_step: int | None
    memory_fit: dict | None  # train.memory_fit's pre-flight: mode, asked, chosen, changed, summary
    checkpoints: list  # committed checkpoint steps
    checkpoint_dir: str
    init_from: dict | None  # model.init_from (uri, revision, path, loaded); None for a random initialisation
    init_seed: int | None  # train.seed of a random initialisation
    lr_schedule: str
    # train.compile: {scope, time_s (wall seconds compiling, inside the warm-up steps that tokens_per_s excludes),
    # compilations}; None when off
    compile: dict | None
    eval_during_training: dict | None  # train.eval_every's evaluations; None when off
    provenance: dict  # git_commit, config_sha256, versions, hardware, slurm_job_id, load_before, load_after,
    # other_cpu (what processes outside the job used of its cores during the loop: metrics.OtherCpu), placement (each
    # rank's host, cores and threads)

    def __post_init__(self):
        if self.version != SUMMARY_VERSION:
            raise SummaryError(f"summary version {self.version!r}; this code writes version {SUMMARY_VERSION}")
        if self.mfu is not None and self.mfu > 1.0:
            # the writer refuses an MFU above 100 % (model_flops_utilisation: None and a note instead)
            raise SummaryError(f"mfu {self.mfu} is above 1: a peak below what the run achieved is not its peak")

    def to_dict(self) -> dict:
        """The JSON object summary.json holds (version first, then the fields in their order here)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict, source: Path | str = "summary.json") -> RunSummary:
        """The summary in `data` (read from `source`); refused unless it is this version with exactly these keys."""
        found = data.get("version")  # a file written before the version key has none
        missing, unknown = key_differences(cls, data, defaults_optional=False)
        problem = None
        if found != SUMMARY_VERSION:
            problem = f"it is version {found!r}, this pretrain-bench reads version {SUMMARY_VERSION}"
        elif missing or unknown:
            problem = f"its keys differ from version {SUMMARY_VERSION}'s (missing {missing}, unknown {unknown})"
        if problem is None:
            try:
                return cls(**data)
            except SummaryError as error:
                problem = str(error)
        raise SummaryError(f"{source}: {problem}; write it anew with `{regenerate_command(source)}`")

    @classmethod
    def read(cls, path: Path | str) -> RunSummary:
        return cls.from_dict(json.loads(Path(path).read_text()), path)


# What only the process that trained the steps measures: its communication time, its compile time, its CPU placement,
# and the machine's load around its loop. A job that resumes a finished run at its final checkpoint trains nothing, so
# it keeps these from the run that trained (run_state.kept_summary) instead of measuring them over no step.
MEASURED_WHILE_TRAINING = ("comm_fraction", "comm_method", "all_to_all_fraction", "resumed_from_step", "compile",
                           "oversubscribed", "threads_per_rank")
PROVENANCE_MEASURED_WHILE_TRAINING = ("load_before", "load_after", "other_cpu", "placement", "hardware",
                                      "slurm_job_id")


def keep_training_figures(summary: dict, trained: dict) -> dict:
    """`summary` (of a job that trained no step) with the figures measured while training taken from `trained`, the
    summary of the run that trained the steps."""
    kept = {**summary, **{key: trained[key] for key in MEASURED_WHILE_TRAINING}}
    kept["provenance"] = {**summary["provenance"], **{key: trained["provenance"].get(key)
                                                      for key in PROVENANCE_MEASURED_WHILE_TRAINING}}
    return kept


def regenerate_command(path: Path | str) -> str:
    """The Snakemake command that writes the summary at `path` again: results/<name>/bench/<cell>/rep<k>/summary.json
    is a benchmark repeat's (rule bench_cell), results/<name>/train/summary.json the main run's (rule pretrain)."""
    parts = Path(path).parts
    if "results" not in parts[:-2]:
        return "snakemake --cores all --forcerun pretrain (with the run's config files)"
    at = len(parts) - 1 - parts[::-1].index("results")
    name, stage = parts[at + 1], parts[at + 2]
    rule = "bench_cell" if stage == "bench" else "pretrain"
    target = Path(*parts[at:]).as_posix()
    return (f"snakemake --cores all --configfile <its config files> --config name={name} --forcerun {rule} "
            f"-- {target}")
