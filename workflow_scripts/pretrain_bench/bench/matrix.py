"""The benchmark matrix: which cells exist, which of them this machine can run, and why the others are left out.

Decided once at DAG time (pure Python, no torch import, one `nvidia-smi` call at most) so that cells that cannot
run never become jobs; the same decisions are written to bench/matrix.json for the report.
A cell is one combination of `benchmark.matrix` values; each cell × repeat is one training launch whose train
settings are the config's `train:` block with the cell's values and the benchmark's step counts.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

from pretrain_bench.config.schema import AXES, BenchSettings, ConfigError, ModelSettings, ReportSettings
from pretrain_bench.core.devices import resolve_device_cheaply
from pretrain_bench.core.formats import fmt_duration
from pretrain_bench.train.engines.spec import ENGINE_SPECS, PLAIN_BASELINE, engine_spec
from pretrain_bench.train.memory.model import (
    Budget,
    assumed_mark,
    config_vocab_size,
    detect_budget,
    estimate,
    gib,
    judge,
    labelled,
    run_shape,
)
from pretrain_bench.train.memory.offload import planned_cores
from pretrain_bench.train.models.registry import check_expert_parallel
from pretrain_bench.train.plan import cell_settings
from pretrain_bench.train.settings import PlanConfig, TrainSettings, check_settings


@dataclass(frozen=True)
class Cell:
    """One combination of matrix values."""

    gpus: int
    zero_stage: int
    precision: str
    comm_backend: str
    micro_batch_size: int
    offload_optimizer: str
    engine: str = "deepspeed"
    activation_checkpointing: bool = False
    expert_parallel: int = 1  # the matrix's expert_parallel axis (left out: the main run's train.expert_parallel)

    def name(self, main: TrainSettings) -> str:
        """`ranks3-zero2-fp32-gloo` (DeepSpeed) or `ddp-ranks3-fp32-gloo`, plus `-mb<n>` / `-offload` / `-ckpt` (or
        `-no-ckpt`) where the cell differs from the main run (`main`) there, and `-ep<n>` for expert parallelism."""
        name = engine_spec(self.engine).cell_name(self.gpus, self.zero_stage, self.precision, self.comm_backend)
        if self.micro_batch_size != main.micro_batch_size:
            name += f"-mb{self.micro_batch_size}"
        if self.offload_optimizer != "none":
            name += "-offload"
        if self.activation_checkpointing != main.activation_checkpointing:
            name += "-ckpt" if self.activation_checkpointing else "-no-ckpt"
        if self.expert_parallel > 1:
            name += f"-ep{self.expert_parallel}"
        return name

    def train_overrides(self, bench: BenchSettings) -> dict:
        overrides = {**asdict(self), "max_steps": bench.steps, "max_tokens": None,
                     "warmup_timing_steps": bench.warmup_steps, "warmup_steps": bench.lr_warmup_steps}
        if not engine_spec(self.engine).offloads:  # the main run's DeepSpeed-only keys do not carry over
            overrides.update(offload_param="none", deepspeed={})
        return overrides


def cells(bench: BenchSettings) -> list[Cell]:
    """Every combination of the matrix's values; none when benchmark.enabled is false or an axis is empty."""
    if not bench.enabled:
        return []
    found: dict[Cell, None] = {}
    for values in itertools.product(*(bench.matrix[axis] for axis in AXES)):
        cell = Cell(*values)
        fixed = engine_spec(cell.engine).fixed_stage
        if fixed is not None:  # an engine with one layout (DDP, FSDP): the ZeRO and offload axes collapse
            cell = Cell(**{**asdict(cell), "zero_stage": fixed, "offload_optimizer": "none"})
        found.setdefault(cell)
    return list(found)


