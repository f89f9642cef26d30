"""What one training rank needs besides the loop: the abort error, SIGTERM and SIGINT as a flag, rank-0 logging,
collectives outside DeepSpeed's comms logger, RNG state, the resume fingerprint and the held-out summary."""
from __future__ import annotations

import logging
import random
import signal
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist

from .settings import RESUMABLE_KEYS, TrainSettings

logger = logging.getLogger(__name__)


class TrainingAborted(RuntimeError):
    """Training stopped on purpose (non-finite loss, pre-emption); the last complete checkpoint is kept."""


class Preemption:
    """Turns SIGTERM and SIGINT into a flag checked at step boundaries, so the step in flight finishes and is saved.

    SIGTERM comes from a scheduler's time limit or from torchrun passing on the launcher's stop (torchrun starts the
    ranks in a session of their own, so a terminal's Ctrl-C reaches them that way); SIGINT from a `kill -INT` of a
    rank itself. Either way the ranks agree at the next step, save it and exit non-zero."""

    def __init__(self):
        self.received: str | None = None
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)

    @property
    def requested(self) -> bool:
        return self.received is not None

    def _handle(self, signum, frame):
        self.received = self.received or signal.Signals(signum).name


def log(rank: int, message: str) -> None:
    """Rank 0's progress and notices (every rank holds the same facts; one of them says them)."""
    if rank == 0:
        logger.info(message)


_comm_total_ms = 0.0  # comm_ms's running total: what earlier calls took out of DeepSpeed's logger


def comm_ms() -> float:
    """Total milliseconds spent in deepspeed.comm collectives on this rank so far (DeepSpeed's comms logger).

    deepspeed.comm times each op name with one of its synchronised timers and appends the timer's running total (not
    the op's own duration) to the logger's lists, so the largest value per op name is that op's time since the timer
    was last reset. Left alone, nothing is ever reset: every op appends to the lists, and each op's
    `elapsed(reset=False)` re-reads every start/stop pair its timer holds (on CUDA one event query each), so a
    collective costs more with every one before it. So each call takes the per-op totals, resets those timers and
    empties the logger, and keeps the sum here: called every step, the records held stay one step's worth.
    """
    global _comm_total_ms
    from deepspeed.comm import comm as ds_comm

    logger = getattr(ds_comm, "comms_logger", None)
    recorded = getattr(logger, "comms_dict", {})
    for name, by_size in recorded.items():
        _comm_total_ms += max((max(record[1]) for record in by_size.values() if record[1]), default=0.0)
        ds_comm.timers(name).reset()  # the logger's record names are the timers' names (comm.timed_op)
    if logger is not None:
        logger.reset_data()
    return _comm_total_ms


def host_values(tensor: torch.Tensor) -> list:
    """The tensor's values as Python numbers. Every read of device values in the training loop goes through here:
    on CUDA it is a synchronisation (the host waits for the stream), so the loop's count of them is this function's
    count of calls (tests/unit/test_sync_points.py)."""
    return tensor.tolist()


_pin_memory = True  # allow_pinning: set once when the rank starts, from its LaunchContext


def allow_pinning(allowed: bool) -> None:
    """Whether this rank may pin host memory (LaunchContext.pin_memory): the launcher says no where its probe in the
    job's GPU slot could not pin, e.g. under a locked-memory limit, and every pin would fail the same way. A setting
    of the process, as every host-to-device copy of it (batches, gathers) goes through host_to_device."""
    global _pin_memory
    _pin_memory = allowed


def pinning_allowed() -> bool:
    return _pin_memory


