"""Device discovery and local GPU slot allocation.

Snakemake's `--resources gpu=3` counts GPUs but never says which ones a job may use, so two 1-GPU jobs would both
land on device 0. `allocate_slots` hands out disjoint device ids to concurrent local jobs through lock files
(`fcntl.flock`, released automatically if the job dies). Ids a scheduler already assigned (SLURM sets
CUDA_VISIBLE_DEVICES) are respected as they are.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


class SlotError(RuntimeError):
    """Not enough free device slots."""


def cuda_device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver is the same as no GPU for this purpose
        return 0


def resolve_device(requested: str) -> str:
    """'auto' → 'cuda' when a GPU is visible, else 'cpu'; 'cuda' without a GPU is an error."""
    count = cuda_device_count()
    if requested == "auto":
        return "cuda" if count else "cpu"
    if requested == "cuda" and not count:
        raise SlotError("train.device is cuda but no CUDA device is visible on this machine (set train.device: cpu)")
    return requested


@contextlib.contextmanager
def allocate_slots(count: int, total: int, lock_dir: Path, *, timeout_s: float = 3600.0):
    """Hold `count` of `total` device ids (lock files in lock_dir) for the duration of the with-block.

    Waits (polling) until enough slots are free, so jobs that Snakemake starts together never share a device.
    Yields the list of ids.
    """
    import time

    if count > total:
        raise SlotError(f"job needs {count} devices but this machine has {total}")
    lock_dir = Path(lock_dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    while True:
        held: list[tuple[int, int]] = []
        for device_id in range(total):
            fd = os.open(lock_dir / f"slot{device_id}.lock", os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            held.append((device_id, fd))
            if len(held) == count:
                break
        if len(held) == count:
            try:
                for device_id, fd in held:
                    os.ftruncate(fd, 0)
                    os.write(fd, f"{os.getpid()}\n".encode())
                yield [device_id for device_id, _ in held]
            finally:
                for _, fd in held:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    os.close(fd)
            return
        for _, fd in held:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        if time.monotonic() > deadline:
            raise SlotError(f"no {count} free device slots of {total} in {lock_dir} after {timeout_s:.0f} s")
        time.sleep(0.5)


def hardware_description(device: str) -> dict:
    """What the run ran on, for provenance."""
    import platform

    info = {"device": device, "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "processor": _cpu_model()}
    if device == "cuda":
        import torch

        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        info.update(gpu_name=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda)
    return info


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    import platform

    return platform.processor() or "unknown"