def plan_matrix(config: PlanConfig, bench: BenchSettings, available_ranks: int | None = None,
                budget: Budget | None = None, vocab_size: int | None = None) -> dict:
    """Every cell of the matrix `bench` (the benchmark block's settings) of the main run's plan config `config`, with
    its status (run | unsupported | predicted_oom), reason and memory estimate.

    available_ranks: Snakemake's `--resources gpu=N` when given (a cell needing more could never be scheduled).
    vocab_size: `config_vocab_size` when the caller has it already (an adopted tokenizer is read to know it).
    """
    device = resolve_device_cheaply(config.train.device)
    budget = budget or detect_budget(device, bench)
    vocab_size = vocab_size or config_vocab_size(config.tokenizer, config.model)
    entries = [judge_cell(config, cell, bench, device, budget, vocab_size, available_ranks)
               for cell in cells(bench)]
    entries += [{**judge_cell(config, cell, bench, device, budget, vocab_size, available_ranks), "origin": "baseline"}
                for cell in baseline_cells(config, bench, device, entries)]
    if bench.enabled and bench.search:
        declared = {entry["cell"] for entry in entries}
        entries += [{**entry, "origin": "search"}
                    for entry in search_entries(config, bench, device, budget, vocab_size, available_ranks)
                    if entry["cell"] not in declared]
    cores, cores_source = planned_cores(device, budget.gpu_count is not None, bench.host_cores)
    return {"device": device, "budget": budget.as_dict(), "enabled": bool(entries), "steps": bench.steps,
            "warmup_steps": bench.warmup_steps, "host_cores": cores, "host_cores_source": cores_source,
            "repeats": bench.repeats, "allow_concurrent": bench.allow_concurrent, "force": bench.force,
            "cells": entries}


def baseline_cells(config: PlanConfig, bench: BenchSettings, device: str, declared: list[dict]) -> list[Cell]:
    """A plain single-device run for each precision of a matrix that measures scaling (declares a cell of more than
    one rank) but no 1-rank DDP cell in that precision: DDP on one rank, whose all-reduce over a single rank moves
    nothing, so it is the plain training loop the source articles compare N cards against. The report gives every
    speedup over the fastest measured 1-rank setup, this one among them, as well as over the engine's own 1-rank
    cell. At the matrix's first micro-batch and activation-checkpointing values (as its other cells), over gloo on
    CPU and the matrix's first backend on CUDA."""
    if not any(entry["gpus"] > 1 for entry in declared):
        return []
    backend = "gloo" if device == "cpu" else bench.matrix["comm_backend"][0]
    plain = {entry["precision"] for entry in declared if entry["engine"] == PLAIN_BASELINE and entry["gpus"] == 1}
    names = {entry["cell"] for entry in declared}
    found = [Cell(1, engine_spec(PLAIN_BASELINE).fixed_stage, precision, backend, bench.matrix["micro_batch_size"][0],
                  "none", PLAIN_BASELINE, bench.matrix["activation_checkpointing"][0])
             for precision in bench.matrix["precision"] if precision not in plain]
    return [cell for cell in found if cell.name(config.train) not in names]


def judge_cell(config: PlanConfig, cell: Cell, bench: BenchSettings, device: str, budget: Budget, vocab_size: int,
               available_ranks: int | None) -> dict:
    """A cell's matrix entry: runs, unsupported here (and why) or predicted not to fit (and short of what)."""
    entry = {"cell": cell.name(config.train), **asdict(cell), "origin": "declared", "status": "run",
             "reason": None, "forced": False, "estimate": None, "need_bytes": None, "have_bytes": None}
    try:
        settings = cell_settings(config.train, cell.train_overrides(bench))
        check_settings(settings, device)
        check_expert_parallel(config.model, settings.expert_parallel,
                              engine_spec(settings.engine).check_expert_model)
    except ConfigError as error:
        return {**entry, "status": "unsupported", "reason": str(error).replace("train.", "")}
    if device == "cuda" and budget.gpu_count is not None and cell.gpus > budget.gpu_count:
        return {**entry, "status": "unsupported", "reason": f"needs {cell.gpus} GPUs, {budget.gpu_count} detected"}
    if available_ranks is not None and cell.gpus > available_ranks:
        return {**entry, "status": "unsupported",
                "reason": f"needs {cell.gpus} GPUs, --resources gpu={available_ranks}"}
    run = run_shape(config, settings, device, vocab_size)
    est = estimate(run)
    verdict = judge(est, run, budget)
    entry.update(estimate=est.as_dict(), need_bytes=verdict.need_bytes, have_bytes=verdict.have_bytes,
                 parameters=run.parameters, memory_text=verdict.text, short_of=short_of(verdict, device))
    if not verdict.fits:
        if bench.force:
            entry.update(forced=True, reason=f"predicted OOM ({verdict.text}), launched: benchmark.force")
        else:
            entry.update(status="predicted_oom", reason=f"predicted OOM: {verdict.text}")
    return entry


