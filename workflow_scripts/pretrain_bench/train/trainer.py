"""The training loop of one rank, started by torchrun through workflow_scripts/launch.py (pretrain.py): a run is
described by a plan (plan.json, see `pretrain_bench.train.plan`); `run_training` hands it to `Trainer`, as named steps:
setup() → build_model() → resume_point() → build_engine() → restore() → for each step: train_step() → record() →
maybe save() … → summarise() → finish(). The engine (`pretrain_bench.train.engines`) trains; the `Checkpointer` saves
with a commit marker and resumes from the newest checkpoint that verifies; the trainer writes metrics.jsonl and
summary.json.

Every rank makes the same collective calls in the same order (gloo deadlocks otherwise): the refusal,
state-preparation and resume-point gathers, DeepSpeed's initialisation and load, each step's loss gather (and held-out
gather), each save's gather and barrier, and the two closing barriers.

Fault injection for tests: PRETRAIN_BENCH_INJECT_NAN_AT_STEP=N makes the last rank report a NaN loss at step N,
exercising the abort path (no checkpoint after it, the last good one kept) without having to diverge a model;
PRETRAIN_BENCH_INJECT_ENOSPC_AT_STEP=N (see `pretrain_bench.train.checkpoints.checkpointer`) fails the last rank's
checkpoint files of step N with ENOSPC.
"""
from __future__ import annotations

import functools
import json
import math
import os
import shutil
import time
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from pretrain_bench.core.devices import denormals_flushed, emulated_bf16_note, flush_denormals
from pretrain_bench.core.io import atomic_write_json, read_jsonl
from pretrain_bench.core.logs import log_startup
from pretrain_bench.core.provenance import provenance
from pretrain_bench.train import state_lock
from pretrain_bench.train.checkpoints import files as ckpt
from pretrain_bench.train.checkpoints.checkpointer import Checkpointer, ResumePoint
from pretrain_bench.train.checkpoints.run_state import (
    KeptSummary,
    fingerprint_id,
    kept_summary,
    mark_finished,
    plan_digest,
    prepare_state,
    resume_fingerprint,
)
from pretrain_bench.train.compiling import CompileClock, compile_model, compile_scope
from pretrain_bench.train.engines.registry import Engine, EngineRun, engine_class
from pretrain_bench.train.heldout import HeldOutSlice
from pretrain_bench.train.metrics import (
    MetricsSink,
    OtherCpu,
    load_average,
    one_record_per_step,
    peak_allocated_bytes,
    peak_host_bytes,
    peak_memory_bytes,
    peak_memory_per_rank,
    summarise_steps,
)
from pretrain_bench.train.models.flops import model_flops_utilisation
from pretrain_bench.train.models.llama import load_pretrained
from pretrain_bench.train.models.registry import model_family
from pretrain_bench.train.plan import Plan, RunContext, plan_shape
from pretrain_bench.train.rank import (
    Preemption,
    TrainingAborted,
    allow_pinning,
    gather_floats,
    heldout_summary,
)
from pretrain_bench.train.rank import log as rank_log
from pretrain_bench.train.run_context import LaunchContext, rank_placement, usable_cpus
from pretrain_bench.train.run_summary import RunSummary, keep_training_figures
from pretrain_bench.train.settings import check_settings
from pretrain_bench.train.step import PhaseTimer, train_step
from pretrain_bench.train.trackers import OUTPUT_TRACKER_FOLDERS


class StepFigures(NamedTuple):
    """One rank's figures of a training step, as Trainer.gather_step reads them."""

    loss: float  # the mean loss over the step's micro-batches
    peak_mem_bytes: float  # metrics.peak_memory_bytes
    peak_allocated_bytes: float  # metrics.peak_allocated_bytes (CUDA), 0 on CPU
    peak_host_bytes: float  # metrics.peak_host_bytes: the rank's peak RSS, on CUDA too
    stop_requested: float  # 1.0 where a stop signal arrived (Preemption), else 0.0
    grad_norm: float | None  # the gradient norm, where the engine computed one

    @classmethod
    def of(cls, values: list[float]) -> StepFigures:
        """From the gathered values of one rank: the norm is gathered only where the engine has one."""
        return cls(*values) if len(values) == len(cls._fields) else cls(*values, None)


