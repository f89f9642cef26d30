"""The DeepSpeed training loop: one process per rank, started by torchrun through workflow_scripts/launch.py.

A run is described by a plan (plan.json, see `pretrain_bench.plan`). `run_training` hands it to
`pretrain_bench.trainer.Trainer`, which trains, measures each step, checkpoints with a commit marker, resumes from the
newest complete checkpoint, and writes metrics.jsonl, summary.json and (for the main run) an HF export.

Fault injection for tests: PRETRAIN_BENCH_INJECT_NAN_AT_STEP=N makes the last rank report a NaN loss at step N,
exercising the abort path (no checkpoint after it, the last good one kept) without having to diverge a model.
PRETRAIN_BENCH_INJECT_ENOSPC_AT_STEP=N makes the last rank's checkpoint files of step N fail with ENOSPC after a few
KiB, as a full disk would, where a test cannot mount a small file system.
"""
from __future__ import annotations

from .plan import Plan, RunContext
from .rank import TrainingAborted, check_resume_point, heldout_summary, resume_fingerprint
from .trainer import Trainer

__all__ = ["TrainingAborted", "Trainer", "check_resume_point", "heldout_summary", "resume_fingerprint", "run_training"]


def run_training(plan: Plan, context: RunContext) -> dict | None:
    """Train per the plan on this rank. Returns the summary on rank 0."""
    return Trainer(plan, context).run()
