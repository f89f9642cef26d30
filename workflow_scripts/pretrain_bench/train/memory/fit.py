"""train.memory_fit: what a run does when the memory model predicts that the settings asked for do not fit.

`strict` stops before anything is allocated, with the figures and what would fit (memory_model.explain).
`auto` takes the first change from an ordered ladder that fits the GPU memory, the host RAM and the NVMe disk it
checks, keeping the model, the precision and the global batch:

    0. ZeRO-3 (every state partitioned across the GPUs, nothing on the host: no host Adam, no PCIe traffic)
    1. optimizer offload to host RAM (ZeRO-Offload; ZeRO-2 at least), then the same under ZeRO-3 (parameters
       partitioned across the GPUs, still on them)
    2. ZeRO-3 with parameter and optimizer offload to host RAM
    3. ZeRO-3 with parameter and optimizer offload to NVMe (ZeRO-Infinity) at train.nvme_path (CUDA only; on
       the GPU machine itself it is skipped, with the reason listed among the rungs tried, where DeepSpeed's
       async_io op lacks libaio or no CUDA toolkit can build it)
    4. activation checkpointing
    5. a smaller micro-batch with more gradient accumulation (same global batch)
    then the offloads combined with 4 and with 4 + the smallest micro-batch.

Each rung is judged alone against the settings asked for, in this order: the earlier rungs cost the least
throughput for the memory they free on the articles' kind of machine. What was asked, what was chosen and why
lands in plan.json (`memory_fit`), the pretrain log and the report. Pure Python, like memory_model.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from pretrain_bench.core.devices import resolve_device_cheaply
from pretrain_bench.train.engines.spec import engine_spec
from pretrain_bench.train.memory.model import (
    GIB,
    Budget,
    checkpoint_bytes,
    detect_budget,
    estimate,
    explain,
    free_disk_bytes,
    gib,
    is_assumed,
    judge,
    labelled,
    run_shape,
)
from pretrain_bench.train.settings import FIT_KEYS, ConfigError, PlanConfig, TrainSettings


@dataclass(frozen=True)
class Rung:
    label: str
    settings: TrainSettings


def describe(s: TrainSettings) -> str:
    """'ZeRO-2 + CPU optimizer offload + activation checkpointing, micro-batch 8 × 1'."""
    text = engine_spec(s.engine).short_label(s.zero_stage)
    where = {"cpu": "CPU", "nvme": "NVMe"}
    if s.offload_param != "none":
        text += f" + {where[s.offload_param]} parameter offload"
    if s.offload_optimizer != "none":
        text += f" + {where[s.offload_optimizer]} optimizer offload"
    if s.activation_checkpointing:
        text += " + activation checkpointing"
    return text + f", micro-batch {s.micro_batch_size} × {s.grad_accum_steps} accumulation"


def ladder(s: TrainSettings, device: str) -> list[Rung]:
    """The ordered changes `auto` tries (see the module docstring); none repeats the settings asked for."""
    # the engine's offload rungs, on CUDA (a CPU run's states live in host RAM already); DDP and FSDP have none
    offloads = [replace(s, **rung) for rung in engine_spec(s.engine).offload_rungs(s)] if device == "cuda" else []
    smaller = [replace(s, micro_batch_size=mb, grad_accum_steps=s.grad_accum_steps * (s.micro_batch_size // mb))
               for mb in range(s.micro_batch_size - 1, 0, -1) if s.micro_batch_size % mb == 0]
    checkpointing = [] if s.activation_checkpointing else [replace(s, activation_checkpointing=True)]
    rungs = offloads + checkpointing + smaller
    for offload in offloads:  # combined, once no single change is enough
        rungs.append(replace(offload, activation_checkpointing=True))
        if smaller:
            rungs.append(replace(offload, activation_checkpointing=True, micro_batch_size=1,
                                 grad_accum_steps=smaller[-1].grad_accum_steps))
    unique, seen = [], {_key(s)}
    for rung in rungs:
        if _key(rung) not in seen:
            seen.add(_key(rung))
            unique.append(Rung(describe(rung), rung))
    return unique


# Planning for GPUs this machine does not have: its libaio and toolkit say nothing about the GPU machine's.
NVME_UNCHECKED = ("; libaio and the CUDA toolkit NVMe offload needs are not checked here (no GPU): the pre-flight "
                  "checks them on the GPU machine")


def nvme_prerequisites() -> str | None:
    """Why ZeRO-Infinity cannot run on this machine, or None when it can: DeepSpeed's async_io op needs libaio
    (AsyncIOBuilder().is_compatible()) and, to compile it for CUDA, a CUDA toolkit (torch's CUDA_HOME, which
    DeepSpeed's op builders use)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder
    from torch.utils.cpp_extension import CUDA_HOME

    missing = []
    if not AsyncIOBuilder().is_compatible(verbose=False):
        missing.append("libaio, which DeepSpeed's async_io op needs (apt install libaio-dev)")
    if CUDA_HOME is None:
        missing.append("a CUDA toolkit to build that op (set CUDA_HOME, or put nvcc on PATH)")
    return "skipped: NVMe offload needs " + " and ".join(missing) if missing else None


def _uses_nvme(s: TrainSettings) -> bool:
    return "nvme" in (s.offload_optimizer, s.offload_param)


def _key(s: TrainSettings) -> tuple:
    return tuple(getattr(s, k) for k in FIT_KEYS)


def checkpoint_disk(config: PlanConfig, settings: TrainSettings, parameters: int, state_dir: str,
                    gpu_here: bool) -> dict:
    """Disk the kept checkpoints need at state_dir (the newest `keep_checkpoints`, plus the one being written
    before the oldest is pruned) against the free space there — or benchmark.disk_gib when planning a GPU run on a
    machine without its GPUs."""
    steps = replace(settings, keep_checkpoints=None).checkpoint_steps(config.model.seq_len)
    kept = min(len(steps), settings.keep_checkpoints + 1) if settings.keep_checkpoints else len(steps)
    need = kept * checkpoint_bytes(parameters, settings.precision, settings.zero_stage, settings.engine)
    bench = config.benchmark
    if settings.device != "cpu" and not gpu_here and bench.disk_gib:
        have, source = int(bench.disk_gib * GIB), "benchmark.disk_gib, no GPU detected here"
    else:
        have, source = free_disk_bytes(state_dir), f"free at {state_dir}"
    return {"need_bytes": need, "have_bytes": have, "checkpoints": kept, "fits": need <= have,
            "text": f"{kept} checkpoint(s) × {disk_size(need / kept)} = {disk_size(need)} on disk, {disk_size(have)} "
                    f"{source}"}


def disk_size(value: float) -> str:
    """'90.1 GiB', or '12.3 MiB' below one GiB (a tiny run's checkpoints are not '0.0 GiB')."""
    return f"{gib(value)} GiB" if value >= GIB else f"{value / 2**20:,.1f} MiB"


def fit_run(config: PlanConfig, settings: TrainSettings, vocab_size: int | None = None, *,
            what: str = "the training run", nvme_path: str | None = None, budget: Budget | None = None,
            state_dir: str | None = None) -> tuple[TrainSettings, dict]:
    """The settings to run with and the pre-flight record; raises ConfigError when nothing fits (or, under
    `strict`, when the settings asked for do not), unless benchmark.force. With `state_dir` (a run that keeps
    checkpoints) the disk for them is checked too."""
    bench = config.benchmark
    device = resolve_device_cheaply(settings.device)
    if settings.nvme_path is None and nvme_path is not None:
        settings = replace(settings, nvme_path=str(nvme_path))
    budget = budget or detect_budget(device, bench, settings.nvme_path)

    def judged(s: TrainSettings):
        run = run_shape(config, s, device, vocab_size)
        est = estimate(run)
        return run, est, judge(est, run, budget)

    run, est, verdict = judged(settings)
    record = {"mode": settings.memory_fit, "asked": {k: getattr(settings, k) for k in FIT_KEYS},
              "asked_text": describe(settings), "asked_fits": verdict.fits, "asked_verdict": verdict.text,
              "chosen": None, "changed": {}, "tried": [], "summary": f"ran {describe(settings)} as asked"}
    chosen = settings
    if not verdict.fits and settings.memory_fit == "auto":
        for rung in ladder(settings, device):
            if _uses_nvme(rung.settings) and budget.gpu_count is not None:  # the GPU machine itself: check it
                missing = nvme_prerequisites()
                if missing:
                    record["tried"].append({"label": rung.label, "fits": False, "text": missing,
                                            "per_rank_bytes": None})
                    continue
            _, rung_est, rung_verdict = judged(rung.settings)
            unchecked = NVME_UNCHECKED if _uses_nvme(rung.settings) and budget.gpu_count is None else ""
            record["tried"].append({"label": rung.label, "fits": rung_verdict.fits,
                                    "text": rung_verdict.text + unchecked, "per_rank_bytes": rung_est.per_rank})
            if rung_verdict.fits:
                chosen, est, verdict = rung.settings, rung_est, rung_verdict
                break
    if chosen is not settings:
        record["chosen"] = describe(chosen)
        record["changed"] = {k: [getattr(settings, k), getattr(chosen, k)] for k in FIT_KEYS
                             if getattr(settings, k) != getattr(chosen, k)}
        record["summary"] = (f"asked {describe(settings)}; ran {describe(chosen)} (train.memory_fit: auto), "
                             f"because the settings asked for are predicted not to fit: {record['asked_verdict']}; "
                             f"the choice {verdict.text}"
                             + (NVME_UNCHECKED if _uses_nvme(chosen) and budget.gpu_count is None else ""))
    elif not verdict.fits:
        if not bench.force:
            message = explain(run, est, verdict, budget, what)
            if record["tried"]:
                tried = "\n".join(f"  - {t['label']}: {t['text']}" + ("" if t["text"].startswith("skipped")
                                                                       else " [does not fit]") for t in record["tried"])
                message += f"\ntrain.memory_fit: auto tried, in order:\n{tried}"
            raise ConfigError(message)
        record["summary"] = f"ran {describe(settings)} predicted not to fit ({verdict.text}): benchmark.force"
    record.update(estimate=est.as_dict(), budget=budget.as_dict(), fits=verdict.fits, text=verdict.text,
                  host_need_bytes=verdict.host_need_bytes, disk_need_bytes=verdict.disk_need_bytes)
    if state_dir is not None:
        disk = checkpoint_disk(config, chosen, run.parameters, state_dir, budget.gpu_count is not None)
        record["checkpoint_disk"] = disk
        if not disk["fits"] and not bench.force:
            raise ConfigError(f"pre-flight: {what}'s checkpoints do not fit on disk: {disk['text']}; keep fewer "
                              "(train.keep_checkpoints), checkpoint less often (train.checkpoint_every), or free "
                              "space")
    return chosen, record


def summary_line(record: dict) -> str:
    """One line for logs: the choice, or the settings asked for with their predicted peak."""
    per_rank = gib(record["estimate"]["per_rank"])
    budget = record["budget"]
    assumed = [labelled(source) for source in (budget["device_source"], budget["host_source"]) if is_assumed(source)]
    return (f"memory fit: {record['summary']} (predicted {per_rank} GiB per rank)"
            + (f"; the budget it was judged against is {'; '.join(dict.fromkeys(assumed))}" if assumed else ""))
