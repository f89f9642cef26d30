"""The checkpoints of one training run, as the ranks keep them: `Checkpointer` saves when due, commits, verifies,
falls back to the newest checkpoint that verifies (setting damaged and non-finite ones aside), restores and prunes.
`load_fp32_state_dict` reads a committed checkpoint back whatever engine wrote it, for the HF export.

The files, the commit marker and their verification are `pretrain_bench.train.checkpoints.files`'s; which files an
engine writes and how it loads them are the engine's (`pretrain_bench.train.engines`). Every rank makes the same
collective calls here in the same order: the resume point's gather, and each save's gather and barrier.
"""
from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from pretrain_bench.train.checkpoints import files as ckpt
from pretrain_bench.train.engines.registry import ENGINE_CLASSES, Engine
from pretrain_bench.train.rank import gather_floats
from pretrain_bench.train.settings import TrainSettings

# Fault injection for tests: the last rank's checkpoint files of step N fail with ENOSPC after a few KiB, as a full
# disk would, where a test cannot mount a small file system.
INJECT_ENOSPC_ENV = "PRETRAIN_BENCH_INJECT_ENOSPC_AT_STEP"


@dataclass(frozen=True)
class ResumePoint:
    """The committed checkpoint a run continues from, checked against this run."""

    step: int
    marker: dict  # its COMMITTED.json
    reshape: bool  # saved at another world size (train.allow_reshape)