# benchmark.search: micro-batches are tried in powers of two up to this multiple of train.micro_batch_size (a larger
# micro-batch grows the global batch the learning rate was tuned for)
SEARCH_MICRO_BATCH_FACTOR = 4


def search_layouts(device: str) -> list[tuple[str, int, str]]:
    """(engine, ZeRO stage, optimizer offload) the search tries: DeepSpeed's stages 0-3, with CPU optimizer offload
    (stages 1-3, CUDA only: on a CPU run the states live in host RAM already), DDP and FSDP."""
    return [(name, stage, offload) for name, spec in ENGINE_SPECS.items() for stage, offload in spec.layouts(device)]


def search_entries(config: PlanConfig, bench: BenchSettings, device: str, budget: Budget, vocab_size: int,
                   available_ranks: int | None) -> list[dict]:
    """benchmark.search: the setups the memory pre-flight finds feasible for the main run's model, as runnable
    matrix entries. For each of the matrix's rank counts, precisions and backends and each layout
    (`search_layouts`): the main run's micro-batch and the largest power of two up to the predicted limit (at most
    SEARCH_MICRO_BATCH_FACTOR × the main run's), without activation checkpointing, and with it where it lets a
    larger micro-batch fit; an optimizer-offload layout only where its stage does not fit without offload."""
    main_mb = config.train.micro_batch_size
    candidates = sorted({main_mb} | {2 ** k for k in range(12) if 2 ** k <= SEARCH_MICRO_BATCH_FACTOR * main_mb})
    found: list[dict] = []
    for ranks, precision, backend in itertools.product(bench.matrix["gpus"], bench.matrix["precision"],
                                                       bench.matrix["comm_backend"]):
        fits_without_offload: set[tuple[str, int]] = set()
        for engine, stage, offload in search_layouts(device):
            if offload != "none" and (engine, stage) in fits_without_offload:
                continue
            limit_without = None
            for checkpointing in (False, True):
                judged = [judge_cell(config, Cell(ranks, stage, precision, backend, mb, offload, engine, checkpointing),
                                     bench, device, budget, vocab_size, available_ranks) for mb in candidates]
                fitting = [e for e in judged if e["status"] == "run" and not e["forced"]]
                limit = max((e["micro_batch_size"] for e in fitting), default=None)
                if limit is None or (checkpointing and limit_without is not None and limit <= limit_without):
                    continue  # nothing fits, or checkpointing buys no larger micro-batch: it only costs compute
                if not checkpointing:
                    limit_without = limit
                    fits_without_offload.add((engine, stage))
                found += [e for e in fitting if e["micro_batch_size"] in (main_mb, limit)]
    unique = {entry["cell"]: entry for entry in found}
    return list(unique.values())


def short_of(verdict, device: str) -> list[str]:
    """What a cell's memory verdict runs out of: GPU memory, host RAM, NVMe disk (a CPU run's device is the host)."""
    lacking = []
    if verdict.need_bytes > verdict.have_bytes:
        lacking.append("host RAM" if device == "cpu" else "GPU memory")
    if device == "cuda" and not verdict.host_fits:
        lacking.append("host RAM")
    if not verdict.disk_fits:
        lacking.append("NVMe disk")
    return lacking


def runnable(matrix: dict) -> list[str]:
    return [entry["cell"] for entry in matrix["cells"] if entry["status"] == "run"]


def time_estimate(entry: dict, model: ModelSettings, vocab_size: int, grad_accum_steps: int, peak: dict,
                  steps: int) -> dict | None:
    """Lower bound on a cell's step time from the measured hardware peak (100% MFU), for the report."""
    if entry["status"] != "run" or not peak.get("peak_flops"):
        return None
    tokens_per_step = entry["micro_batch_size"] * grad_accum_steps * entry["gpus"] * model.seq_len
    # CPU ranks share one machine's peak; each GPU brings its own.
    aggregate = peak["peak_flops"] * (entry["gpus"] if peak["device"] == "cuda" else 1)
    step_s = tokens_per_step * model_flops_per_token(model, vocab_size) / aggregate
    return {"min_step_time_s": step_s, "min_cell_time_s": step_s * steps, "aggregate_peak_flops": aggregate,
            "formula": "tokens per step × FLOPs per token ÷ peak (per GPU × ranks; on CPU the whole machine)"}