def host_to_device(tensor: torch.Tensor, device: str) -> torch.Tensor:
    """A host tensor on `device`: on CUDA copied from pinned memory, so the copy is queued and the host goes on
    (a plain copy where pinning is off); on CPU the tensor itself."""
    if device == "cpu":
        return tensor
    if pinning_allowed():
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def gather_floats(values: list, device: str) -> list[list[float]]:
    """All ranks' values (rank order) through torch.distributed, outside DeepSpeed's comms logger, read to the host
    once. A value is a number, or a one-element tensor on `device`, which is gathered without being read first."""
    numbers = torch.tensor([0.0 if isinstance(v, torch.Tensor) else float(v) for v in values], dtype=torch.float64)
    numbers = host_to_device(numbers, device)  # torch.tensor(..., device="cuda") would wait for the stream
    for i, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            numbers[i] = value.detach().reshape(())  # a copy on the device, queued
    world = dist.get_world_size()
    gathered = torch.empty(world * len(values), dtype=torch.float64, device=device)
    dist.all_gather_single(gathered, numbers)
    return host_values(gathered.view(world, len(values)))


@contextmanager
def mmap_loads():
    """torch.load maps checkpoint files instead of reading them into memory (DeepSpeed's loader calls torch.load
    without mmap); the setting is restored afterwards.

    A loaded tensor that outlives the load (DeepSpeed keeps a few, such as the optimizer's step count) would keep its
    whole file mapped: once the checkpoint is pruned, its blocks would stay allocated on disk for the rest of the run.
    So on the way out every loaded tensor still alive gets memory of its own and the mappings close."""
    import gc
    import weakref

    from torch.utils.serialization import config

    loaded: list[weakref.ref] = []
    original_load = torch.load

    def load(*args, **kwargs):
        result = original_load(*args, **kwargs)
        loaded.extend(weakref.ref(t) for t in _tensors_in(result))
        return result

    previous = config.load.mmap
    config.load.mmap = True
    torch.load = load
    try:
        yield
    finally:
        torch.load = original_load
        config.load.mmap = previous
        gc.collect()  # the loaded state dicts, dropped by the loader but caught in reference cycles
        with torch.no_grad():
            for ref in loaded:
                tensor = ref()
                if tensor is not None:
                    tensor.set_(tensor.clone())


def _tensors_in(value) -> list[torch.Tensor]:
    """The tensors in a loaded checkpoint object (dicts, lists and tuples of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    return []


def number(value) -> float | None:
    """A plain float from a DeepSpeed figure that may be a tensor, a float or None."""
    return None if value is None else float(value)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def fused_adam_prebuilt() -> bool:
    """Whether this DeepSpeed install ships a compiled FusedAdam (DS_BUILD_FUSED_ADAM=1 at install); otherwise it
    would be compiled at the first step with nvcc, which a machine without the CUDA toolkit does not have."""
    try:
        from deepspeed.git_version_info import installed_ops

        return bool(installed_ops.get("fused_adam"))
    except ImportError:
        return False


def resume_fingerprint(plan) -> dict:
    """What must not change between a checkpoint and the run that resumes it."""
    train = {k: v for k, v in plan.train.as_dict().items() if k not in RESUMABLE_KEYS}
    fingerprint = {"model": plan.model.as_dict(), "train": train, "data": plan.data_sha256}
    if plan.init_from:  # other weights at the same path or hf:// revision are another run
        fingerprint["init_from"] = plan.init_from["identity"]
    return fingerprint


def heldout_summary(records: list[dict], settings: TrainSettings, heldout) -> dict | None:
    """train.eval_every's evaluations over the whole run (resumed runs included): how many, their wall time (kept
    out of step_time_s and tokens_per_s), and the last held-out loss."""
    if heldout is None:
        return None
    evaluated = [r for r in records if "val_loss" in r]
    last = evaluated[-1] if evaluated else None
    return {"every": settings.eval_every, "samples": heldout.samples, "tokens": heldout.samples * heldout.seq_len,
            "evaluations": len(evaluated), "time_s": sum(r["eval_time_s"] for r in evaluated),
            "last": {"step": last["step"], "loss": last["val_loss"], "perplexity": last["val_perplexity"]}
            if last else None}
