"""Time per optimizer step that offloaded states cost beyond the FLOPs: DeepSpeed's CPU Adam on the host, the PCIe
copies between GPU and host, and ZeRO-Infinity's NVMe swaps. The FLOP-based step time (bench_matrix.cost_preview)
leaves these out, and on an offloaded run they dominate. Each term comes from a stated figure; the terms are summed
(no overlap assumed). Pure Python: the Snakefile calls this at DAG time.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

# DeepSpeed 0.19.8's DeepSpeedCPUAdam (compiled on first use), measured with bench/cpu_adam_rate.py (5e7 fp32
# parameters, 10 steps) on a 2-core Intel Xeon VM shared with other work (load ~6): 4.0e8 params/s, 2.0e8 per core
# (3.2e8 in a 5-step run). An unloaded server core is faster, so the Adam term errs long; per core, so the host's
# core count scales it.
CPU_ADAM_PARAMS_PER_S_PER_CORE = 2.0e8
CPU_ADAM_SOURCE = "DeepSpeedCPUAdam measured on a loaded 2-core Xeon VM, bench/cpu_adam_rate.py"
# Assumed: PCIe 4.0 x16 (the RTX 4090's link), 31.5 GB/s each way in theory, ~25 GB/s for pinned copies.
PCIE_BYTES_PER_S = 25e9
PCIE_SOURCE = "assumed PCIe 4.0 x16, pinned copies, each GPU its own link"
# Assumed: one PCIe 4.0 NVMe SSD at ~3 GB/s sustained, shared by every rank (DeepSpeed's async_io).
NVME_BYTES_PER_S = 3e9
NVME_SOURCE = "assumed one NVMe SSD shared by all ranks"

FORMULA = ("offload per step = host Adam Ψ ÷ (R × cores) + PCIe bytes per rank ÷ B + NVMe bytes ÷ D, summed (no "
           "overlap assumed); PCIe per rank: gradients b·Ψ/N per micro-step + updated parameters b·Ψ/N "
           "(+ parameters 2·b·Ψ/N per micro-step with parameter offload); NVMe: fp32 master, moments and gradients "
           "read and written, 32Ψ (+ 16-bit parameters b·Ψ per pass with parameter offload)")


@dataclass(frozen=True)
class OffloadStep:
    """What one run's optimizer step moves: the settings that decide the offload terms."""

    parameters: int  # Ψ
    ranks: int  # N
    precision: str  # fp16 | bf16 | fp32: b, the bytes of a training-precision element
    offload_optimizer: str  # none | cpu | nvme
    offload_param: str = "none"  # none | cpu | nvme
    grad_accum_steps: int = 1
    device: str = "cuda"


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: a container or taskset may allow fewer than exist)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def planned_cores(device: str, gpu_detected: bool, host_cores: int | None) -> tuple[int, str]:
    """(cores, source) that run the host Adam of an offloaded run: benchmark.host_cores when a CUDA run is planned on
    a machine without GPUs (its own cores say nothing about the GPU machine's), else this machine's usable cores."""
    if device == "cuda" and not gpu_detected:
        if host_cores:
            return host_cores, "benchmark.host_cores, no GPU detected here"
        return usable_cores(), ("this machine's usable cores; no GPU here: set benchmark.host_cores for the GPU "
                                "machine's")
    return usable_cores(), "this machine's usable cores"


def offload_seconds(step: OffloadStep, cores: int | None = None, adam_rate: float = CPU_ADAM_PARAMS_PER_S_PER_CORE,
                    pcie: float = PCIE_BYTES_PER_S, nvme: float = NVME_BYTES_PER_S) -> dict:
    """Seconds per optimizer step by term ({adam_s, pcie_s, nvme_s, total_s}); all 0 without optimizer offload."""
    terms = {"adam_s": 0.0, "pcie_s": 0.0, "nvme_s": 0.0}
    if step.offload_optimizer == "none":
        return {**terms, "total_s": 0.0}
    psi, n, accum = step.parameters, step.ranks, step.grad_accum_steps
    b = 4 if step.precision == "fp32" else 2
    # every rank's partition is updated at once on the host's cores
    terms["adam_s"] = psi / (adam_rate * (cores or usable_cores()))
    if step.device == "cuda":  # a CPU run's "device" is the host: nothing crosses PCIe
        per_rank = b * psi / n * (accum + 1)  # gradients down each micro-step, updated parameters up once
        if step.offload_param != "none":
            per_rank += 2 * b * psi / n * accum  # partitions fetched for the forward and the backward
        terms["pcie_s"] = per_rank / pcie
    disk = 0.0
    if step.offload_optimizer == "nvme":
        disk += 32 * psi  # fp32 master, exp_avg, exp_avg_sq read and written (24Ψ) + fp32 gradients out and in (8Ψ)
    if step.offload_param == "nvme":
        disk += b * psi * (2 * accum + 1)  # read for each forward and backward, written after the step
    terms["nvme_s"] = disk / nvme
    return {**terms, "total_s": sum(terms.values())}


def figures_text(cores: int, cores_source: str) -> str:
    """The stated figures, for the printed formula."""
    return (f"R = {CPU_ADAM_PARAMS_PER_S_PER_CORE:.2g} params/s per core ({CPU_ADAM_SOURCE}) × {cores} cores "
            f"({cores_source}), B = {PCIE_BYTES_PER_S / 1e9:.0f} GB/s ({PCIE_SOURCE}), "
            f"D = {NVME_BYTES_PER_S / 1e9:.0f} GB/s ({NVME_SOURCE})")
