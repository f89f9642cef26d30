"""Per-step measurements and the steady-state summary computed from them.

`summarise_steps` is a pure function of the per-step records so the report and the tests can recompute every
figure from metrics.jsonl.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

from pretrain_bench.core.io import atomic_write_text, read_jsonl

# What a CUDA run's peak memory is: what the caching allocator reserved from the device at its peak (the figure that
# runs out: it holds the cached and fragmented blocks beside the tensors), with the tensors' own peak beside it.
CUDA_PEAK_KIND = ("torch.cuda.max_memory_reserved (the caching allocator's peak hold on the device, cached and "
                  "fragmented blocks included; the CUDA context and NCCL's buffers are outside it); the tensors' own "
                  "peak, torch.cuda.max_memory_allocated, beside it")


def peak_memory_bytes(device: str) -> tuple[int, str]:
    """(peak bytes, what was measured) for this process."""
    if device == "cuda":
        import torch

        return int(torch.cuda.max_memory_reserved()), CUDA_PEAK_KIND
    return peak_host_bytes(), "peak RSS of the rank process (getrusage)"


def peak_host_bytes() -> int:
    """This process's peak RSS (getrusage ru_maxrss): a CPU rank's whole memory, a CUDA rank's host RAM (offloaded
    states, pinned buffers, the CUDA libraries), recorded per step as metrics.jsonl's peak_host_bytes."""
    # ru_maxrss is KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def load_average() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages of this machine ([1m, 5m, 15m]); None where the OS has none."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


# What else ran on a job's cores while it trained (summary.json provenance `other_cpu`, physical_checks.busy_flag).
# The 1-minute load average cannot say it: it lags a minute behind (a benchmark cell started right after another
# inherits that cell's ranks in its "before"), and the ranks of a run with more ranks than cores push it above the
# cores by themselves. So the CPU time the kernel counted as busy on the job's cores (/proc/stat per CPU, through
# psutil), less the CPU time of the job's own processes over the same wall time, is what others took.
OTHER_CPU_METHOD = ("busy time of the run's cores (per-CPU counters, steal included) less the CPU time of the job's "
                    "own processes on this node, over the training loop, as a share of the cores' wall time")


class OtherCpu:
    """The share of `cpus`' time that processes outside this job used from this object's creation to `stop()`.

    The job is this process's torchrun agent and everything under it (every rank of this node, their children such
    as inductor's compile workers) when the process was started by torchrun, else this process and its children.
    """

    def __init__(self, cpus: tuple[int, ...]):
        import psutil

        self.cpus = tuple(cpus)
        self.root = psutil.Process()
        if os.environ.get("TORCHELASTIC_RUN_ID") is not None and self.root.parent() is not None:
            self.root = self.root.parent()  # torchrun's agent on this node
        self.wall0, self.busy0, self.job0 = time.monotonic(), self._busy(), self._job()

    def _busy(self) -> float:
        import psutil

        per_cpu = psutil.cpu_times(percpu=True)
        # guest and guest_nice are already inside user and nice on Linux
        return sum(t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
                   + getattr(t, "steal", 0.0) for cpu, t in enumerate(per_cpu) if cpu in self.cpus)

    def _job(self) -> dict[int, float]:
        """CPU seconds of every process of the job, by pid (children that exited and were waited for included)."""
        import psutil

        seconds = {}
        for process in [self.root, *self.root.children(recursive=True)]:
            try:
                t = process.cpu_times()
                seconds[process.pid] = t.user + t.system + t.children_user + t.children_system
            except psutil.Error:  # exited meanwhile: its time is in its parent's children_* once waited for
                continue
        return seconds

    def stop(self) -> dict:
        """summary.json provenance `other_cpu`: `share_pct` (others' CPU time ÷ (cores × wall time), in %) and its
        terms."""
        wall, busy, job = time.monotonic() - self.wall0, self._busy() - self.busy0, self._job()
        # a process that started within the window counts whole; one that ended unwaited is lost (a few ticks)
        own = sum(seconds - self.job0.get(pid, 0.0) for pid, seconds in job.items())
        others = max(0.0, busy - own)
        return {"share_pct": 100.0 * others / (wall * len(self.cpus)) if wall > 0 and self.cpus else None,
                "cpus": list(self.cpus), "wall_s": wall, "busy_cpu_s": busy, "job_cpu_s": own,
                "method": OTHER_CPU_METHOD}