def model_flops_per_token(model: ModelSettings, vocab_size: int) -> float:
    from pretrain_bench.train.models.registry import model_family, model_shape

    shape = model_shape(model, vocab_size)
    return model_family(shape).flops_per_token(shape, model.seq_len)


# Stated assumptions of the DAG-time cost preview (labelled as such wherever it is printed): a share of the peak
# that a well-tuned run reaches, and the seconds one launch spends starting ranks before its first step.
PREVIEW_MFU = {"cuda": 0.30, "cpu": 0.30}
PREVIEW_STARTUP_S = {"cuda": 60.0, "cpu": 20.0}
RECOMPUTE_FACTOR = 4 / 3  # (6 + 2) / 6: one more forward per step under activation checkpointing


def cost_preview(matrix: dict, main: TrainSettings, model: ModelSettings, vocab_size: int, peak_flops: float | None,
                 peak_source: str) -> dict:
    """Predicted wall time of the main run and of the benchmark matrix, before anything runs.

    step time = tokens per step × FLOPs per token ÷ (peak × ranks on CUDA, the machine's peak on CPU) ÷ MFU, at
    100 % MFU and at PREVIEW_MFU (a typical figure), + the offloaded states' host Adam, PCIe and NVMe time per step
    (offload_time.offload_seconds, from stated figures, its host Adam on the matrix's `host_cores`), plus
    PREVIEW_STARTUP_S per launch. Without offload the 100 % MFU figure is a hard lower bound. Activation
    checkpointing (the main run's as chosen, each cell's own) adds a forward: × RECOMPUTE_FACTOR.
    """
    from pretrain_bench.train.memory.offload import OffloadStep, offload_seconds
    from pretrain_bench.train.models.registry import model_family, model_shape

    device = matrix["device"]
    shape = model_shape(model, vocab_size)
    psi = model_family(shape).count_parameters(shape)["total"]

    def offload(ranks, precision, optimizer, param):
        return offload_seconds(OffloadStep(psi, ranks, precision, optimizer, param, main.grad_accum_steps, device),
                               cores=matrix["host_cores"])

    # activation checkpointing runs each layer's forward again in the backward: 8 FLOPs per parameter and token
    # where the model's count is 6
    per_token = model_flops_per_token(model, vocab_size)

    def flops(checkpointed: bool) -> float:
        return per_token * (RECOMPUTE_FACTOR if checkpointed else 1.0)

    launches = [(entry["gpus"], entry["micro_batch_size"] * main.grad_accum_steps * entry["gpus"], matrix["steps"],
                 offload(entry["gpus"], entry["precision"], entry["offload_optimizer"], main.offload_param),
                 flops(entry["activation_checkpointing"]))
                for entry in matrix["cells"] if entry["status"] == "run" for _ in range(matrix["repeats"])]
    main_offload = offload(main.world_size, main.precision, main.offload_optimizer, main.offload_param)
    main_run = [(main.world_size, main.derived_global_batch, main.total_steps(model.seq_len), main_offload,
                 flops(main.activation_checkpointing))]

    def seconds(runs, mfu):
        if not peak_flops:
            return None
        total = 0.0
        for ranks, batch, steps, offloaded, flops_per_token in runs:
            aggregate = peak_flops * (ranks if device == "cuda" else 1) * mfu
            compute_s = batch * model.seq_len * flops_per_token / aggregate
            total += steps * (compute_s + offloaded["total_s"]) + PREVIEW_STARTUP_S[device]
        return total

    mfu = PREVIEW_MFU[device]
    return {"launches": len(launches), "peak_flops": peak_flops, "peak_source": peak_source, "mfu": mfu,
            "startup_s": PREVIEW_STARTUP_S[device], "main_offload": main_offload,
            "recompute": main.activation_checkpointing or any(run[4] > per_token for run in launches),
            "host_cores": matrix["host_cores"], "host_cores_source": matrix["host_cores_source"],
            "cells": cell_counts(matrix),
            "offloaded": main_offload["total_s"] > 0 or any(run[3]["total_s"] > 0 for run in launches),
            "main": {"min_s": seconds(main_run, 1.0), "typical_s": seconds(main_run, mfu)},
            "matrix": {"min_s": seconds(launches, 1.0), "typical_s": seconds(launches, mfu)}}


