"""The benchmark matrix: which cells exist, which of them this machine can run, and why the others are left out.

Decided once at DAG time (pure Python, no torch import, one `nvidia-smi` call at most) so that cells that cannot
run never become jobs; the same decisions are written to bench/matrix.json for the report.
A cell is one combination of `benchmark.matrix` values; each cell × repeat is one training launch whose train
settings are the config's `train:` block with the cell's values and the benchmark's step counts.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

from .memory_model import Budget, detect_budget, estimate, judge, resolve_device_cheaply, run_shape
from .settings import ConfigError, TrainSettings, check_settings

AXES = ("gpus", "zero_stage", "precision", "comm_backend", "micro_batch_size", "offload_optimizer")
DEFAULTS = {"steps": 30, "warmup_steps": 10, "repeats": 3, "allow_concurrent": False, "force": False,
            "device_memory_gib": 24.0, "host_memory_gib": None}


@dataclass(frozen=True)
class BenchSettings:
    """The `benchmark:` block of the config."""

    matrix: dict  # axis -> list of values, for every axis in AXES
    steps: int  # optimizer steps per launch
    warmup_steps: int  # steps left out of the timing (train.warmup_timing_steps of a cell)
    repeats: int  # launches per cell
    allow_concurrent: bool  # let cells share the machine (timings then contended)
    force: bool  # launch cells (and the main run) predicted not to fit
    device_memory_gib: float  # memory per GPU when none can be detected
    host_memory_gib: float | None  # host RAM to plan with (None: detect)
    lr_warmup_steps: int = 0  # train.warmup_steps of a cell: the main run's, shortened to fit the cell's steps

    @classmethod
    def from_config(cls, config: dict) -> "BenchSettings":
        bench = {**DEFAULTS, **(config.get("benchmark") or {})}
        train = config["train"]
        matrix = dict(bench.get("matrix") or {})
        for axis in AXES:  # an axis the matrix leaves out keeps the main run's value
            matrix[axis] = list(matrix.get(axis) or [train.get(axis, TrainSettings.__dataclass_fields__[axis].default)])
        if bench["warmup_steps"] >= bench["steps"]:
            raise ConfigError(f"benchmark.warmup_steps {bench['warmup_steps']} leaves no timed step of "
                              f"benchmark.steps {bench['steps']}")
        # A cell runs benchmark.steps steps, often fewer than the main run's learning-rate warm-up; it keeps a warm-up
        # that ends before its last step (what DeepSpeed's scheduler was clamped to anyway), so that the rule
        # "train.warmup_steps below max_steps" holds for cells too.
        lr_warmup = min(train.get("warmup_steps", TrainSettings.warmup_steps), bench["steps"] - 1)
        return cls(matrix=matrix, lr_warmup_steps=lr_warmup, **{k: bench[k] for k in DEFAULTS})


@dataclass(frozen=True)
class Cell:
    """One combination of matrix values."""

    gpus: int
    zero_stage: int
    precision: str
    comm_backend: str
    micro_batch_size: int
    offload_optimizer: str

    def name(self, train: dict) -> str:
        """`ranks3-zero2-fp32-gloo`, plus `-mb<n>` / `-offload` where the cell differs from the main run there."""
        name = f"ranks{self.gpus}-zero{self.zero_stage}-{self.precision}-{self.comm_backend}"
        if self.micro_batch_size != train.get("micro_batch_size", 8):
            name += f"-mb{self.micro_batch_size}"
        if self.offload_optimizer != "none":
            name += "-offload"
        return name

    def train_overrides(self, bench: BenchSettings) -> dict:
        return {**asdict(self), "max_steps": bench.steps, "max_tokens": None,
                "warmup_timing_steps": bench.warmup_steps, "warmup_steps": bench.lr_warmup_steps}


def cells(bench: BenchSettings) -> list[Cell]:
    return [Cell(*values) for values in itertools.product(*(bench.matrix[axis] for axis in AXES))]


def cell_settings(config: dict, cell: Cell, bench: BenchSettings) -> TrainSettings:
    train = {**config["train"], **cell.train_overrides(bench), "global_batch_size": None}
    return TrainSettings.from_config(train)


def plan_matrix(config: dict, available_ranks: int | None = None, budget: Budget | None = None) -> dict:
    """Every cell of the matrix with its status (run | unsupported | predicted_oom), reason and memory estimate.

    available_ranks: Snakemake's `--resources gpu=N` when given (a cell needing more could never be scheduled).
    """
    bench = BenchSettings.from_config(config)
    device = resolve_device_cheaply(config["train"].get("device", "auto"))
    budget = budget or detect_budget(device, config.get("benchmark"))
    entries = []
    for cell in cells(bench):
        entry = {"cell": cell.name(config["train"]), **asdict(cell), "status": "run", "reason": None,
                 "forced": False, "estimate": None, "need_bytes": None, "have_bytes": None}
        entries.append(entry)
        try:
            settings = cell_settings(config, cell, bench)
            check_settings(settings, device)
        except ConfigError as error:
            entry.update(status="unsupported", reason=str(error).replace("train.", ""))
            continue
        if device == "cuda" and budget.gpu_count is not None and cell.gpus > budget.gpu_count:
            entry.update(status="unsupported", reason=f"needs {cell.gpus} GPUs, {budget.gpu_count} detected")
            continue
        if available_ranks is not None and cell.gpus > available_ranks:
            entry.update(status="unsupported",
                         reason=f"needs {cell.gpus} ranks, snakemake --resources gpu={available_ranks}")
            continue
        run = run_shape(config, settings, device)
        est = estimate(run)
        verdict = judge(est, run, budget)
        entry.update(estimate=est.as_dict(), need_bytes=verdict.need_bytes, have_bytes=verdict.have_bytes,
                     parameters=run.parameters, memory_text=verdict.text)
        if not verdict.fits:
            if bench.force:
                entry.update(forced=True, reason=f"predicted OOM ({verdict.text}), launched: benchmark.force")
            else:
                entry.update(status="predicted_oom", reason=f"predicted OOM: {verdict.text}")
    return {"device": device, "budget": budget.as_dict(), "steps": bench.steps, "warmup_steps": bench.warmup_steps,
            "repeats": bench.repeats, "allow_concurrent": bench.allow_concurrent, "force": bench.force,
            "cells": entries}


def runnable(matrix: dict) -> list[str]:
    return [entry["cell"] for entry in matrix["cells"] if entry["status"] == "run"]


def time_estimate(entry: dict, config: dict, peak: dict, steps: int) -> dict | None:
    """Lower bound on a cell's step time from the measured hardware peak (100% MFU), for the report."""
    from .flops import flops_per_token
    from .model import count_parameters, resolve_shape

    if entry["status"] != "run" or not peak.get("peak_flops"):
        return None
    shape = resolve_shape(config["model"]["preset"], config["model"].get("overrides") or {},
                          config["tokenizer"]["vocab_size"])
    seq_len = config["model"].get("seq_len", 128)
    per_token = flops_per_token(count_parameters(shape)["non_embedding"], shape.num_hidden_layers,
                                shape.num_attention_heads, shape.hidden_size // shape.num_attention_heads, seq_len)
    tokens_per_step = entry["micro_batch_size"] * config["train"].get("grad_accum_steps", 1) * entry["gpus"] * seq_len
    # CPU ranks share one machine's peak; each GPU brings its own.
    aggregate = peak["peak_flops"] * (entry["gpus"] if peak["device"] == "cuda" else 1)
    step_s = tokens_per_step * per_token / aggregate
    return {"min_step_time_s": step_s, "min_cell_time_s": step_s * steps, "aggregate_peak_flops": aggregate,
            "formula": "tokens per step × FLOPs per token ÷ peak (per GPU × ranks; on CPU the whole machine)"}
