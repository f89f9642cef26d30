"""The DeepSpeed training loop: one process per rank, started by torchrun through workflow_scripts/launch.py.

A run is described by a plan (plan.json, see `pretrain_bench.plan`). This module trains, measures each step,
checkpoints with a commit marker, resumes from the newest complete checkpoint, and writes metrics.jsonl,
summary.json and (for the main run) an HF export.

Fault injection for tests: PRETRAIN_BENCH_INJECT_NAN_AT_STEP=N makes the last rank report a NaN loss at step N,
exercising the abort path (no checkpoint after it, the last good one kept) without having to diverge a model.
PRETRAIN_BENCH_INJECT_ENOSPC_AT_STEP=N makes the last rank's checkpoint files of step N fail with ENOSPC after a few
KiB, as a full disk would, where a test cannot mount a small file system.
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import sys
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from . import checkpoint as ckpt
from . import state_lock
from .flops import FLOPS_FORMULA, flops_per_token, model_flops_utilisation
from .metrics import peak_memory_bytes, read_jsonl, summarise_steps, truncate_jsonl
from .heldout import HeldOutSlice
from .model import build_model, count_parameters, load_pretrained
from .plan import plan_shape
from .provenance import provenance
from .run_state import mark_finished, plan_digest, prepare_state
from .settings import TrainSettings, check_settings, deepspeed_config, learning_rate
from .step import PhaseTimer, train_step


class TrainingAborted(RuntimeError):
    """Training stopped on purpose (non-finite loss, pre-emption); the last complete checkpoint is kept."""


class _Preemption:
    """Turns SIGTERM into a flag checked at step boundaries, so the step in flight finishes and is saved."""

    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True


def _log(rank: int, message: str) -> None:
    if rank == 0:
        print(message, file=sys.stderr, flush=True)


def _comm_ms() -> float:
    """Total milliseconds spent in deepspeed.comm collectives on this rank so far (DeepSpeed's comms logger).

    The logger times each op with a synchronised wall-clock timer that is never reset, and appends the timer's
    running total (not the op's own duration) to its list, so the largest value per op name is the cumulative
    time of that op.
    """
    from deepspeed.comm import comm as ds_comm

    logger = getattr(ds_comm, "comms_logger", None)
    total = 0.0
    for by_size in getattr(logger, "comms_dict", {}).values():
        total += max((max(record[1]) for record in by_size.values() if record[1]), default=0.0)
    return total


def _gather_floats(values: list[float], device: str) -> list[list[float]]:
    """All ranks' values (rank order) through torch.distributed, outside DeepSpeed's comms logger."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    return [p.tolist() for p in parts]


@contextmanager
def _mmap_loads():
    """torch.load maps checkpoint files instead of reading them into memory (DeepSpeed's loader calls torch.load
    without mmap); the setting is restored afterwards."""
    from torch.utils.serialization import config

    previous = config.load.mmap
    config.load.mmap = True
    try:
        yield
    finally:
        config.load.mmap = previous


def _number(value) -> float | None:
    """A plain float from a DeepSpeed figure that may be a tensor, a float or None."""
    return None if value is None else float(value)


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fused_adam_prebuilt() -> bool:
    """Whether this DeepSpeed install ships a compiled FusedAdam (DS_BUILD_FUSED_ADAM=1 at install); otherwise it
    would be compiled at the first step with nvcc, which a machine without the CUDA toolkit does not have."""
    try:
        from deepspeed.git_version_info import installed_ops

        return bool(installed_ops.get("fused_adam"))
    except ImportError:
        return False


def resume_fingerprint(plan: dict) -> dict:
    """What must not change between a checkpoint and the run that resumes it."""
    keep_out = {"max_steps", "max_tokens", "checkpoint_every", "keep_checkpoints", "max_restarts",
                "warmup_timing_steps", "allow_reshape", "gpus", "nodes", "global_batch_size", "rdzv_endpoint",
                "memory_fit", "nvme_path", "collective_timeout_min", "nccl_env", "verify_checkpoints", "phase_timing",
                "eval_every", "eval_tokens", "deepspeed"}
    train = {k: v for k, v in plan["train"].items() if k not in keep_out}
    fingerprint = {"model": plan["model"], "train": train, "data": plan["data_sha256"]}
    if plan.get("init_from"):  # other weights at the same path or hf:// revision are another run
        fingerprint["init_from"] = plan["init_from"]["identity"]
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


def run_training(plan: dict) -> dict | None:
    """Train per the plan on this rank. Returns the summary on rank 0."""
    import deepspeed

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    settings = TrainSettings.from_config(plan["train"])
    device = plan["device"]
    check_settings(settings, device)
    if world != settings.world_size:
        raise RuntimeError(f"launched with {world} ranks but train.gpus × train.nodes = {settings.world_size}")
    threads = int(os.environ.get("PRETRAIN_BENCH_THREADS_PER_RANK", torch.get_num_threads()))
    torch.set_num_threads(threads)
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    # An explicit collective timeout: rank-0 work (a universal-checkpoint conversion, a large save) must not hit
    # the 10-minute default while the other ranks wait in a barrier.
    deepspeed.init_distributed(dist_backend=plan["train"]["comm_backend"],
                               timeout=timedelta(minutes=settings.collective_timeout_min))
    preemption = _Preemption()

    out_dir, state_dir = Path(plan["paths"]["out_dir"]), Path(plan["paths"]["state_dir"])
    ckpt_root = state_dir / "checkpoints"
    metrics_path = state_dir / "metrics.jsonl"
    run_device = f"cuda:{local_rank}" if device == "cuda" else "cpu"
    lock, refusal = None, ""
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        state_dir.mkdir(parents=True, exist_ok=True)
        if os.environ.get(state_lock.HELD_ENV) != "1":  # started without the launcher, which takes it otherwise
            try:
                lock = state_lock.acquire(state_dir)
            except state_lock.StateInUse as error:
                refusal = str(error)
    if _gather_floats([float(bool(refusal))], run_device)[0][0]:
        raise ckpt.CheckpointError(refusal or f"rank 0 was refused {state_dir}: another training run holds it")
    seq_len = plan["model"]["seq_len"]
    digest = plan_digest(plan)
    if rank == 0:
        # Safe under the state lock: no other run can be saving there.
        for folder in ckpt.remove_incomplete(ckpt_root):
            _log(rank, f"removed {folder}: an incomplete checkpoint left by an interrupted or failed save")
        if not plan["resume"]:
            shutil.rmtree(ckpt_root, ignore_errors=True)
            metrics_path.unlink(missing_ok=True)
        else:  # which run this job continues, starts fresh, or trains again (see run_state)
            for message in prepare_state(state_dir, resume_fingerprint(plan), settings.total_steps(seq_len), digest,
                                         settings.checkpoint_steps(seq_len)):
                _log(rank, message)
    dist.barrier()

    # 1) data, model, engine
    from .loader import PackedTokens, RankBatches

    index = json.loads(Path(plan["paths"]["index"]).read_text())
    data = PackedTokens(Path(plan["paths"]["index"]), "train", seq_len)
    batches = RankBatches(data, rank=rank, world_size=world, micro_batch_size=settings.micro_batch_size,
                          seed=settings.seed)
    shape = plan_shape(plan, index["vocab_size"])
    params = count_parameters(shape)
    init_from = plan.get("init_from")
    _log(rank, f"model {init_from['uri'] if init_from else plan['model']['preset']}: {params['total']:,} parameters "
               f"({params['non_embedding']:,} non-embedding), world size {world}, device {device}")
    if plan.get("memory_fit"):
        from .memory_fit import summary_line

        _log(rank, summary_line(plan["memory_fit"]))
    model = build_model(shape, seq_len, settings.seed, settings.precision, run_device)
    loaded = None
    if init_from:
        # Every rank loads the whole model before DeepSpeed partitions it, so this holds under every ZeRO stage;
        # a resumed run then overwrites these weights with its checkpoint's.
        loaded = load_pretrained(model, Path(init_from["path"]))
        _log(rank, f"weights from model.init_from {init_from['uri']} ({init_from['path']}): "
                   f"{loaded['bytes'] / 2**20:,.1f} MiB in {len(loaded['files'])} file(s)"
                   + (f", {loaded['added_vocab_rows']} embedding row(s) added" if loaded["added_vocab_rows"] else ""))
    if settings.activation_checkpointing:
        model.gradient_checkpointing_enable()
    total_steps = settings.total_steps(seq_len)
    ds_config = deepspeed_config(settings, device, total_steps, fused_adam=_fused_adam_prebuilt(),
                                 pin_memory=os.environ.get("PRETRAIN_BENCH_PIN_MEMORY", "1") == "1",
                                 comms_logger=plan["measure_comm"])
    if rank == 0:
        (out_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2))
    # 2) what to resume from: verified and checked before DeepSpeed starts, so a wrong checkpoint fails in seconds.
    # Rank 0 alone verifies (and may set damaged checkpoints aside); every rank then resumes from the step it chose.
    fingerprint = resume_fingerprint(plan)
    start_step, resumed_from, reshape = 0, None, False
    step, problem = None, ""
    if rank == 0 and plan.get("resume", True):
        try:
            step = ckpt.newest_verified(ckpt_root, settings.verify_checkpoints, warn=lambda m: _log(rank, m))
        except ckpt.CheckpointError as error:
            problem = str(error)
    chosen = _gather_floats([-2.0 if problem else -1.0 if step is None else float(step)], run_device)[0][0]
    if chosen == -2.0:
        raise ckpt.CheckpointError(problem or f"rank 0 found no checkpoint in {ckpt_root} that verifies")
    resuming = chosen >= 0
    if resuming:
        step = int(chosen)
        marker = ckpt.read_marker(ckpt_root, step)
        check_resume_point(step, settings, seq_len, ckpt_root)
        if marker["world_size"] != world and not settings.allow_reshape:
            raise ckpt.CheckpointError(
                f"checkpoint {ckpt_root / ckpt.tag_for(step)} was saved with world size {marker['world_size']}, "
                f"this run has {world}: run with the old train.gpus/nodes, set train.allow_reshape to convert it "
                f"through a universal checkpoint, or move {ckpt_root} away to start over"
            )
        if marker["fingerprint"] != fingerprint:
            changed = sorted(k for k in fingerprint if fingerprint[k] != marker["fingerprint"].get(k))
            raise ckpt.CheckpointError(
                f"checkpoint {ckpt_root / ckpt.tag_for(step)} belongs to a different configuration "
                f"({', '.join(changed)} changed): restore the config or move {ckpt_root} away to start over"
            )
        reshape = marker["world_size"] != world
        if reshape:
            ds_config["checkpoint"] = {"load_universal": True}
            if rank == 0:
                (out_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2))
    def schedule(optimizer):
        # A plain function (not a callable object): LambdaLR then saves no state of it in checkpoints, so a resumed
        # run with more train.max_steps follows its own schedule, not the saved one's.
        def factor(step: int) -> float:
            return learning_rate(step, settings, total_steps) / settings.lr

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config,
                                           lr_scheduler=schedule)

    if resuming:
        tag = ckpt.tag_for(step)
        if reshape:
            tag = ckpt.universal_tag(ckpt_root, step, rank)  # rank 0 converts once, the others wait
        try:
            with _mmap_loads():  # optimizer shards are mapped, not copied, beside the states already allocated
                loaded, _ = engine.load_checkpoint(str(ckpt_root), tag=tag)
            if loaded is None:  # DeepSpeed only warns when it finds nothing to load
                raise FileNotFoundError(f"DeepSpeed found no checkpoint files of rank {rank} in {ckpt_root / tag}")
            if not reshape:
                _set_rng_state(torch.load(ckpt_root / tag / f"rng_rank{rank}.pt", weights_only=False))
        except (OSError, RuntimeError, ValueError, KeyError, EOFError) as error:
            raise ckpt.CheckpointError(
                f"loading checkpoint {ckpt_root / tag} failed on rank {rank}: {type(error).__name__}: {error}. Its "
                f"files passed the {settings.verify_checkpoints} check; set train.verify_checkpoints: full to find a "
                "damaged file, or move the folder aside to resume from the checkpoint before it") from error
        # The loader position is global (samples consumed), so it carries over to another world size.
        batches.load_state_dict(marker["loader"], **({"allow_reshape": True} if reshape else {}))
        start_step, resumed_from = step, step
        if rank == 0:
            truncate_jsonl(metrics_path, step)
        _log(rank, f"resumed from {ckpt_root / tag} (step {step}"
                   + (f", saved at world size {marker['world_size']}, now {world})" if reshape else ")"))

    inject_enospc_step = int(os.environ.get("PRETRAIN_BENCH_INJECT_ENOSPC_AT_STEP", "0"))

    def save(step: int) -> None:
        """Save checkpoint `step` on every rank and commit it; on failure remove it and raise CheckpointSaveError."""
        tag = ckpt.tag_for(step)
        folder = ckpt_root / tag
        client = {"step": step, "loader": batches.state_dict(), "world_size": world,
                  "fingerprint": fingerprint}
        writer = ckpt.CheckpointWriter(
            step, folder, zipfile=getattr(engine.checkpoint_engine, "zipfile_serialization", True),
            fail_after=4096 if step == inject_enospc_step and rank == world - 1 else None)  # see module docstring
        engine.checkpoint_engine.save = writer.save  # every file DeepSpeed saves is hashed while it is written
        try:
            engine.save_checkpoint(str(ckpt_root), tag=tag, client_state=client)
        except (OSError, RuntimeError) as error:
            # A failure outside the files the writer sees (DeepSpeed's own small files): the other ranks may be in a
            # collective this rank will never join, so it removes the folder and stops; torchrun stops the others.
            shutil.rmtree(folder, ignore_errors=True)
            raise ckpt.CheckpointSaveError(ckpt.save_failure(step, folder, error)) from error
        finally:
            del engine.checkpoint_engine.save  # back to the engine's own method
        writer.save(_rng_state(), folder / f"rng_rank{rank}.pt")
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
                f"the newest is step {last_saved if last_saved else 'none'} in {ckpt_root}")
        if rank == 0:
            files = {name: record for _, saved in outcomes for name, record in saved.items()}
            try:
                ckpt.write_marker(ckpt_root, step, {"world_size": world, "fingerprint": fingerprint,
                                                    "loader": batches.state_dict(),
                                                    "tokens": step * settings.derived_global_batch * seq_len},
                                  files)
            except OSError as error:
                shutil.rmtree(folder, ignore_errors=True)
                raise ckpt.CheckpointSaveError(ckpt.save_failure(step, folder, error)) from error
            ckpt.prune(ckpt_root, settings.keep_checkpoints)
        dist.barrier()

    # 3) peak FLOP/s for MFU: the machine's one figure, resolved by the plan (flops.plan_peak); never measured here
    peak = plan.get("peak") or {"flops_per_rank": None, "source": "no peak in the plan"}
    peak_flops, peak_source = peak["flops_per_rank"], peak["source"]
    flops_token = flops_per_token(params["matmul"], shape.num_hidden_layers, shape.num_attention_heads,
                                  shape.hidden_size // shape.num_attention_heads, seq_len)

    # 4) the loop
    tokens_per_step = settings.derived_global_batch * seq_len
    vocab = shape.vocab_size
    save_every = settings.checkpoint_every if plan.get("save_checkpoints", True) else None
    heldout = HeldOutSlice(Path(plan["paths"]["index"]), seq_len, rank, world, settings.eval_tokens) \
        if settings.eval_every else None
    metrics_file = open(metrics_path, "a") if rank == 0 else None
    board = None
    if rank == 0:
        from tensorboardX import SummaryWriter

        # purge_step drops events past a resumed checkpoint, like truncate_jsonl does for metrics.jsonl
        board = SummaryWriter(str(state_dir / "tensorboard"), purge_step=start_step + 1)
    run_start = time.perf_counter()
    # Phase times from CUDA events (no synchronisation in the loop); the comms logger synchronises every collective,
    # so a CUDA run measures communication only where the plan asks (benchmark cells), a CPU run always (no cost).
    timer = PhaseTimer(device, enabled=settings.phase_timing)
    measure_comm = plan["measure_comm"]
    comm_steady_ms, steady_time_s = 0.0, 0.0
    last_saved = start_step
    inject_nan_step = int(os.environ.get("PRETRAIN_BENCH_INJECT_NAN_AT_STEP", "0"))
    for step in range(start_step + 1, total_steps + 1):
        skipped_before = engine.skipped_steps
        comm_before = _comm_ms() if measure_comm else 0.0
        local_loss, step_time, phases = train_step(engine, batches, micro_steps=settings.grad_accum_steps,
                                                   vocab=vocab, run_device=run_device, timer=timer)
        comm_ms = max(0.0, _comm_ms() - comm_before) if measure_comm else None

        # Everything below is bookkeeping outside the timed step.
        if step == inject_nan_step and rank == world - 1:
            local_loss = float("nan")  # fault injection, see module docstring
        peak, _ = peak_memory_bytes(device)
        gathered = _gather_floats([local_loss, float(peak), float(preemption.requested)], run_device)
        rank_losses = [g[0] for g in gathered]
        if not all(math.isfinite(v) for v in rank_losses):
            bad = [r for r, v in enumerate(rank_losses) if not math.isfinite(v)]
            raise TrainingAborted(
                f"non-finite loss at step {step} on rank(s) {bad}; no checkpoint written after it, the last "
                f"complete one is step {last_saved if last_saved else 'none'} in {ckpt_root}"
            )
        steady = step > settings.warmup_timing_steps and step != start_step + 1
        if steady:
            comm_steady_ms += comm_ms or 0.0
            steady_time_s += step_time
        record = {
            "step": step, "loss": sum(rank_losses) / world, "lr": _number(engine.get_lr()[0]),
            "grad_norm": _number(engine.get_global_grad_norm()), "step_time_s": step_time,
            "forward_s": phases["forward"], "backward_s": phases["backward"], "optimizer_s": phases["optimizer"],
            "tokens_per_s": tokens_per_step / step_time, "tokens": step * tokens_per_step,
            "comm_s": comm_ms / 1000.0 if comm_ms is not None else None, "peak_mem_bytes": [int(g[1]) for g in gathered],
            "skipped_steps": engine.skipped_steps, "overflow": engine.skipped_steps > skipped_before,
            "loss_scale": _number(getattr(engine.optimizer, "cur_scale", None)) if settings.precision == "fp16" else None,
            "after_resume": resumed_from is not None and step == start_step + 1,
        }
        if heldout and (step % settings.eval_every == 0 or step == total_steps):
            # after the step's timing and before its checkpoint; its wall time is recorded apart (eval_time_s)
            t_eval = time.perf_counter()  # the step's work is done: its loss was read
            nll_sum, token_count = heldout.evaluate(engine, settings.micro_batch_size, run_device, vocab)
            totals = [sum(values) for values in zip(*_gather_floats([nll_sum, token_count], run_device))]
            record["val_loss"] = totals[0] / totals[1]
            record["val_perplexity"] = math.exp(min(record["val_loss"], 50.0))
            record["eval_time_s"] = time.perf_counter() - t_eval  # the gather above waited for the device
        if rank == 0:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "comm_s"):
                if record[key] is not None:
                    board.add_scalar(f"train/{key}", record[key], step)
            board.add_scalar("train/peak_mem_gib_max", max(record["peak_mem_bytes"]) / 2**30, step)
            if "val_loss" in record:
                board.add_scalar("val/loss", record["val_loss"], step)
                board.add_scalar("val/perplexity", record["val_perplexity"], step)
                board.add_scalar("val/eval_time_s", record["eval_time_s"], step)
            if step == 1 or step % max(1, total_steps // 20) == 0 or step == total_steps:
                elapsed = time.perf_counter() - run_start
                eta = elapsed / (step - start_step) * (total_steps - step)
                _log(rank, f"step {step}/{total_steps} loss {record['loss']:.4f} lr {record['lr']:.2e} "
                           f"{record['tokens_per_s']:,.0f} tokens/s step {step_time:.3f}s ETA {eta:,.0f}s")
            if "val_loss" in record:
                _log(rank, f"step {step}/{total_steps} held-out loss {record['val_loss']:.4f} perplexity "
                           f"{record['val_perplexity']:,.2f} ({heldout.samples} val samples, "
                           f"{record['eval_time_s']:.2f}s)")
        if save_every and (step % save_every == 0 or step == total_steps):
            save(step)
            last_saved = step
        if any(g[2] for g in gathered):
            if save_every and last_saved != step:
                save(step)
                last_saved = step
            raise TrainingAborted(f"SIGTERM received: checkpoint step {last_saved} saved in {ckpt_root}; "
                                  "exiting non-zero so the job is retried")
    if metrics_file:
        metrics_file.close()
        board.close()

    # 5) summary (rank 0)
    summary = None
    if rank == 0:
        records = read_jsonl(metrics_path)
        steady = summarise_steps(records, settings.warmup_timing_steps, tokens_per_step)
        tokens_per_s = steady["tokens_per_s"]
        if world == 1:
            comm_fraction, comm_note = None, "world size 1: no collectives"
        elif not measure_comm:
            comm_fraction, comm_note = None, ("not measured in this run: DeepSpeed's comms logger synchronises every "
                                              "collective, which a production CUDA run must not pay; the benchmark "
                                              "cells measure it")
        elif steady_time_s > 0:
            comm_fraction = (comm_steady_ms / 1000.0) / steady_time_s
            comm_note = ("DeepSpeed comms_logger (prof_all) on rank 0: wall-clock of every deepspeed.comm collective "
                         "(synchronised), summed over steady-state steps ÷ their step time; includes time spent "
                         "waiting for slower ranks")
        else:
            comm_fraction, comm_note = None, "no steady-state steps in this process (resumed at the end)"
        peak_kind = peak_memory_bytes(device)[1]
        summary = {
            "name": plan["name"], "role": plan.get("role", "pretrain"),
            "world_size": world, "nodes": settings.nodes, "device": device, "zero_stage": settings.zero_stage,
            "precision": settings.precision, "comm_backend": settings.comm_backend,
            "micro_batch_size": settings.micro_batch_size, "grad_accum_steps": settings.grad_accum_steps,
            "global_batch_size": settings.derived_global_batch, "seq_len": seq_len,
            "steps": total_steps, "tokens_per_step": tokens_per_step, "tokens": total_steps * tokens_per_step,
            "tokens_per_s": tokens_per_s, "step_time_s": steady["step_time_s"],
            "phase_time_s": steady["phase_time_s"], "steady_steps": steady["steady_steps"],
            "warmup_timing_steps": settings.warmup_timing_steps,
            "peak_mem_bytes": [max(r["peak_mem_bytes"][i] for r in records) for i in range(world)],
            "peak_mem_kind": peak_kind,
            "model": {"preset": plan["model"]["preset"], "parameters": params["total"],
                      "non_embedding_parameters": params["non_embedding"],
                      "matmul_parameters": params["matmul"], "layers": shape.num_hidden_layers,
                      "hidden_size": shape.hidden_size, "heads": shape.num_attention_heads,
                      "vocab_size": shape.vocab_size},
            "flops_per_token": flops_token, "flops_formula": FLOPS_FORMULA,
            "peak_flops_per_rank": peak_flops, "peak_flops_source": peak_source,
            **dict(zip(("mfu", "mfu_note"), model_flops_utilisation(tokens_per_s, flops_token, peak_flops, world,
                                                                    peak_source))),
            "comm_fraction": comm_fraction, "comm_method": comm_note,
            "loss": steady["loss"], "skipped_steps": records[-1]["skipped_steps"],
            "oversubscribed": os.environ.get("PRETRAIN_BENCH_OVERSUBSCRIBED") == "1",
            "threads_per_rank": threads, "resumed_from_step": resumed_from,
            # what the pre-flight chose under train.memory_fit (asked vs ran, and why)
            "memory_fit": {k: plan["memory_fit"][k] for k in ("mode", "asked", "chosen", "changed", "summary")}
            if plan.get("memory_fit") else None,
            "checkpoints": ckpt.committed_steps(ckpt_root), "checkpoint_dir": str(ckpt_root),
            # where the weights came from: model.init_from (uri, revision, folder) or a random initialisation
            "init_from": {**init_from, "loaded": loaded} if init_from else None,
            "init_seed": None if init_from else settings.seed,
            "lr_schedule": settings.lr_schedule,
            "eval_during_training": heldout_summary(records, settings, heldout),
            "provenance": provenance(plan["config"], plan["hardware"] | {"threads_per_rank": threads})
            | {"slurm_job_id": os.environ.get("SLURM_JOB_ID"),
               # 1-, 5- and 15-minute load averages at the end: busy-machine timings are traceable
               "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None},
        }
    dist.barrier()
    if rank == 0:
        shutil.copyfile(metrics_path, out_dir / "metrics.jsonl")
        shutil.copytree(state_dir / "tensorboard", out_dir / "tensorboard", dirs_exist_ok=True)
        tmp = out_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2))
        os.replace(tmp, out_dir / "summary.json")
        if plan["save_checkpoints"]:
            mark_finished(state_dir, total_steps, digest)
        _log(rank, f"done: {summary['tokens_per_s']:,.0f} tokens/s steady state, loss "
                   f"{summary['loss']['first']:.3f} → {summary['loss']['last']:.3f}")
    dist.barrier()
    return summary