def cell_counts(matrix: dict) -> dict:
    """How many declared cells run, how many are predicted not to fit (and short of what), how many this machine
    cannot run at all; with the budget they were judged against."""
    entries = matrix["cells"]
    shortfalls: dict[str, int] = {}
    for entry in entries:
        if entry["status"] == "predicted_oom":
            for lacking in entry["short_of"]:
                shortfalls[lacking] = shortfalls.get(lacking, 0) + 1
    return {"declared": len(entries), "run": sum(e["status"] == "run" for e in entries),
            "forced": sum(e["forced"] for e in entries),
            "predicted_oom": sum(e["status"] == "predicted_oom" for e in entries), "short_of": shortfalls,
            "unsupported": sum(e["status"] == "unsupported" for e in entries),
            "unsupported_example": next((e["reason"] for e in entries if e["status"] == "unsupported"), None),
            "budget": matrix["budget"], "force": matrix["force"]}


def planning_peak(report: ReportSettings, bench: BenchSettings, device: str, name: str) -> tuple[float | None, str]:
    """(peak FLOP/s per rank, source) for the cost preview, without running anything: report.peak_tflops, else the
    datasheet of the GPUs found here (or of benchmark.assumed_gpu when none is), else on CPU the peak that rule
    measure_peak measured earlier for this machine and software (bench.peak.MachinePeak), or in an earlier run of
    this name before the figure was shared (results/<name>/bench/peak.json)."""
    import json
    from pathlib import Path

    from pretrain_bench.bench.peak import MachinePeak
    from pretrain_bench.core.devices import gpu_names
    from pretrain_bench.train.models.flops import gpu_table_peak

    if report.peak_tflops:
        return report.peak_tflops * 1e12, "report.peak_tflops"
    if device == "cuda":
        names = gpu_names()
        gpu = names[0] if names else bench.assumed_gpu
        # the 16-bit figure whatever train.precision is, as rule measure_peak takes it (pretrain_bench.bench.peak)
        table = gpu_table_peak(gpu, "bf16")
        where = "detected" if names else "benchmark.assumed_gpu, no GPU detected here"
        if not table:
            return None, f"no datasheet peak for {gpu} ({where})"
        return table if names else (table[0], f"{table[1]} ({where})")
    for measured in (Path(MachinePeak.here(device).path), Path("results") / name / "bench" / "peak.json"):
        if measured.is_file():
            return json.loads(measured.read_text())["peak_flops"], f"measured earlier: {measured}"
    return None, "CPU peak not measured yet"


# What the dry run's predicted wall time leaves out: the stages it does not estimate.
NOT_ESTIMATED = ("the corpus download, tokenizer training and sharding (skipped where results/data/ has them)",
                 "the evaluation and HF export of each kept checkpoint", "lm-eval where evaluate.lm_eval names tasks",
                 "the final export", "rule measure_peak", "the report")


def preview_text(preview: dict) -> str:
    """The lines `snakemake -n` prints: predicted, with the formula and its figures named, what it leaves out, and
    every hardware figure the pre-flight assumed (rather than measured here) marked as assumed."""
    from pretrain_bench.train.memory.offload import FORMULA, figures_text

    bound = "~" if preview["offloaded"] else "≥"  # with offload terms from stated figures it is an estimate

    def span(part):
        if part["min_s"] is None:
            return "unknown until the peak is known (rule measure_peak, or report.peak_tflops)"
        return (f"{bound} {fmt_duration(part['min_s'])} at 100 % MFU, ~{fmt_duration(part['typical_s'])} at "
                f"{preview['mfu']:.0%} MFU")

    peak = (f"{preview['peak_flops'] / 1e12:,.3g} TFLOP/s per rank ({labelled(preview['peak_source'])})"
            if preview["peak_flops"] else preview["peak_source"])
    main = span(preview["main"])
    step = preview["main_offload"]
    if step["total_s"]:
        main += (f"; offload {step['total_s']:,.1f} s per step (host Adam {step['adam_s']:,.1f} s + PCIe "
                 f"{step['pcie_s']:,.1f} s + NVMe {step['nvme_s']:,.1f} s)")
    recompute = (f" × {RECOMPUTE_FACTOR:.3g} (activation checkpointing's second forward)"
                 if preview["recompute"] else "")
    lines = [f"predicted wall time (steps × (tokens × FLOPs per token{recompute} ÷ peak ÷ MFU + offload) + "
             f"{preview['startup_s']:.0f} s start-up per launch; peak {peak}):"]
    if preview["offloaded"]:
        lines.append(f"  {FORMULA}; {figures_text(preview['host_cores'], labelled(preview['host_cores_source']))}")
    lines.append(f"  main run (rule pretrain): {main}")
    lines.append(f"  benchmark matrix ({preview['launches']} launches): {matrix_text(preview, span)}")
    lines.append(f"  not estimated: {'; '.join(NOT_ESTIMATED)}")
    return "\n".join(lines)


