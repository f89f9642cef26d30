"""What one training rank needs besides the loop: the abort error, SIGTERM as a flag, rank-0 logging, collectives
outside DeepSpeed's comms logger, RNG state, the resume checks (fingerprint, resume point) and the held-out summary."""
from __future__ import annotations

import logging
import random
import signal
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from . import checkpoint as ckpt
from .settings import TrainSettings

logger = logging.getLogger(__name__)


class TrainingAborted(RuntimeError):
    """Training stopped on purpose (non-finite loss, pre-emption); the last complete checkpoint is kept."""


class Preemption:
    """Turns SIGTERM into a flag checked at step boundaries, so the step in flight finishes and is saved."""

    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True


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


def gather_floats(values: list[float], device: str) -> list[list[float]]:
    """All ranks' values (rank order) through torch.distributed, outside DeepSpeed's comms logger."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    return [p.tolist() for p in parts]


@contextmanager
def mmap_loads():
    """torch.load maps checkpoint files instead of reading them into memory (DeepSpeed's loader calls torch.load
    without mmap); the setting is restored afterwards."""
    from torch.utils.serialization import config

    previous = config.load.mmap
    config.load.mmap = True
    try:
        yield
    finally:
        config.load.mmap = previous


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
    keep_out = {"max_steps", "max_tokens", "checkpoint_every", "keep_checkpoints", "max_restarts",
                "warmup_timing_steps", "allow_reshape", "gpus", "nodes", "global_batch_size", "rdzv_endpoint",
                "memory_fit", "nvme_path", "collective_timeout_min", "nccl_env", "verify_checkpoints", "phase_timing",
                "eval_every", "eval_tokens", "deepspeed"}
    train = {k: v for k, v in plan.train.items() if k not in keep_out}
    fingerprint = {"model": plan.model, "train": train, "data": plan.data_sha256}
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


def check_resume_point(step: int, settings: TrainSettings, seq_len: int, ckpt_root: Path) -> None:
    """Refuse a checkpoint beyond this run's last step: its summary, export and evaluation would be mislabelled."""
    total_steps = settings.total_steps(seq_len)
    if step <= total_steps:
        return
    tokens_per_step = settings.derived_global_batch * seq_len
    limit = (f"train.max_steps {settings.max_steps}" if settings.max_tokens is None else
             f"train.max_tokens {settings.max_tokens:,} = {total_steps} steps of {tokens_per_step:,} tokens")
    fix = (f"train.max_steps to at least {step}" if settings.max_tokens is None else
           f"train.max_tokens to at least {step * tokens_per_step:,}")
    raise ckpt.CheckpointError(
        f"checkpoint {ckpt_root / ckpt.tag_for(step)} is at step {step}, beyond this run's last step {total_steps} "
        f"({limit}): the steps would go backwards. Set {fix} to continue that run, or move {ckpt_root} away to "
        "start a new one")
