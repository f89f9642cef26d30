"""The machine's peak FLOP/s, measured once per machine and software (rule measure_peak) for the report and time
estimates.

CUDA: the datasheet figure for a known GPU (16-bit tensor cores, fp32 accumulate) and a measured bf16 matmul on
one GPU. CPU: matmuls measured on all cores at once in one process (the ceiling every CPU cell shares), in each
precision the CPU runs natively, the fastest taken (`cpu_machine_peak`). Either way one figure per machine, whatever
precision a run or cell trains in: a matrix that declares fp32 and bf16 divides both by the same peak.
The 1-minute load before and after the measurement is recorded beside it (`load_before`, `load_after`), and the share
of the cores that other processes used meanwhile (`other_cpu`, metrics.OtherCpu): a peak measured while something
else ran is too low (physical_checks.peak_flag).
Each run's own MFU still uses the peak its summary.json names; this file is the reference beside it.

Every run name on the machine shares the figure: it lives beside the shared data products, at
results/data/machine-<id>/peak.json (`MachinePeak`), <id> a digest of what the figure depends on
(`machine_identity`: the device, this machine's architecture, CPU model, core counts and GPU, and torch's version),
and the file records that identity and when it was measured. Another run name, or the same one with other settings,
reads it as it is; a new torch, another GPU or a job confined to fewer cores measures anew. The identity is taken
where Snakemake builds the DAG: under a cluster scheduler that is the submitting host, and the figure's own
`hardware` names the node it was measured on.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

from pretrain_bench.core.devices import (
    GPU_LOCK_DIR,
    cpu_bf16_is_native,
    evaluation_device,
    gpu_names,
    hardware_description,
    usable_cpu_count,
)
from pretrain_bench.train.metrics import OtherCpu, load_average
from pretrain_bench.train.run_context import usable_cpus

ID_HEX_DIGITS = 10


def machine_identity(device: str) -> dict:
    """What the machine's peak depends on, without importing torch (DAG time stays fast): the device, this machine
    (core.devices.hardware_description without torch; the GPU's name from nvidia-smi), the cores this process may
    use (a measurement uses all of them) and torch's version."""
    identity = {**hardware_description("cpu"), "device": device, "usable_cpus": usable_cpu_count(),
                "torch": metadata.version("torch")}
    if device == "cuda":
        names = gpu_names()
        identity["gpu_name"] = names[0] if names else None
    return identity


@dataclass(frozen=True)
class MachinePeak:
    """Where one machine and software's peak lives: results/<folder>/peak.json, shared by every run name."""

    identity: dict  # machine_identity: what the figure depends on, recorded in the file beside it
    folder: str  # data/machine-<id>, relative to results/ (logs/ and benchmarks/ mirror it)

    @classmethod
    def of(cls, identity: dict) -> MachinePeak:
        text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
        return cls(identity, f"data/machine-{hashlib.sha256(text.encode()).hexdigest()[:ID_HEX_DIGITS]}")

    @classmethod
    def here(cls, device: str) -> MachinePeak:
        """This machine's, for runs on `device` (cuda|cpu, resolved)."""
        return cls.of(machine_identity(device))

    @property
    def path(self) -> str:
        return f"results/{self.folder}/peak.json"


def measure_hardware_peak(requested_device: str, lock_dir: Path = GPU_LOCK_DIR, identity: dict | None = None
                          ) -> dict:
    """The peak, with the load around its measurement, the time it was measured and, given, the identity that keys
    it (`machine_identity`)."""
    with evaluation_device(requested_device, lock_dir) as run_device:  # on a GPU: one slot, like an evaluation
        result = _measure(run_device)
    result["measured_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    if identity is not None:
        result["identity"] = identity
    return result


def _measure(run_device: str) -> dict:
    import torch

    from pretrain_bench.train.models.flops import gpu_table_peak, measure_matmul_peak

    device = torch.device(run_device).type
    started = time.perf_counter()
    # the load around the measurement and what else ran meanwhile (physical_checks.peak_flag): a peak measured on a
    # busy machine is too low
    result: dict = {"device": device, "hardware": hardware_description(device), "load_before": load_average()}
    other_cpu = OtherCpu(usable_cpus())  # measuring from here
    if device == "cuda":
        name = torch.cuda.get_device_name()
        measured = measure_matmul_peak("bf16", size=8192, repeats=20, device=run_device)
        table = gpu_table_peak(name, "bf16")
        result.update(measured_flops=measured, measured_method=f"best of 20 bf16 8192² matmuls x @ wᵀ on one {name}",
                      table_flops=table[0] if table else None, table_source=table[1] if table else None)
        result["peak_flops"], result["peak_source"] = (table if table else
                                                       (measured, "measured: " + result["measured_method"]))
    else:
        cores = usable_cpu_count()
        torch.set_num_threads(cores)
        measured, method = cpu_machine_peak(where=f" in one process on {cores} cores")
        result.update(measured_flops=measured, measured_method=method, table_flops=None, table_source=None,
                      peak_flops=measured, peak_source="measured: " + method)
    result["seconds"] = time.perf_counter() - started
    result["load_after"] = load_average()
    result["other_cpu"] = other_cpu.stop()
    return result


# The CPU's peak: square matmuls of growing size, each size at most CPU_REPEATS timed calls within CPU_SIZE_BUDGET_S
# (its warm-up call included), so that the measurement stays short on any CPU: one where 16-bit matmuls are emulated
# (AVX2 only) ran a 2048² bf16 call in 1.6 s on 2 cores against fp32's 0.2 s, and one without AVX2 is slower still. A
# size whose one call is predicted, from the previous size's best call scaled by the cube of the sizes' ratio, to take
# over half that budget is left out, and the method says so.
CPU_SIZES = (512, 1024, 2048)
CPU_REPEATS = 8
CPU_SIZE_BUDGET_S = 5.0
# bf16's larger sizes are left out once, at one size, it runs under this fraction of fp32's FLOP/s at the same size:
# from there it cannot become the peak unless its FLOP/s grew with size over twice as fast as fp32's. A CPU whose
# oneDNN reports native bf16 but whose bf16 matmuls run at a quarter of fp32's (this 2-core machine: 512², 1024² and
# 2048² at 0.058 against 0.25 TFLOP/s) otherwise spends 3 of the measurement's 4 s on them.
RIVAL_FRACTION = 0.5


class MatmulPeak(NamedTuple):
    flops: float  # the best FLOP/s over the sizes timed
    method: str  # what was timed: "best <dtype> square matmul x @ wᵀ (<size>² ×<calls>, …)" and any size left out
    by_size: dict[int, float]  # each timed size's best FLOP/s


def cpu_machine_peak(native_bf16=None, where: str = "", **sizes) -> tuple[float, str]:
    """(FLOP/s, what was measured, each measurement followed by `where`) of this CPU: the faster of fp32 and bf16
    square matmuls (`cpu_matmul_peak`, with `sizes`' arguments), the other's figure named beside it. bf16 is measured
    only where oneDNN reports native bf16 matmuls (`native_bf16`: the check, by default oneDNN's own): elsewhere they
    are emulated, computed in fp32 after a conversion, so they cannot be the faster, and timing them would only
    lengthen the measurement; and only up to the size where it runs under RIVAL_FRACTION of fp32."""
    fp32 = cpu_matmul_peak("fp32", **sizes)
    if not (native_bf16 or cpu_bf16_is_native)():
        return fp32.flops, (f"{fp32.method}{where}; bf16 not measured: this CPU has no native bf16 matmuls (oneDNN), "
                            "so they are emulated in fp32")
    bf16 = cpu_matmul_peak("bf16", rival=("fp32", fp32.by_size), **sizes)
    best, other = sorted((fp32, bf16), key=lambda measured: -measured.flops)
    return best.flops, (f"{best.method}{where}; {other.method.removeprefix('best ')}{where}: "
                        f"{other.flops / 1e12:.3g} TFLOP/s")


def cpu_matmul_peak(dtype: str, sizes: tuple[int, ...] = CPU_SIZES, repeats: int = CPU_REPEATS,
                    budget_s: float = CPU_SIZE_BUDGET_S, rival: tuple[str, dict[int, float]] | None = None
                    ) -> MatmulPeak:
    """The best FLOP/s over `sizes` of square matmuls in `dtype` with the current thread count, what was measured, and
    each size's figure. `rival`: another dtype's name and figures by size; the sizes after one where this dtype ran
    under RIVAL_FRACTION of the rival's are left out, and the method says so."""
    from pretrain_bench.train.models.flops import matmul_timings

    by_size, ran, left_out, previous = {}, [], "", None
    for position, size in enumerate(sizes):
        if previous is not None:
            predicted = previous[1] * (size / previous[0]) ** 3
            if predicted > budget_s / 2:
                left_out = (f"; {', '.join(f'{n}²' for n in sizes[position:])} left out: one {size}² call predicted "
                            f"at {predicted:.3g} s, over half the {budget_s:g} s each size may take")
                break
        timings = matmul_timings(dtype, size, repeats, budget_s=budget_s)
        previous = (size, min(timings))
        by_size[size] = 2.0 * size**3 / previous[1]
        ran.append(f"{size}² ×{len(timings)}")
        if rival and size in rival[1] and by_size[size] < RIVAL_FRACTION * rival[1][size] and sizes[position + 1:]:
            left_out = (f"; {', '.join(f'{n}²' for n in sizes[position + 1:])} left out: at {size}² it ran at "
                        f"{by_size[size] / 1e12:.3g} TFLOP/s, under {RIVAL_FRACTION:g}× {rival[0]}'s "
                        f"{rival[1][size] / 1e12:.3g}")
            break
    return MatmulPeak(max(by_size.values()), f"best {dtype} square matmul x @ wᵀ ({', '.join(ran)} calls{left_out})",
                      by_size)