class Checkpointer:
    """The checkpoints under `root` of one run of `settings` on this rank.

    `fingerprint` is what must not change between a checkpoint and the run that resumes it
    (run_state.resume_fingerprint); `saves`: this run writes checkpoints (benchmark cells do not); `log`: rank 0's
    notices."""

    def __init__(self, root: Path, settings: TrainSettings, *, seq_len: int, rank: int, world: int, run_device: str,
                 fingerprint: dict, saves: bool, log: Callable[[str], None]):
        self.root, self.settings, self.seq_len = Path(root), settings, seq_len
        self.rank, self.world, self.run_device = rank, world, run_device
        self.fingerprint, self.log = fingerprint, log
        self.every = settings.checkpoint_every if saves else None  # None: this run saves no checkpoints
        self.total_steps = settings.total_steps(seq_len)
        self.inject_enospc_step = int(os.environ.get(INJECT_ENOSPC_ENV, "0"))
        self.last_saved = 0  # the newest step this run committed or resumed from (0: none)
        self.resumed_from: int | None = None

    # --- before training (rank 0, under the state lock) ------------------------------------------------------------
    def remove_incomplete(self) -> None:
        """Delete the folders of saves that never committed (safe under the state lock: no other run saves here)."""
        for folder in ckpt.remove_incomplete(self.root):
            self.log(f"removed {folder}: an incomplete checkpoint left by an interrupted or failed save")

    def clear(self) -> None:
        """Delete every checkpoint: a run that does not resume starts from nothing."""
        shutil.rmtree(self.root, ignore_errors=True)

    # --- resume ----------------------------------------------------------------------------------------------------
    def resume_point(self, resume: bool) -> ResumePoint | None:
        """The checkpoint to resume from, verified and checked before the engine starts, so a wrong checkpoint fails
        in seconds. Rank 0 alone verifies (and may set damaged checkpoints aside); every rank then uses the step it
        chose. None: start from step 0."""
        root, step, problem = self.root, None, ""
        if self.rank == 0 and resume:
            try:
                step = ckpt.newest_verified(root, self.settings.verify_checkpoints, warn=self.log)
            except ckpt.CheckpointError as error:
                problem = str(error)
        chosen = gather_floats([-2.0 if problem else -1.0 if step is None else float(step)], self.run_device)[0][0]
        if chosen == -2.0:
            raise ckpt.CheckpointError(problem or f"rank 0 found no checkpoint in {root} that verifies")
        if chosen < 0:
            return None
        step = int(chosen)
        marker = ckpt.read_marker(root, step)
        self.check(step, marker)
        return ResumePoint(step, marker, reshape=marker["world_size"] != self.world)

    def check(self, step: int, marker: dict) -> None:
        """Refuse checkpoint `step` where this run cannot continue it: beyond its last step, at another world size
        without train.allow_reshape, or of another configuration."""
        root, settings = self.root, self.settings
        check_resume_point(step, settings, self.seq_len, root)
        if marker["world_size"] != self.world and not settings.allow_reshape:
            raise ckpt.CheckpointError(
                f"checkpoint {root / ckpt.tag_for(step)} was saved with world size {marker['world_size']}, "
                f"this run has {self.world}: run with the old train.gpus/nodes, set train.allow_reshape to convert it "
                f"through a universal checkpoint, or move {root} away to start over"
            )
        if marker["fingerprint"] != self.fingerprint:
            changed = sorted(k for k in self.fingerprint if self.fingerprint[k] != marker["fingerprint"].get(k))
            raise ckpt.CheckpointError(
                f"checkpoint {root / ckpt.tag_for(step)} belongs to a different configuration "
                f"({', '.join(changed)} changed): restore the config or move {root} away to start over"
            )

    def restore(self, engine: Engine, point: ResumePoint) -> Path:
        """Load checkpoint `point` into the engine, and this rank's RNG state where the world size is the same;
        returns the folder loaded (a universal copy where the engine converts one)."""
        folder = engine.checkpoint_folder(self.root, point.step)
        try:
            engine.load(folder)
            if not point.reshape:
                set_rng_state(torch.load(folder / rng_file(self.rank), weights_only=False))
        except (OSError, RuntimeError, ValueError, KeyError, EOFError) as error:
            verify = self.settings.verify_checkpoints
            raise ckpt.CheckpointError(
                f"loading checkpoint {folder} failed on rank {self.rank}: {type(error).__name__}: {error}. Its "
                f"files passed the {verify} check"
                + ("" if verify == "full" else "; set train.verify_checkpoints: full to find a damaged file")
                + ", or move the folder aside to resume from the checkpoint before it") from error
        self.resumed_from = self.last_saved = point.step
        return folder

    # --- save --------------------------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether step `step` is saved: every train.checkpoint_every steps and the last one (in a run that saves)."""
        return bool(self.every) and (step % self.every == 0 or step == self.total_steps)

    def save(self, step: int, engine: Engine, loader: dict, tokens: int) -> None:
        """Save checkpoint `step` on every rank and commit it; on failure remove it and raise CheckpointSaveError.

        The files the engine saves through the writer (every DeepSpeed and DDP file, FSDP's engine_rank<r>.pt) and
        the RNG state are hashed while written; any other file in the folder (DeepSpeed's copied recovery scripts,
        FSDP's torch.distributed.checkpoint files) is read and hashed by rank 0 when it writes the marker
        (checkpoint.write_marker). The marker lists every file with its size and sha256, and `verify` checks them
        all alike."""
        rank, world, root = self.rank, self.world, self.root
        folder = root / ckpt.tag_for(step)
        client = {"step": step, "loader": loader, "world_size": world, "fingerprint": self.fingerprint}
        writer = ckpt.CheckpointWriter(
            step, folder, fail_after=4096 if step == self.inject_enospc_step and rank == world - 1 else None)
        folder.mkdir(parents=True, exist_ok=True)
        try:
            engine.save(folder, writer, client)
        except (OSError, RuntimeError) as error:
            # A failure outside the files the writer sees (DeepSpeed's own small files): the other ranks may be in a
            # collective this rank will never join, so it removes the folder and stops; torchrun stops the others.
            shutil.rmtree(folder, ignore_errors=True)
            raise ckpt.CheckpointSaveError(ckpt.save_failure(step, folder, error)) from error
        writer.save(rng_state(), folder / rng_file(rank))
        # Every rank's files are on disk (or failed) before the ranks decide together whether to commit.
        outcomes = [None] * world
        dist.all_gather_object(outcomes, (writer.error, writer.files))
        failures = [(r, error) for r, (error, _) in enumerate(outcomes) if error]
        if failures:
            if rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
            dist.barrier()
            r, error = failures[0]
            raise ckpt.CheckpointSaveError(
                f"{error} (rank {r}). The partial {folder} was removed; the committed checkpoints are untouched, "
                f"the newest is step {self.newest_saved()} in {root}")
        if rank == 0:
            self.commit(step, folder, {name: record for _, saved in outcomes for name, record in saved.items()},
                        loader, tokens)
        dist.barrier()
        self.last_saved = step

    def commit(self, step: int, folder: Path, files: dict, loader: dict, tokens: int) -> None:
        """Rank 0: write the marker of checkpoint `step` (which makes it count), then prune the oldest."""
        try:
            ckpt.write_marker(self.root, step, {"world_size": self.world, "fingerprint": self.fingerprint,
                                                "loader": loader, "tokens": tokens}, files)
        except OSError as error:
            shutil.rmtree(folder, ignore_errors=True)
            raise ckpt.CheckpointSaveError(ckpt.save_failure(step, folder, error)) from error
        ckpt.prune(self.root, self.settings.keep_checkpoints)

    def newest_saved(self) -> int | str:
        return self.last_saved if self.last_saved else "none"

    def committed(self) -> list[int]:
        return ckpt.committed_steps(self.root)

    # --- a non-finite loss -----------------------------------------------------------------------------------------
    def non_finite(self, what: str) -> str:
        """The message of a run stopped by a non-finite loss (`what`); right after a resume, with nothing saved since,
        the checkpoint resumed from is distrusted (see distrust_resume). Every rank returns the same message."""
        if self.resumed_from is not None and self.last_saved == self.resumed_from:
            return self.distrust_resume(what)
        return (f"{what}; no checkpoint written after it, the last complete one is step {self.newest_saved()} in "
                f"{self.root}")

    def distrust_resume(self, what: str) -> str:
        """A non-finite loss after a resume and before the next save: the checkpoint resumed from is the suspect
        (damaged in a way its sha256 cannot show, say in memory before it was saved, or not fully checked under
        train.verify_checkpoints: sampled). Rank 0 sets it aside as step<N>.nonfinite, so the next attempt resumes
        from the committed checkpoint before it; once only: when this resume is itself such a fallback, the cause
        is not the checkpoints and nothing is moved. Every rank returns the same message."""
        step, root = self.resumed_from, self.root
        folder = root / ckpt.tag_for(step)
        earlier = [s for s in ckpt.committed_steps(root) if s < step]
        fell_back_from = [s for s in ckpt.set_aside_steps(root, "nonfinite") if s > step]
        aside = ckpt.aside_path(root, step, "nonfinite")
        dist.barrier()  # every rank has read the folder before rank 0 changes it
        head = f"{what}, right after resuming from checkpoint {folder}"
        if fell_back_from:
            message = (f"{head}, which this run fell back to after a non-finite loss right after resuming from step "
                       f"{fell_back_from[-1]} (set aside in {root}): the loss diverges from an older checkpoint "
                       "too, so the checkpoints are not the likely cause and nothing was moved. Look at the training "
                       f"(train.lr, train.warmup_steps, train.grad_clip), or move {root} away to start over")
        elif not earlier:
            message = (f"{head}: its weights are the likely cause, and there is no committed checkpoint before it "
                       f"to fall back to, so nothing was moved. Move {folder} away to start over from step 0")
        else:
            if self.rank == 0:
                ckpt.set_aside(root, step, "nonfinite")
            message = (f"{head}: its weights are the likely cause. Moved it aside to {aside} (kept for "
                       f"inspection); rerun to resume from checkpoint step {earlier[-1]}, the one before it. This "
                       "fallback happens once: a non-finite loss right after that resume stops the run")
        dist.barrier()  # the folder is aside before any rank exits
        return message


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


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


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


def load_fp32_state_dict(root: Path, step: int, *, lazy: bool = False) -> dict:
    """The full fp32 model state dict of a committed checkpoint, on CPU, for any ZeRO stage and any engine: read by
    the engine whose layout the folder holds (Engine.holds_checkpoint, Engine.read_model_state).

    lazy: the tensors as stored, nothing converted: files mapped rather than read, a ZeRO-3 parameter a DeepSpeed
    GatheredTensor that `.contiguous()` gathers from the ranks' partitions. For a reader that converts one tensor at a
    time (export.cast_state_dict) instead of holding the whole fp32 dict."""
    ckpt.read_marker(root, step)  # raises with the path if incomplete
    folder = Path(root) / ckpt.tag_for(step)
    for engine in ENGINE_CLASSES.values():
        if engine.holds_checkpoint(folder):
            state = engine.read_model_state(folder, lazy=lazy)
            return state if lazy else {k: v.float() for k, v in state.items()}
    raise ckpt.CheckpointError(f"checkpoint {folder} holds no engine's files (no mp_rank_00_model_states.pt, "
                               "model.pt or dcp/.metadata)")