FATES = {"run": "runs", "predicted_oom": "predicted not to fit", "unsupported": "not supported here"}
# How the dry run marks a cell the config did not declare: the plain single-device baseline, or one the search added.
ORIGIN_MARKS = {"declared": "", "baseline": " [plain single-device baseline]", "search": " [benchmark.search]"}


def cells_text(matrix: dict) -> str:
    """Every declared cell (and the plain single-device baseline and every cell benchmark.search added) with its fate
    and the reason, for the dry run."""
    entries = matrix["cells"]
    if not entries:
        return "benchmark cells: none (benchmark.enabled: false, or an empty benchmark.matrix axis)"
    searched = sum(entry["origin"] == "search" for entry in entries)
    baselines = sum(entry["origin"] == "baseline" for entry in entries)
    budget = matrix["budget"]
    lines = [f"benchmark cells: {len(entries) - searched - baselines} declared"
             + (f" + {baselines} plain single-device baseline{'s' * (baselines > 1)} (DDP on one rank)"
                if baselines else "")
             + (f" + {searched} found by benchmark.search" if searched else "")
             + f", judged against {budget_text(budget)} ({labelled(budget['device_source'])}"
             + (f"; host RAM: {labelled(budget['host_source'])}" if budget["device"] == "cuda" else "") + "):"]
    for entry in entries:
        fate = FATES[entry["status"]] + (" (benchmark.force)" if entry["forced"] else "")
        origin = ORIGIN_MARKS[entry["origin"]]
        reason = (entry["reason"] or f"predicted to fit: {entry['memory_text']}").removeprefix("predicted OOM: ")
        lines.append(f"  {entry['cell']}{origin}: {fate}: {reason}")
    return "\n".join(lines)


def matrix_text(preview: dict, span) -> str:
    """The matrix's predicted time, with the declared cells left out and why; never 'off' when cells are declared."""
    counts = preview["cells"]
    declared = counts["declared"]
    if not declared:
        return "off (benchmark.enabled: false, or an empty benchmark.matrix axis)"
    left_out = []
    if counts["predicted_oom"]:
        lacking = ", ".join(f"{n} short of {what}" for what, n in counts["short_of"].items())
        left_out.append(f"{counts['predicted_oom']} predicted not to fit {budget_text(counts['budget'])} ({lacking})")
    if counts["unsupported"]:
        left_out.append(f"{counts['unsupported']} not runnable here (e.g. {counts['unsupported_example']})")
    forced = f", {counts['forced']} of them predicted not to fit (benchmark.force)" if counts["forced"] else ""
    details = " (each with its reason in bench/matrix.json)" if left_out else ""
    if counts["run"]:
        return (f"{span(preview['matrix'])}; {counts['run']} of {declared} cells run{forced}"
                + (f", left out: {'; '.join(left_out)}{details}" if left_out else ""))
    force = ", set benchmark.force: true to launch them anyway" if counts["predicted_oom"] else ""
    return f"0 of {declared} cells run: {'; '.join(left_out)}{force}{details}"


def budget_text(budget: dict) -> str:
    """'24.0 GiB per GPU (assumed) / 128.0 GiB host RAM (assumed)' (a CPU run: the host RAM its ranks share)."""
    host = (f"{gib(budget['host_bytes'])} GiB host RAM{assumed_mark(budget['host_source'])}"
            if budget["host_bytes"] is not None else "host RAM not checked")
    if budget["device"] == "cpu":
        return host
    return f"{gib(budget['device_bytes'])} GiB per GPU{assumed_mark(budget['device_source'])} / {host}"