def one_record_per_step(records: list[dict]) -> list[dict]:
    """The records in step order, each step once: where a step was recorded twice (a run restarted before a
    checkpoint covered it, in a file written before that was prevented), the later record."""
    return sorted({r["step"]: r for r in records}.values(), key=lambda r: r["step"])


def peak_allocated_bytes(device: str) -> int | None:
    """CUDA: the peak of the memory this process's tensors took (torch.cuda.max_memory_allocated), which
    peak_memory_bytes' reserved figure holds; None on CPU, where peak RSS is the one figure."""
    if device != "cuda":
        return None
    import torch

    return int(torch.cuda.max_memory_allocated())


def peak_memory_per_rank(records: list[dict], world_size: int, key: str = "peak_mem_bytes") -> list[int]:
    """Each rank's largest `key` (peak_mem_bytes, or peak_mem_allocated_bytes) over the records that have that rank (a
    run resumed at another world size holds records of both sizes); None for a rank no record has (a run resumed
    larger at its last step)."""
    return [max((r[key][rank] for r in records if r.get(key) and len(r[key]) > rank), default=None)
            for rank in range(world_size)]


def steady_steps(records: list[dict], warmup_steps: int) -> list[dict]:
    """Records after the warm-up (and after any resume's first step, which pays for loading), less the optimizer steps
    skipped for an fp16 loss-scale overflow (`overflow`): they trained nothing and skip the optimizer's work, so
    counting them would make tokens/s and MFU look better than the steps that trained (summary.json's skipped_steps
    counts them)."""
    steady = [r for r in records if r["step"] > warmup_steps and not r.get("after_resume") and not r.get("overflow")]
    return steady or records[-1:]


def summarise_steps(records: list[dict], warmup_steps: int, tokens_per_step: int) -> dict:
    """Steady-state throughput and step-time figures from metrics.jsonl records (each step counted once)."""
    records = one_record_per_step(records)
    steady = steady_steps(records, warmup_steps)
    times = [r["step_time_s"] for r in steady]
    total_time = sum(times)
    return {
        "steady_steps": len(steady),
        "tokens_per_s": tokens_per_step * len(steady) / total_time if total_time > 0 else None,
        "step_time_s": {"median": statistics.median(times), "min": min(times), "max": max(times),
                        "mean": total_time / len(times)},
        "phase_time_s": {
            phase: (statistics.median(r[f"{phase}_s"] for r in steady)
                    if all(r[f"{phase}_s"] is not None for r in steady)
                    else None)  # train.phase_timing off
            for phase in ("forward", "backward", "optimizer")
        },
        "loss": {"first": records[0]["loss"], "last": records[-1]["loss"],
                 "min": min(r["loss"] for r in records)},
    }


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop records past a resumed checkpoint's step so metrics.jsonl never holds two histories."""
    records = [r for r in read_jsonl(path) if r["step"] <= last_step]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))


class MetricsSink:
    """Rank 0's per-step outputs: metrics.jsonl (appended, flushed per record) and the trackers of train.loggers
    (pretrain_bench.train.trackers: TensorBoard, CSV, W&B, MLflow), each under its own folder of `tracker_root`. A
    context manager, so all are closed on every exit path; on the other ranks (enabled=False) it does nothing.

    run: what W&B and MLflow name the run by (name, project, id, config); None for a run without them."""

    def __init__(self, metrics_path: Path, tracker_root: Path, start_step: int, enabled: bool = True,
                 loggers: tuple = ("tensorboard",), run: dict | None = None):
        self.metrics_path, self.tracker_root, self.start_step = metrics_path, tracker_root, start_step
        self.enabled, self.loggers = enabled, tuple(loggers)
        self.run = run or {"name": Path(tracker_root).name, "project": "pretrain-bench", "id": None, "config": {}}
        self.file = None
        self.trackers: list = []

    def __enter__(self) -> MetricsSink:
        if self.enabled:
            from pretrain_bench.train.trackers import open_trackers

            # Records past the step this run starts from belong to an attempt that died before a checkpoint covered
            # them (or are a record cut short): this run writes those steps again, each once.
            truncate_jsonl(self.metrics_path, self.start_step)
            self.file = open(self.metrics_path, "a")
            try:
                self.trackers = open_trackers(self.loggers, Path(self.tracker_root), self.start_step, self.run)
            except BaseException:
                self.close()
                raise
        return self

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        from pretrain_bench.train.trackers import step_series

        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        series = step_series(record)
        for tracker in self.trackers:
            tracker.log(series, record["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close()

    def __exit__(self, *exc_info) -> None:
        self.close()