class Trainer:
    """One rank's run of a plan. `run()` returns the summary on rank 0 (None on the other ranks)."""

    def __init__(self, plan: Plan, context: RunContext, launch: LaunchContext):
        self.plan, self.context, self.launch = plan, context, launch
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.settings = plan.train
        self.device = context.device
        self.out_dir, self.state_dir = Path(plan.paths.out_dir), Path(plan.paths.state_dir)
        self.metrics_path = self.state_dir / "metrics.jsonl"
        self.run_device = f"cuda:{self.local_rank}" if self.device == "cuda" else "cpu"
        self.seq_len = plan.model.seq_len
        self.total_steps = self.settings.total_steps(self.seq_len)
        self.tokens_per_step = self.settings.derived_global_batch * self.seq_len
        self.fingerprint = resume_fingerprint(plan)
        self.engine_class = engine_class(self.settings.engine)
        self.checkpointer = Checkpointer(self.state_dir / "checkpoints", self.settings, seq_len=self.seq_len,
                                         rank=self.rank, world=self.world, run_device=self.run_device,
                                         fingerprint=self.fingerprint, saves=plan.save_checkpoints, log=self.log)
        self.digest = plan_digest(plan)  # what run_state records of the plan a finished run ran
        self.init_from = plan.init_from  # model.init_from's weights (None: a random initialisation from train.seed)
        # Peak FLOP/s for MFU: the machine's one figure, resolved by the plan (flops.plan_peak); never measured here
        self.peak = plan.peak or {"flops_per_rank": None, "source": "no peak in the plan"}
        # Phase times from CUDA events on a GPU (no synchronisation in the loop)
        self.timer = PhaseTimer(self.device, enabled=self.settings.phase_timing)
        self.inject_nan_step = int(os.environ.get("PRETRAIN_BENCH_INJECT_NAN_AT_STEP", "0"))  # see the docstring
        self.start_step = 0  # the step resumed from (0: a fresh start)
        self.comm_steady_ms, self.steady_time_s = 0.0, 0.0  # communication and step time over steady-state steps
        self.all_to_all_steady_ms = 0.0  # a MoE model's all-to-alls over the steady-state steps (expert parallelism)
        self.run_start = 0.0  # perf_counter() when the loop started, for the ETA
        # Set by the named steps of run(), in this order:
        self.preemption: Preemption | None = None  # setup(): SIGTERM/SIGINT as a flag
        self.lock = None  # setup(): the state lock, where this rank took it (started without the launcher)
        self.batches = None  # build_model(): this rank's RankBatches
        self.shape = None  # build_model(): the model family's shape (plan_shape)
        self.params: dict | None = None  # build_model(): count_parameters
        self.model = None  # build_model()
        self.loaded: dict | None = None  # build_model(): what load_pretrained read from model.init_from
        self.resume: ResumePoint | None = None  # resume_point(): the checkpoint to continue from
        self.engine: Engine | None = None  # build_engine()
        self.flops_token: float | None = None  # prepare_measures(): FLOPs per token for MFU
        self.heldout: HeldOutSlice | None = None  # prepare_measures(): train.eval_every's slice
        self.measure_comm = False  # prepare_measures(): whether each step's communication time is taken
        self.compile_clock: CompileClock | None = None  # build_model(), under train.compile
        self.load_before: list[float] | None = None  # run(): rank 0's load averages before the first step
        self.load_after: list[float] | None = None  # run(): rank 0's load averages after the last step
        self.other_cpu: dict | None = None  # run(): what else used rank 0's node's cores during the loop (rank 0)
        self.placement: list[dict] | None = None  # run(): every rank's cores and threads (rank 0 only)
        self.kept: KeptSummary | None = None  # summarise(): the finished run's summary, rewritten as it is

    def log(self, message: str) -> None:
        rank_log(self.rank, message)

    def run(self) -> dict | None:
        self.setup()
        self.build_model()
        self.resume_point()
        self.build_engine()
        self.restore()
        self.prepare_measures()
        self.load_before = load_average()
        other_cpu = OtherCpu(self.launch.cpus or usable_cpus()) if self.rank == 0 else None  # measuring from here
        self.run_start = time.perf_counter()
        with MetricsSink(self.metrics_path, self.state_dir, self.start_step, enabled=self.rank == 0,
                         loggers=self.settings.loggers, run=self.tracked_run()) as sink:
            # and its torchrun agent's and launcher's start-up; on a CPU, whether its arithmetic flushes denormals
            cpu_math = {"denormals_flushed": denormals_flushed()} if self.device == "cpu" else {}
            log_startup("first training step", parents=2, rank=self.rank, **cpu_math)
            for step in range(self.start_step + 1, self.total_steps + 1):
                skipped_before = self.engine.skipped_steps
                comm_before = self.engine.comm_ms() if self.measure_comm else None
                all_to_all_before = self.engine.all_to_all_ms()  # None without expert parallelism
                gathered, step_time, phases = train_step(  # ends with the step's one read: gather_step
                    self.engine, self.batches, micro_steps=self.settings.grad_accum_steps,
                    vocab=self.shape.vocab_size, run_device=self.run_device, timer=self.timer,
                    read=functools.partial(self.gather_step, step))
                comm = max(0.0, self.engine.comm_ms() - comm_before) if comm_before is not None else None
                all_to_all = (max(0.0, self.engine.all_to_all_ms() - all_to_all_before)
                              if all_to_all_before is not None else None)
                routing = self.balance_experts()
                # Everything below is bookkeeping outside the timed step.
                record = self.record(step, gathered, step_time, phases, comm, skipped_before, all_to_all)
                if routing:
                    record.update(routing)
                sink.write(record)
                self.log_progress(step, record, step_time)
                if self.checkpointer.due(step):
                    self.save(step)
                # SIGTERM/SIGINT on some rank: save the step just trained and stop. At the last step the run simply
                # finishes (its checkpoint is saved above): stopping there would leave a finished run without outputs.
                if step < self.total_steps and any(rank.stop_requested for rank in gathered):
                    self.stop(step)
        self.load_after = load_average()
        self.other_cpu = other_cpu.stop() if other_cpu else None
        self.placement = self.gather_placement()
        summary = self.summarise()
        self.finish(summary)
        return summary

    def stop(self, step: int) -> None:
        """A stop signal: save step `step` (when this run saves checkpoints) and raise TrainingAborted."""
        signal_name, checkpointer = self.preemption.received or "a stop signal", self.checkpointer
        if not checkpointer.every:
            raise TrainingAborted(f"{signal_name} received at step {step}: this run saves no checkpoints (a benchmark "
                                  "cell), so a rerun starts it again")
        if checkpointer.last_saved != step:
            self.save(step)
        raise TrainingAborted(f"{signal_name} received: checkpoint step {checkpointer.last_saved} saved in "
                              f"{checkpointer.root}; exiting non-zero so the job is retried (rerun the same command to "
                              "resume)")

    # --- before the loop -------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Device and threads, distributed init, SIGTERM handler, the state lock, and the state folder prepared."""
        settings, rank = self.settings, self.rank
        check_settings(settings, self.device)
        if self.world != settings.world_size:
            raise RuntimeError(
                f"launched with {self.world} ranks but train.gpus × train.nodes = {settings.world_size}")
        if self.device == "cpu":
            flush_denormals()  # measured at the first step (denormals_flushed in the start-up record)
        torch.set_num_threads(self.launch.threads_per_rank)
        allow_pinning(self.launch.pin_memory)
        if self.device == "cuda":
            torch.cuda.set_device(self.local_rank)
        # An explicit collective timeout: rank-0 work (a universal-checkpoint conversion, a large save) must not hit
        # the 10-minute default while the other ranks wait in a barrier.
        self.engine_class.init_distributed(settings.comm_backend, timedelta(minutes=settings.collective_timeout_min))
        self.preemption = Preemption()
        self.lock, refusal = None, ""
        if rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.state_dir.mkdir(parents=True, exist_ok=True)
            if os.environ.get(state_lock.HELD_ENV) != "1":  # started without the launcher, which takes it otherwise
                try:
                    self.lock = state_lock.acquire(self.state_dir)
                except state_lock.StateInUse as error:
                    refusal = str(error)
        if gather_floats([float(bool(refusal))], self.run_device)[0][0]:
            raise ckpt.CheckpointError(refusal or f"rank 0 was refused {self.state_dir}: another training run holds it")
        problem = ""
        if rank == 0:
            try:
                self.prepare_state()
            except (OSError, ValueError, KeyError, ckpt.CheckpointError) as error:
                problem = f"preparing {self.state_dir} failed: {type(error).__name__}: {error}"
        # Every rank reaches rank 0's decision: a failure there stops all of them with its message, rather than
        # leaving the others to die in the next collective ("Connection closed by peer").
        if gather_floats([float(bool(problem))], self.run_device)[0][0]:
            raise ckpt.CheckpointError(problem or f"rank 0 failed preparing {self.state_dir} (its error is above)")

    def prepare_state(self) -> None:
        """Rank 0, under the state lock (no other run can be saving there): remove incomplete saves, then decide
        which run this job continues, starts fresh, or trains again (see run_state)."""
        self.checkpointer.remove_incomplete()
        if not self.plan.resume:
            self.checkpointer.clear()
            self.metrics_path.unlink(missing_ok=True)
            return
        settings = self.settings
        for message in prepare_state(self.state_dir, self.fingerprint, self.total_steps, self.digest,
                                     settings.checkpoint_steps(self.seq_len), self.world, settings.allow_reshape):
            self.log(message)

    def build_model(self) -> None:
        """The batches of this rank and the model (from model.init_from's weights or a seed), built in the precision
        and with the activation checkpointing the engine asks for."""
        from pretrain_bench.data.loader import PackedTokens, RankBatches

        plan, settings = self.plan, self.settings
        index = json.loads(Path(plan.paths.index).read_text())
        data = PackedTokens(Path(plan.paths.index), "train", self.seq_len)
        self.batches = RankBatches(data, rank=self.rank, world_size=self.world,
                                   micro_batch_size=settings.micro_batch_size, seed=settings.seed)
        self.shape = plan_shape(plan, index["vocab_size"])
        self.family = model_family(self.shape)
        self.params = params = self.family.count_parameters(self.shape)
        init_from = self.init_from
        self.log(f"model {init_from['uri'] if init_from else plan.model.preset}: {params['total']:,} parameters "
                 f"({params['non_embedding']:,} non-embedding), world size {self.world}, device {self.device}")
        from pretrain_bench.train.memory.fit import summary_line

        self.log(summary_line(plan.memory_fit))
        if note := emulated_bf16_note(self.device, settings.precision):
            self.log(f"note: {note}")
        self.model = self.family.build(self.shape, self.seq_len, settings.seed,
                                       self.engine_class.build_precision(settings), self.run_device,
                                       plan.model.attn_implementation, plan.model.implementation)
        if init_from:
            # Every rank loads the whole model before DeepSpeed partitions it, so this holds under every ZeRO stage;
            # a resumed run then overwrites these weights with its checkpoint's.
            self.loaded = loaded = load_pretrained(self.model, Path(init_from["path"]))
            self.log(f"weights from model.init_from {init_from['uri']} ({init_from['path']}): "
                     f"{loaded['bytes'] / 2**20:,.1f} MiB in {len(loaded['files'])} file(s)"
                     + (f", {loaded['added_vocab_rows']} embedding row(s) added" if loaded["added_vocab_rows"] else ""))
        if settings.activation_checkpointing:
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=self.engine_class.gradient_checkpointing_kwargs)
        if settings.compile:  # in place, before the engine wraps the model: the state dict keeps its names
            self.compile_clock = compile_model(self.model, compile_scope(plan.model.implementation,
                                                                         settings.engine))

    def resume_point(self) -> None:
        """The checkpoint to resume from (Checkpointer.resume_point), chosen before the engine starts."""
        self.resume = self.checkpointer.resume_point(self.plan.resume)

    def build_engine(self) -> None:
        """The engine of train.engine (DeepSpeed, DDP or FSDP), with the learning-rate schedule of this run."""
        run = EngineRun(device=self.device, total_steps=self.total_steps, measure_comm=self.plan.measure_comm,
                        pin_memory=self.launch.pin_memory, reshape=bool(self.resume and self.resume.reshape),
                        config_dir=self.out_dir if self.rank == 0 else None)
        self.engine = self.engine_class(self.model, self.settings, run)

    def restore(self) -> None:
        """Load the chosen checkpoint into the engine (through a universal checkpoint when the world size changed)."""
        point = self.resume
        if point is None:
            return
        folder = self.checkpointer.restore(self.engine, point)
        # The loader position is global (samples consumed), so it carries over to another world size.
        self.batches.load_state_dict(point.marker["loader"], **({"allow_reshape": True} if point.reshape else {}))
        self.start_step = point.step  # MetricsSink drops the records past it
        self.log(f"resumed from {folder} (step {point.step}"
                 + (f", saved at world size {point.marker['world_size']}, now {self.world})" if point.reshape else ")"))

    def prepare_measures(self) -> None:
        """What the loop measures with: FLOPs per token for MFU, the held-out slice, whether communication is timed."""
        settings, shape = self.settings, self.shape
        self.flops_token = self.family.flops_per_token(shape, self.seq_len)
        self.heldout = HeldOutSlice(Path(self.plan.paths.index), self.seq_len, self.rank, self.world,
                                    settings.eval_tokens) if settings.eval_every else None
        # DeepSpeed's comms logger synchronises every collective, so a CUDA run measures communication only where the
        # plan asks (benchmark cells, and CPU runs: no cost there); an engine whose timing costs nothing (DDP's hook)
        # always measures it
        self.measure_comm = ((self.plan.measure_comm or self.engine.comm_timing_is_free)
                             and self.engine.comm_method is not None)

    def tracked_run(self) -> dict:
        """What W&B and MLflow name this run by: the run (and cell), train.tracker_project (else the config's name),
        an id that resumed attempts share (the state folder and fingerprint), and the plan's config."""
        plan = self.plan
        name = "-".join(filter(None, (plan.name, plan.role, plan.cell)))
        return {"name": name, "project": self.settings.tracker_project or plan.name, "config": plan.config.as_dict(),
                "id": fingerprint_id({"state": str(self.state_dir.resolve()), "run": self.fingerprint})}

    # --- each step ---------------------------------------------------------------------------------------------------
    def gather_step(self, step: int, local_loss) -> list[StepFigures]:
        """Every rank's StepFigures (loss, peak memory, stop flag, gradient norm), gathered on the device and read to
        the host at once: the step's one synchronisation, every step, since a non-finite loss must stop the run before
        the next checkpoint is saved and a stop signal must stop every rank at the same step. Aborts on a non-finite
        loss on any rank (distrusting the checkpoint resumed from when no checkpoint was saved since)."""
        if step == self.inject_nan_step and self.rank == self.world - 1:
            local_loss = float("nan")  # fault injection, see the module's docstring
        peak, _ = peak_memory_bytes(self.device)
        allocated = peak_allocated_bytes(self.device) or 0
        norm = self.engine.grad_norm()  # a device tensor, a number or None: read with the rest
        values = [local_loss, float(peak), float(allocated), float(peak_host_bytes()),
                  float(self.preemption.requested)] + (
            [norm] if norm is not None else [])
        gathered = [StepFigures.of(row) for row in gather_floats(values, self.run_device)]
        rank_losses = [rank.loss for rank in gathered]
        if not all(math.isfinite(v) for v in rank_losses):
            bad = [r for r, v in enumerate(rank_losses) if not math.isfinite(v)]
            what = f"non-finite loss at step {step} on rank(s) {bad}"
            raise TrainingAborted(self.checkpointer.non_finite(what))
        return gathered

    def balance_experts(self) -> dict | None:
        """A mixture-of-experts model, after its optimizer step: the tokens each layer routed to each expert in this
        step, summed over the ranks (one all-reduce), recorded (expert_load, and per layer max_violation: MaxVio,
        (max − mean) ÷ mean), and handed to the model's auxiliary-loss-free bias update, which every rank applies
        alike from the same sums (a no-op at bias_update_rate 0). None for a model without experts."""
        model = self.model
        if not hasattr(model, "update_router_biases"):
            return None
        import torch.distributed as dist

        from pretrain_bench.train.models.native_deepseek import max_violation

        load = model.expert_load().to(self.run_device)  # (MoE layers, experts)
        aux = model.aux_loss_mean()  # this rank's mean balance loss over the step's micro-batches, or None
        if dist.is_initialized() and self.world > 1:
            # one all-reduce for both: the counts in float64 stay exact (integers below 2**53)
            packed = torch.cat([load.double().flatten(), (aux if aux is not None else torch.zeros(
                (), dtype=torch.float64)).to(self.run_device).view(1)])
            dist.all_reduce(packed)
            load = packed[:-1].round().long().view_as(load)
            aux = packed[-1] / self.world if aux is not None else None
        model.update_router_biases(load)
        model.reset_expert_load()
        load = load.cpu()
        record = {"expert_load": load.tolist(), "max_violation": max_violation(load).tolist()}
        if aux is not None:
            record["aux_loss"] = float(aux)  # mean over the ranks and micro-batches, α included
        norms = model.router_bias_norms()  # after this step's update: alike on every rank
        if norms is not None:
            record["router_bias_norm"] = norms
        return record

    def record(self, step: int, gathered: list[StepFigures], step_time: float, phases: dict, comm: float | None,
               skipped_before: int, all_to_all: float | None = None) -> dict:
        """The step's metrics.jsonl record, with the held-out evaluation when train.eval_every asks for one;
        `comm` and `all_to_all`: milliseconds in flight of the step's gradient collectives and of its MoE
        all-to-alls (None: not measured)."""
        settings, engine, tokens_per_step = self.settings, self.engine, self.tokens_per_step
        overflow = engine.skipped_steps > skipped_before  # fp16 loss-scale overflow: no update, out of the timing
        if step > settings.warmup_timing_steps and step != self.start_step + 1 and not overflow:  # steady state
            self.comm_steady_ms += comm or 0.0
            self.all_to_all_steady_ms += all_to_all or 0.0
            self.steady_time_s += step_time
        record = {
            "step": step, "loss": sum(rank.loss for rank in gathered) / self.world, "lr": engine.lr(),
            "grad_norm": gathered[0].grad_norm, "step_time_s": step_time,
            "forward_s": phases["forward"], "backward_s": phases["backward"], "optimizer_s": phases["optimizer"],
            "tokens_per_s": tokens_per_step / step_time, "tokens": step * tokens_per_step,
            "comm_s": comm / 1000.0 if comm is not None else None,
            **({"all_to_all_s": all_to_all / 1000.0} if all_to_all is not None else {}),
            "peak_mem_bytes": [int(rank.peak_mem_bytes) for rank in gathered],
            "peak_mem_allocated_bytes": [int(rank.peak_allocated_bytes) for rank in gathered]
            if self.device == "cuda" else None,
            # each rank's peak RSS (on CPU the same figure as peak_mem_bytes): the host RAM offloads take on CUDA
            "peak_host_bytes": [int(rank.peak_host_bytes) for rank in gathered],
            "skipped_steps": engine.skipped_steps, "overflow": overflow,
            "loss_scale": engine.loss_scale(),
            "after_resume": self.checkpointer.resumed_from is not None and step == self.start_step + 1,
            # the step's MFU against the plan's peak (None without one), for the trackers
            "mfu": model_flops_utilisation(tokens_per_step / step_time, self.flops_token, self.peak["flops_per_rank"],
                                           self.world, self.peak["source"])[0],
        }
        if self.heldout and (step % settings.eval_every == 0 or step == self.total_steps):
            # after the step's timing and before its checkpoint; its wall time is recorded apart (eval_time_s)
            t_eval = time.perf_counter()  # the step's work is done: its loss was read
            nll_sum, token_count = self.heldout.evaluate(engine, settings.micro_batch_size, self.run_device,
                                                         self.shape.vocab_size)
            totals = [sum(values) for values in zip(*gather_floats([nll_sum, token_count], self.run_device))]
            record["val_loss"] = totals[0] / totals[1]
            record["val_perplexity"] = math.exp(min(record["val_loss"], 50.0))
            record["eval_time_s"] = time.perf_counter() - t_eval  # the gather above waited for the device
        return record

    def log_progress(self, step: int, record: dict, step_time: float) -> None:
        total_steps = self.total_steps
        if self.rank != 0:
            return
        if step == 1 or step % max(1, total_steps // 20) == 0 or step == total_steps:
            elapsed = time.perf_counter() - self.run_start
            eta = elapsed / (step - self.start_step) * (total_steps - step)
            self.log(f"step {step}/{total_steps} loss {record['loss']:.4f} lr {record['lr']:.2e} "
                     f"{record['tokens_per_s']:,.0f} tokens/s step {step_time:.3f}s ETA {eta:,.0f}s")
        if "val_loss" in record:
            self.log(f"step {step}/{total_steps} held-out loss {record['val_loss']:.4f} perplexity "
                     f"{record['val_perplexity']:,.2f} ({self.heldout.samples} val samples, "
                     f"{record['eval_time_s']:.2f}s)")

    def save(self, step: int) -> None:
        """Checkpoint step `step` (Checkpointer.save: every rank saves, rank 0 commits)."""
        self.checkpointer.save(step, self.engine, self.batches.state_dict(), step * self.tokens_per_step)

    # --- after the loop ----------------------------------------------------------------------------------------------
    def gather_placement(self) -> list[dict] | None:
        """Every rank's host, cores (its affinity) and torch threads as it ran, on rank 0 (None elsewhere)."""
        placement = rank_placement(self.rank, torch.get_num_threads())
        gathered = [None] * self.world if self.rank == 0 else None
        dist.gather_object(placement, gathered, dst=0)
        return gathered

    def comm_fraction(self) -> tuple[float | None, str]:
        """Communication time ÷ step time over the steady-state steps, and how it was measured (or why not)."""
        if self.world == 1:
            return None, "world size 1: no collectives"
        if self.engine.comm_method is None:
            return None, (f"not measured: train.engine {self.settings.engine} issues its collectives inside autograd "
                          "with no timing hook (torch.profiler shows them)")
        if not self.measure_comm:
            return None, ("not measured in this run: DeepSpeed's comms logger synchronises every collective, which a "
                          "production CUDA run must not pay; the benchmark cells measure it")
        if self.steady_time_s > 0:
            return (self.comm_steady_ms / 1000.0) / self.steady_time_s, self.engine.comm_method
        return None, "no steady-state steps in this process (resumed at the end)"

    def all_to_all_fraction(self) -> float | None:
        """The MoE layers' all-to-all time ÷ step time over the steady-state steps, timed as DDP's all-reduces are
        (the engine's all_to_all_ms); None where no experts are split over ranks."""
        if self.engine.all_to_all_ms() is None or self.steady_time_s <= 0:
            return None
        return (self.all_to_all_steady_ms / 1000.0) / self.steady_time_s

    def summarise(self) -> dict | None:
        """summary.json's contents (rank 0; None elsewhere). A job that resumed a finished run at its final checkpoint
        trained nothing, so measured nothing: it keeps the summary of the run that trained (run_state.kept_summary),
        whole under the same plan, else the figures only training measures. Otherwise from metrics.jsonl and this
        run's figures."""
        if self.rank != 0:
            return None
        kept = (kept_summary(self.state_dir, self.total_steps, self.digest)
                if self.start_step == self.total_steps and self.plan.save_checkpoints else None)
        if kept and kept.same_plan:
            self.kept = kept
            return kept.summary
        summary = self.measured_summary()
        return keep_training_figures(summary, kept.summary) if kept else summary

    def measured_summary(self) -> dict:
        """summary.json's contents from metrics.jsonl and this run's figures (rank 0)."""
        plan, settings, world, shape, params = self.plan, self.settings, self.world, self.shape, self.params
        records = one_record_per_step(read_jsonl(self.metrics_path))
        steady = summarise_steps(records, settings.warmup_timing_steps, self.tokens_per_step)
        tokens_per_s = steady["tokens_per_s"]
        comm_fraction, comm_note = self.comm_fraction()
        ran = self.engine.ran()  # precision, ZeRO stage and batch as the engine parsed them, train.deepspeed included
        peak_flops, peak_source = self.peak["flops_per_rank"], self.peak["source"]
        return RunSummary(**{  # the summary's one declaration: a field not declared there is refused
            "name": plan.name, "role": plan.role, "engine": settings.engine,
            "world_size": world, "nodes": settings.nodes, "device": self.device, "zero_stage": ran["zero_stage"],
            "offload_optimizer": settings.offload_optimizer, "offload_param": settings.offload_param,
            "precision": ran["precision"], "precision_note": emulated_bf16_note(self.device, ran["precision"]),
            "comm_backend": settings.comm_backend,
            "micro_batch_size": ran["micro_batch_size"], "grad_accum_steps": ran["grad_accum_steps"],
            "global_batch_size": ran["global_batch_size"], "seq_len": self.seq_len,
            "deepspeed_overrides": settings.deepspeed,  # train.deepspeed, as merged into ds_config.json
            "steps": self.total_steps, "tokens_per_step": self.tokens_per_step,
            "tokens": self.total_steps * self.tokens_per_step,
            "tokens_per_s": tokens_per_s, "step_time_s": steady["step_time_s"],
            "phase_time_s": steady["phase_time_s"], "steady_steps": steady["steady_steps"],
            "warmup_timing_steps": settings.warmup_timing_steps,
            "peak_mem_bytes": peak_memory_per_rank(records, world),
            "peak_mem_allocated_bytes": peak_memory_per_rank(records, world, "peak_mem_allocated_bytes")
            if self.device == "cuda" else None,
            "peak_mem_kind": peak_memory_bytes(self.device)[1],
            "model": {"preset": plan.model.preset, "parameters": params["total"],
                      "non_embedding_parameters": params["non_embedding"],
                      "matmul_parameters": params["matmul"], **self.family.describe(shape),
                      "attn_implementation": plan.model.attn_implementation,
                      "implementation": plan.model.implementation},
            "flops_per_token": self.flops_token, "flops_formula": self.family.flops_formula,
            "peak_flops_per_rank": peak_flops, "peak_flops_source": peak_source,
            **dict(zip(("mfu", "mfu_note"), model_flops_utilisation(tokens_per_s, self.flops_token, peak_flops, world,
                                                                    peak_source))),
            "comm_fraction": comm_fraction, "comm_method": comm_note,
            "expert_parallel": settings.expert_parallel, "all_to_all_fraction": self.all_to_all_fraction(),
            "loss": steady["loss"], "skipped_steps": records[-1]["skipped_steps"],
            "oversubscribed": self.launch.oversubscribed,
            "threads_per_rank": self.launch.threads_per_rank, "resumed_from_step": self.checkpointer.resumed_from,
            # what the pre-flight chose under train.memory_fit (asked vs ran, and why)
            "memory_fit": {k: plan.memory_fit[k] for k in ("mode", "asked", "chosen", "changed", "summary")},
            "checkpoints": self.checkpointer.committed(), "checkpoint_dir": str(self.checkpointer.root),
            # where the weights came from: model.init_from (uri, revision, folder) or a random initialisation
            "init_from": {**self.init_from, "loaded": self.loaded} if self.init_from else None,
            "init_seed": None if self.init_from else settings.seed,
            "lr_schedule": settings.lr_schedule,
            "compile": self.compile_clock.summary() if self.compile_clock else None,
            "eval_during_training": heldout_summary(records, settings, self.heldout),
            "provenance": provenance(plan.config.as_dict(),
                                     self.context.hardware | {"threads_per_rank": self.launch.threads_per_rank})
            | {"slurm_job_id": os.environ.get("SLURM_JOB_ID"),
               # the data products the run read (results/data/<data_id>), None for a plan made without one
               "data_id": plan.data["data_id"] if plan.data else None,
               # 1-, 5- and 15-minute load averages before the first step and after the last: busy-machine timings
               # are traceable
               "load_before": self.load_before, "load_after": self.load_after,
               # the share of rank 0's node's cores that processes outside the job used during the loop
               # (metrics.OtherCpu): what physical_checks flags as a contended timing
               "other_cpu": self.other_cpu,
               # each rank's host, cores and torch threads (CPU ranks pinned to disjoint cores, see run_context)
               "placement": self.placement},
        }).to_dict()

    def finish(self, summary: dict | None) -> None:
        """Rank 0 copies metrics and TensorBoard to the output folder, writes summary.json and marks the run
        finished; every rank waits for it."""
        dist.barrier()
        if self.rank == 0:
            shutil.copyfile(self.metrics_path, self.out_dir / "metrics.jsonl")
            for tracker_folder in OUTPUT_TRACKER_FOLDERS:  # train.loggers' files (W&B and MLflow keep their own)
                if (self.state_dir / tracker_folder).is_dir():
                    shutil.copytree(self.state_dir / tracker_folder, self.out_dir / tracker_folder, dirs_exist_ok=True)
            if self.kept:  # the finished run's own summary.json, byte for byte; FINISHED.json stays as it was
                shutil.copyfile(self.kept.path, self.out_dir / "summary.json")
            else:
                atomic_write_json(self.out_dir / "summary.json", summary)
                if self.plan.save_checkpoints:
                    mark_finished(self.state_dir, self.total_steps, self.digest, self.out_dir / "summary.json")
            self.log(f"done: {summary['tokens_per_s']:,.0f} tokens/s steady state, loss "
                     f"{summary['loss']['first']:.3f} → {summary['loss']['last']:.3f}")
        dist.barrier()


def run_training(plan: Plan, context: RunContext, launch: LaunchContext) -> dict | None:
    """Train per the plan on this rank, as the launcher set it up. Returns the summary on rank 0."""
    return Trainer(plan, context, launch).run()
