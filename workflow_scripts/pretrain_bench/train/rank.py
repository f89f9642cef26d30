"""What one training rank needs besides the loop: the abort error, SIGTERM and SIGINT as a flag, rank-0 logging, reads
of device values to the host and collectives outside DeepSpeed's comms logger, and the held-out summary (the resume
fingerprint is run_state's). (What only an engine needs lives in the engines package, the RNG state of a checkpoint in
checkpointer.py.)"""
from __future__ import annotations

import logging
import signal

import torch
import torch.distributed as dist

from pretrain_bench.train.settings import TrainSettings

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


def all_gather_single(output: torch.Tensor, tensor: torch.Tensor) -> None:
    """torch.distributed.all_gather_single where this torch has it, else its older name all_gather_into_tensor (the
    same collective; torch 2.11 has only that one)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor)


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
    all_gather_single(gathered, numbers)
    return host_values(gathered.view(world, len(values)))


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
