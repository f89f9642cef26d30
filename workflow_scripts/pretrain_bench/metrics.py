"""Per-step measurements and the steady-state summary computed from them.

`summarise_steps` is a pure function of the per-step records so the report and the tests can recompute every
figure from metrics.jsonl.
"""
from __future__ import annotations

import json
import resource
import statistics
import sys
from pathlib import Path


def peak_memory_bytes(device: str) -> tuple[int, str]:
    """(peak bytes, what was measured) for this process."""
    if device == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated()), "torch.cuda.max_memory_allocated (allocator peak)"
    # ru_maxrss is KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), "peak RSS of the rank process (getrusage)"


def steady_steps(records: list[dict], warmup_steps: int) -> list[dict]:
    """Records after the warm-up (and after any resume's first step, which pays for loading)."""
    steady = [r for r in records if r["step"] > warmup_steps and not r.get("after_resume")]
    return steady or records[-1:]


def summarise_steps(records: list[dict], warmup_steps: int, tokens_per_step: int) -> dict:
    """Steady-state throughput and step-time figures from metrics.jsonl records."""
    steady = steady_steps(records, warmup_steps)
    times = [r["step_time_s"] for r in steady]
    total_time = sum(times)
    return {
        "steady_steps": len(steady),
        "tokens_per_s": tokens_per_step * len(steady) / total_time if total_time > 0 else None,
        "step_time_s": {"median": statistics.median(times), "min": min(times), "max": max(times),
                        "mean": total_time / len(times)},
        "phase_time_s": {
            phase: (statistics.median(r[f"{phase}_s"] for r in steady) if all(r[f"{phase}_s"] is not None for r in steady)
                    else None)  # train.phase_timing off
            for phase in ("forward", "backward", "optimizer")
        },
        "loss": {"first": records[0]["loss"], "last": records[-1]["loss"],
                 "min": min(r["loss"] for r in records)},
    }


def read_jsonl(path: Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop records past a resumed checkpoint's step so metrics.jsonl never holds two histories."""
    records = [r for r in read_jsonl(path) if r["step"] <= last_step]
    tmp = Path(str(path) + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(path)
