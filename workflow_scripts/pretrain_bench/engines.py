"""The training engines behind one interface, `Engine`: DeepSpeed, PyTorch DDP and PyTorch FSDP2.

The Trainer knows only `Engine`: it takes the class of train.engine (`engine_class`) and asks it, never which engine
it holds. Each engine wraps the same model, data and schedule.

Optimizer maths is the same everywhere: AdamW (train.lr, adam_betas, adam_eps, weight_decay on every parameter),
gradients averaged over ranks and accumulation micro-steps, the global norm clipped to train.grad_clip, and a LambdaLR
over `settings.learning_rate` stepped once per optimizer step that was not skipped (an fp16 overflow skips both, as
DeepSpeed does). That is why DDP and DeepSpeed ZeRO-0 in fp32 train to the same losses.

Checkpoints: DeepSpeed writes its own layout (mp_rank_00_model_states.pt, ZeRO partitions). DDP's states are the
same on every rank, so rank 0 writes model.pt (the module's state dict) and optimizer.pt. FSDP writes a
torch.distributed.checkpoint folder (`dcp/`, one file per rank plus .metadata), which any world size loads. Every
rank also writes engine_rank<r>.pt (scheduler, loss scaler, skipped steps) — except DeepSpeed, which keeps those in
its own files. Each engine class reads its own layout back (`holds_checkpoint`, `read_model_state`) for the HF
export (`checkpointer.load_fp32_state_dict`).
"""
from __future__ import annotations

import abc
import contextlib
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import ClassVar

import torch

from .checkpoint import UNIVERSAL_SUFFIX, CheckpointError, tag_for
from .settings import ENGINES, TORCH_ADAMW_KWARGS

DDP_MODEL_FILE, DDP_OPTIMIZER_FILE, DCP_FOLDER = "model.pt", "optimizer.pt", "dcp"
DS_MODEL_FILE = "mp_rank_00_model_states.pt"  # DeepSpeed's module (and, at ZeRO-0, its whole state)


def engine_state_file(rank: int) -> str:
    return f"engine_rank{rank}.pt"


def lr_schedule(settings, total_steps: int):
    """A factory of the run's LambdaLR (see settings.learning_rate)."""
    from .settings import learning_rate

    def schedule(optimizer):
        # A plain function (not a callable object): LambdaLR then saves no state of it in checkpoints, so a
        # resumed run with more train.max_steps follows its own schedule, not the saved one's.
        def factor(step: int) -> float:
            return learning_rate(step, settings, total_steps) / settings.lr

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    return schedule


@dataclass(frozen=True)
class EngineRun:
    """What an engine needs to know of the run besides its settings and the model."""

    device: str  # cpu | cuda
    total_steps: int  # the learning-rate schedule's length
    measure_comm: bool  # the plan asks for communication timing (DeepSpeed: its comms logger, which synchronises)
    pin_memory: bool  # host memory may be pinned (the launcher's probe in the job's slot)
    reshape: bool  # the checkpoint this run resumes from was saved at another world size


class Engine(abc.ABC):
    """One training engine, as the Trainer sees it.

    Before the engine is built (class level): `init_distributed`, `build_precision`, `gradient_checkpointing_kwargs`,
    `comm_timing_is_free`, and the checkpoint layout it writes (`holds_checkpoint`, `read_model_state`).
    Built (`cls(model, settings, EngineRun(…))`, the model already on this rank's device), it is called like the
    model (`engine(input_ids=…)` returns the model's output, `.logits`), and:

        backward(loss)   backward of one micro-step (the engine scales for gradient accumulation)
        step()           end of one micro-step; the optimizer steps at the accumulation boundary
        lr(), grad_norm(), skipped_steps, loss_scale()
                         (grad_norm: as computed, a device tensor or a number, or None; the trainer reads it to the
                         host with the step's other figures, so no engine call here waits for the device)
        ran()            precision, ZeRO stage and batch as the engine runs them (for the summary)
        comm_method, comm_ms()   how its collectives are timed (None: they are not), and the total so far
        save(folder, writer, client_state) · checkpoint_folder(root, step) · load(folder)
        eval() · train() · write_config(folder)
    """

    # The keyword arguments of the model's gradient_checkpointing_enable (train.activation_checkpointing).
    gradient_checkpointing_kwargs: ClassVar[dict | None] = None
    # How its collectives are timed for the summary's comm_fraction (None: not at all).
    comm_method: ClassVar[str | None] = None
    # Timing them costs nothing (no synchronisation), so every run measures them, not only where the plan asks.
    comm_timing_is_free: ClassVar[bool] = False
    skipped_steps: int  # optimizer steps skipped (fp16 overflow)

    @staticmethod
    @abc.abstractmethod
    def init_distributed(backend: str, timeout: timedelta) -> None:
        """Join the process group of this run's ranks."""

    @classmethod
    @abc.abstractmethod
    def build_precision(cls, settings) -> str:
        """The precision the model is built in, before the engine wraps it."""

    @classmethod
    @abc.abstractmethod
    def holds_checkpoint(cls, folder: Path) -> bool:
        """Whether checkpoint `folder` is in this engine's layout."""

    @classmethod
    @abc.abstractmethod
    def read_model_state(cls, folder: Path, *, lazy: bool) -> dict:
        """The model's full state dict from checkpoint `folder` in this engine's layout, on CPU, in one process
        (lazy: as stored, files mapped; see checkpointer.load_fp32_state_dict)."""

    @abc.abstractmethod
    def __call__(self, **inputs): ...

    @abc.abstractmethod
    def backward(self, loss) -> None: ...

    @abc.abstractmethod
    def step(self) -> None: ...

    @abc.abstractmethod
    def eval(self) -> None: ...

    @abc.abstractmethod
    def train(self) -> None: ...

    @abc.abstractmethod
    def lr(self) -> float: ...

    @abc.abstractmethod
    def grad_norm(self): ...

    @abc.abstractmethod
    def loss_scale(self) -> float | None: ...

    @abc.abstractmethod
    def ran(self) -> dict: ...

    def comm_ms(self) -> float | None:
        """Milliseconds spent in collectives on this rank so far (None: not timed)."""
        return None

    def write_config(self, folder: Path) -> None:
        """Write the engine's own configuration file into the run's output folder, where it has one."""
        return None  # DDP and FSDP take everything from the settings

    @abc.abstractmethod
    def save(self, folder: Path, writer, client_state: dict) -> None:
        """Write this rank's part of a checkpoint into `folder` (which files pass through `writer`: see the engine)."""

    def checkpoint_folder(self, root: Path, step: int) -> Path:
        """The folder to load checkpoint `step` from (every rank calls it)."""
        return Path(root) / tag_for(step)

    @abc.abstractmethod
    def load(self, folder: Path) -> None:
        """Load this rank's states from checkpoint `folder`."""


# --- helpers of the engines ---------------------------------------------------------------------------------------


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


def fused_adam_prebuilt() -> bool:
    """Whether this DeepSpeed install ships a compiled FusedAdam (DS_BUILD_FUSED_ADAM=1 at install); otherwise it
    would be compiled at the first step with nvcc, which a machine without the CUDA toolkit does not have."""
    try:
        from deepspeed.git_version_info import installed_ops

        return bool(installed_ops.get("fused_adam"))
    except ImportError:
        return False


_comm_total_ms = 0.0  # deepspeed_comm_ms's running total: what earlier calls took out of DeepSpeed's logger


def deepspeed_comm_ms() -> float:
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


MUON_MODULES = ("deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.zero.muon.original_muon")


def skip_muon_import() -> None:
    """Stand in for DeepSpeed's Muon modules in a run whose optimizer is not Muon.

    DeepSpeed's ZeRO optimizers import them at set-up and again in every gradient reduction (stage_1_and_2's
    average_tensor and _get_flat_partition_unpadded), only to test `isinstance(optimizer, MuonWithAuxAdam)` or to
    have `muon_update` at hand for parameters marked `use_muon`, which only a Muon optimizer marks. Importing them
    applies torch.compile to Muon's kernels, which loads inductor's compiler: about 0.9 s of every ZeRO-1/2 rank's
    start on CPU. Hand-written because DeepSpeed has no switch for it. The stand-ins hold a class that no optimizer
    is an instance of and a `muon_update` that refuses to run; a process that already imported the real modules
    keeps them."""
    import sys
    import types

    if any(name in sys.modules for name in MUON_MODULES):
        return

    class MuonWithAuxAdam:  # never instantiated: DeepSpeed's isinstance tests are all it is for
        pass

    def muon_update(*args, **kwargs):
        raise RuntimeError("DeepSpeed's Muon update was called in a run built without Muon (pretrain_bench.engines."
                           "skip_muon_import stands in for it)")

    for name in MUON_MODULES:
        module = types.ModuleType(name, "pretrain-bench's stand-in: this run's optimizer is not Muon")
        module.MuonWithAuxAdam, module.muon_update, module.adam_update = MuonWithAuxAdam, muon_update, muon_update
        sys.modules[name] = module


class DeepSpeedEngine(Engine):
    """DeepSpeed (ZeRO 0-3, offload) from the ds_config of the settings (settings.deepspeed_config)."""

    comm_method = ("DeepSpeed comms_logger (prof_all) on rank 0: wall-clock of every deepspeed.comm collective "
                   "(synchronised), summed over steady-state steps ÷ their step time; includes time spent waiting "
                   "for slower ranks")

    @staticmethod
    def init_distributed(backend: str, timeout: timedelta) -> None:
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)

    @classmethod
    def build_precision(cls, settings) -> str:
        # DeepSpeed keeps the module in the training precision; its optimizer holds the fp32 master copy.
        return settings.precision

    def __init__(self, model, settings, run: EngineRun):
        import deepspeed

        from .settings import deepspeed_config

        self.config = deepspeed_config(settings, run.device, run.total_steps, fused_adam=fused_adam_prebuilt(),
                                       pin_memory=run.pin_memory, comms_logger=run.measure_comm)
        if run.reshape:  # DDP's files and FSDP's DCP folder load at any world size; DeepSpeed's through a universal one
            self.config["checkpoint"] = {"load_universal": True}
        if self.config["optimizer"]["type"].lower() != "muon":
            skip_muon_import()
        # DeepSpeed 0.19's ZeRO-1/2 step all-gathers the updated partitions with
        # torch.distributed.all_gather_into_tensor, which torch 2.13 marks deprecated: a FutureWarning (two lines)
        # per rank in every training log, about a call the user cannot change.
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                                category=FutureWarning)
        self.settings, self.reshape = settings, run.reshape
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                    config=self.config,
                                                    lr_scheduler=lr_schedule(settings, run.total_steps))
        if settings.zero_stage == 0 and self.engine.dp_world_size == 1:
            # Alone, ZeRO-0's backward would still flatten every gradient, all-reduce it with itself and copy it
            # back: about 7 % of a step on CPU (bench/bench_trainer.py), for an average over one rank, which is the
            # gradient itself. ZeRO-1/2/3 reduce through their optimizer's own hooks and keep this path.
            self.engine.enable_backward_allreduce = False

    def write_config(self, folder: Path) -> None:
        """ds_config.json: the config DeepSpeed was given (train.deepspeed merged in)."""
        import json

        (Path(folder) / "ds_config.json").write_text(json.dumps(self.config, indent=2))

    def __call__(self, **inputs):
        return self.engine(**inputs)

    def comm_ms(self) -> float:
        return deepspeed_comm_ms()

    def backward(self, loss) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()

    def eval(self) -> None:
        self.engine.eval()

    def train(self) -> None:
        self.engine.train()

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def grad_norm(self):
        return self.engine.get_global_grad_norm()

    @property
    def skipped_steps(self) -> int:
        return self.engine.skipped_steps

    def loss_scale(self) -> float | None:
        return number(getattr(self.engine.optimizer, "cur_scale", None) if self.settings.precision == "fp16" else None)

    def ran(self) -> dict:
        """Precision, ZeRO stage and batch as DeepSpeed parsed them from the merged ds_config (train.deepspeed
        included): what the summary reports, so it cannot disagree with what ran."""
        engine = self.engine
        precision = "fp16" if engine.fp16_enabled() else "bf16" if engine.bfloat16_enabled() else "fp32"
        if engine.torch_autocast_enabled():
            precision += f"+autocast({str(engine.torch_autocast_dtype()).removeprefix('torch.')})"
        return {"precision": precision, "zero_stage": int(engine.zero_optimization_stage()),
                "micro_batch_size": engine.train_micro_batch_size_per_gpu(),
                "grad_accum_steps": engine.gradient_accumulation_steps(),
                "global_batch_size": engine.train_batch_size()}

    def save(self, folder: Path, writer, client_state: dict) -> None:
        """Every file DeepSpeed writes goes through `writer` (hashed while written)."""
        engine = self.engine
        writer.zipfile = getattr(engine.checkpoint_engine, "zipfile_serialization", True)
        engine.checkpoint_engine.save = writer.save
        try:
            engine.save_checkpoint(str(folder.parent), tag=folder.name, client_state=client_state)
        finally:
            del engine.checkpoint_engine.save  # back to the engine's own method

    def checkpoint_folder(self, root: Path, step: int) -> Path:
        """At another world size: a universal copy of the checkpoint (rank 0 converts it once, the others wait)."""
        if self.reshape:
            return Path(root) / universal_tag(root, step)
        return super().checkpoint_folder(root, step)

    def load(self, folder: Path) -> None:
        """DeepSpeed's optimizer shards are mapped, not copied, beside the states already allocated (mmap_loads
        gives what outlives the load memory of its own, so a pruned checkpoint's disk is freed)."""
        with mmap_loads():
            loaded, _ = self.engine.load_checkpoint(str(folder.parent), tag=folder.name)
        if loaded is None:  # DeepSpeed only warns when it finds nothing to load
            import torch.distributed as dist

            raise FileNotFoundError(f"DeepSpeed found no checkpoint files of rank {dist.get_rank()} in {folder}")

    @staticmethod
    def zero_partitioned(folder: Path) -> bool:
        """ZeRO-1/2/3: the optimizer states are partitioned over the ranks (zero_pp_rank_* files)."""
        return bool(list(folder.glob("*optim_states.pt")) and (list(folder.glob("zero_pp_rank_*"))
                                                               or list(folder.glob("bf16_zero_pp_rank_*"))))

    @classmethod
    def holds_checkpoint(cls, folder: Path) -> bool:
        return (folder / DS_MODEL_FILE).is_file() or cls.zero_partitioned(folder)

    @classmethod
    def read_model_state(cls, folder: Path, *, lazy: bool) -> dict:
        """ZeRO-1/2/3: the partitions merged by DeepSpeed's zero_to_fp32; ZeRO-0: the model file's module."""
        if cls.zero_partitioned(folder):
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            return get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name, lazy_mode=lazy)
        return torch.load(folder / DS_MODEL_FILE, map_location="cpu", weights_only=False, mmap=lazy)["module"]


def universal_tag(root: Path, step: int) -> str:
    """Tag of a universal (world-size-independent) copy of checkpoint `step`, made once by rank 0.

    DeepSpeed's ds_to_universal merges the ZeRO partitions into per-parameter files that any world size can load
    (with `checkpoint.load_universal` in the DeepSpeed config). The copy is written to a temporary folder and
    renamed when complete; the original checkpoint is never modified.
    """
    import os
    import shutil
    import subprocess
    import sys

    import torch.distributed as dist

    tag = f"{tag_for(step)}{UNIVERSAL_SUFFIX}"
    target = Path(root) / tag
    if dist.get_rank() == 0 and not (target / "zero").is_dir():
        tmp = Path(root) / f"{tag}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        result = subprocess.run(
            [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
             str(Path(root) / tag_for(step)), "--output_folder", str(tmp), "--inject_missing_state",
             "--num_extract_workers", "1", "--num_merge_workers", "1"],
            capture_output=True, text=True)
        if result.returncode:
            raise CheckpointError(f"converting {Path(root) / tag_for(step)} to a universal checkpoint failed:\n"
                                  f"{result.stderr[-2000:]}")
        os.replace(tmp, target)
    dist.barrier()
    return tag


class TorchEngine(Engine):
    """What DDP and FSDP share: AdamW, the LambdaLR, gradient accumulation, clipping and fp16 loss scaling."""

    # non-reentrant recomputation: what DDP's and FSDP's gradient hooks need
    gradient_checkpointing_kwargs = {"use_reentrant": False}

    @staticmethod
    def init_distributed(backend: str, timeout: timedelta) -> None:
        import torch.distributed as dist

        dist.init_process_group(backend=backend, timeout=timeout)  # no DeepSpeed at all (nor its import time)

    @classmethod
    def build_precision(cls, settings) -> str:
        # fp32 parameters; bf16/fp16 compute through autocast or FSDP's mixed-precision policy
        return "fp32"

    def __init__(self, model, settings, run: EngineRun):
        self.settings, self.device = settings, run.device
        total_steps = run.total_steps
        self.accumulation = settings.grad_accum_steps
        self.micro_step = 0  # micro-steps since the last optimizer step
        self.skipped_steps = 0
        self._grad_norm: float | None = None
        self.model = self.wrap(model)
        # torch.optim.AdamW as DeepSpeed's torch_adam path builds it (fused), so ZeRO-0 and DDP match
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings.lr, betas=tuple(settings.adam_betas),
                                           eps=settings.adam_eps, weight_decay=settings.weight_decay,
                                           **TORCH_ADAMW_KWARGS)
        self.scheduler = lr_schedule(settings, total_steps)(self.optimizer)
        self.scaler = self.make_scaler() if settings.precision == "fp16" else None
        # the scale as last read (before the first step: the initial scale, which reading does not wait for)
        self._scale = self.scaler.get_scale() if self.scaler is not None else None

    # engine-specific
    def wrap(self, model):
        raise NotImplementedError

    def make_scaler(self):
        return torch.amp.GradScaler(self.device)

    def sync_gradients(self, boundary: bool):
        """A context for the forward (and the backward) of a micro-step: gradients are reduced only at the boundary."""
        return contextlib.nullcontext()

    def autocast(self):
        return contextlib.nullcontext()

    # the loop's interface
    @property
    def boundary(self) -> bool:
        return (self.micro_step + 1) % self.accumulation == 0

    def __call__(self, **inputs):
        with self.sync_gradients(self.boundary or not torch.is_grad_enabled()), self.autocast():
            return self.model(**inputs)

    def backward(self, loss) -> None:
        loss = loss / self.accumulation  # the mean over micro-steps, as DeepSpeed scales it
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        with self.sync_gradients(self.boundary):
            loss.backward()

    def step(self) -> None:
        boundary = self.boundary
        self.micro_step = (self.micro_step + 1) % self.accumulation
        if not boundary:
            return
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        clip = self.settings.grad_clip if self.settings.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: a DTensor over the shards
        self._grad_norm = norm  # read (one synchronisation) only when the record asks for it
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
            # The step's one read of the scale (a synchronisation; the scheduler must know whether to step). The
            # scale drops exactly when the step was skipped; the scale before it was read at the previous step.
            scale, self._scale = self._scale, self.scaler.get_scale()
            stepped = self._scale >= scale
        else:
            self.optimizer.step()
            stepped = True
        if stepped:
            self.scheduler.step()
        else:
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)

    def eval(self) -> None:
        self.model.eval()

    def train(self) -> None:
        self.model.train()

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def grad_norm(self):
        return self._grad_norm

    def loss_scale(self) -> float | None:
        return self._scale

    def ran(self) -> dict:
        """Precision, ZeRO-equivalent stage and batch: this engine takes them from the settings and nothing else."""
        s = self.settings
        return {"precision": s.precision, "zero_stage": s.zero_stage, "micro_batch_size": s.micro_batch_size,
                "grad_accum_steps": s.grad_accum_steps, "global_batch_size": s.derived_global_batch}

    def engine_state(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "skipped_steps": self.skipped_steps,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_engine_state(self, folder: Path) -> None:
        """The scheduler, scaler and skipped steps. A new world size has no file of its own for a new rank: they are
        the same on every rank, so rank 0's serve."""
        import torch.distributed as dist

        own = folder / engine_state_file(dist.get_rank())
        state = torch.load(own if own.is_file() else folder / engine_state_file(0), map_location="cpu",
                           weights_only=False)
        self.scheduler.load_state_dict(state["scheduler"])
        self.skipped_steps = state["skipped_steps"]
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
            self._scale = self.scaler.get_scale()


class HostClock:
    """Marks in host wall-clock milliseconds: on CPU a collective's future completes when its work has."""

    def mark(self) -> float:
        import time

        return time.perf_counter() * 1000.0

    def spans_ms(self, intervals: list[list]) -> list[tuple[float, float]]:
        return [(start, stop) for start, stop in intervals]


class CudaEventClock:
    """Marks as CUDA events on the current stream. An NCCL all-reduce's future "completes", and runs its callbacks,
    when the work is queued, not done; the callback runs with streams that wait for the work, so an event recorded
    there passes when the all-reduce has finished. Read (waiting for the last mark) only when asked."""

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def spans_ms(self, intervals: list[list]) -> list[tuple[float, float]]:
        if not intervals:
            return []
        for _, stop in intervals:
            stop.synchronize()
        origin = intervals[0][0]
        return [(origin.elapsed_time(start), origin.elapsed_time(stop)) for start, stop in intervals]


class CommIntervals:
    """Time with at least one collective in flight: the union of launch-to-completion intervals, which overlap each
    other and the backward pass, marked by a HostClock (CPU) or a CudaEventClock (CUDA)."""

    def __init__(self, clock):
        self.clock = clock
        self.pending: list[list] = []  # [start, stop or None]
        self.total = 0.0

    def launched(self) -> list:
        interval = [self.clock.mark(), None]
        self.pending.append(interval)
        return interval

    def completed(self, interval: list) -> None:
        interval[1] = self.clock.mark()

    def total_ms(self) -> float:
        """Milliseconds in flight over every interval completed so far (the rest wait for the next call)."""
        done = [interval for interval in self.pending if interval[1] is not None]
        self.pending = [interval for interval in self.pending if interval[1] is None]
        end = float("-inf")
        for start, stop in sorted(self.clock.spans_ms(done)):  # overlapping buckets count once
            start = max(start, end)
            if stop > start:
                self.total += stop - start
                end = stop
        return self.total


class DDPEngine(TorchEngine):
    """torch.nn.parallel.DistributedDataParallel: replicated fp32 parameters, gradients and AdamW states; bf16/fp16
    through autocast (fp16 with torch.amp.GradScaler); accumulation micro-steps under no_sync."""

    comm_method = ("DDP communication hook on rank 0: wall-clock while any gradient-bucket all-reduce was in "
                   "flight (union of launch-to-completion intervals, CUDA events on a GPU; they overlap the backward "
                   "pass), summed over steady-state steps ÷ their step time")
    comm_timing_is_free = True  # the hook times its all-reduces without synchronising anything

    def wrap(self, model):
        from torch.nn.parallel import DistributedDataParallel

        # gradient_as_bucket_view: the gradients are views into DDP's communication buckets, not a second copy
        # (the memory model counts 4Ψ of gradients, not 8Ψ)
        ids = [torch.cuda.current_device()] if self.device == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)
        # Exact resume: DDP's first iteration reduces all gradients in one bucket, then rebuilds its buckets in the
        # order the first backward produced them. A resumed run would reduce its first step in the one bucket where
        # the uninterrupted run used the rebuilt ones, and a ring all-reduce's summation order depends on where an
        # element sits in its bucket, so the losses would drift in the last bits. Fixing the layout now (the
        # Join hook's own calls: parameters in definition order, DDP's usual bucket sizes) makes every step of
        # every run reduce in the same buckets; the price is buckets in definition rather than backward order.
        ddp.reducer._push_all_rebuilt_params()
        ddp.reducer._rebuild_buckets()
        self._comm = CommIntervals(CudaEventClock() if self.device == "cuda" else HostClock())
        ddp.register_comm_hook(None, self._timed_allreduce)
        return ddp

    def _timed_allreduce(self, state, bucket):
        """DDP's own all-reduce hook, timed from launch to completion (marked in the future's callback)."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        interval = self._comm.launched()

        def done(future):
            self._comm.completed(interval)
            return future.value()

        return allreduce_hook(state, bucket).then(done)

    def comm_ms(self) -> float:
        """Milliseconds with at least one all-reduce in flight, over the run so far."""
        return self._comm.total_ms()

    def sync_gradients(self, boundary: bool):
        return contextlib.nullcontext() if boundary else self.model.no_sync()

    def autocast(self):
        precision = self.settings.precision
        if precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)

    def save(self, folder: Path, writer, client_state: dict) -> None:
        """Every file passes through `writer` (hashed while written)."""
        import torch.distributed as dist

        rank = dist.get_rank()
        if rank == 0:  # every rank holds the same states
            writer.save({"module": self.model.module.state_dict(), "client_state": client_state},
                        folder / DDP_MODEL_FILE)
            writer.save({"optimizer": self.optimizer.state_dict()}, folder / DDP_OPTIMIZER_FILE)
        writer.save(self.engine_state(), folder / engine_state_file(rank))

    def load(self, folder: Path) -> None:
        """Mapped, not read (mmap_loads gives what outlives the load memory of its own, so a pruned checkpoint's
        disk is freed)."""
        with mmap_loads():
            model = torch.load(folder / DDP_MODEL_FILE, map_location="cpu", weights_only=False, mmap=True)
            self.model.module.load_state_dict(model["module"])
            self.optimizer.load_state_dict(torch.load(folder / DDP_OPTIMIZER_FILE, map_location="cpu",
                                                      weights_only=False, mmap=True)["optimizer"])
            self.load_engine_state(folder)

    @classmethod
    def holds_checkpoint(cls, folder: Path) -> bool:
        return (folder / DDP_MODEL_FILE).is_file()

    @classmethod
    def read_model_state(cls, folder: Path, *, lazy: bool) -> dict:
        """Rank 0's state dict, fp32."""
        return torch.load(folder / DDP_MODEL_FILE, map_location="cpu", weights_only=False, mmap=True)["module"]


class FSDPEngine(TorchEngine):
    """FSDP2 (torch.distributed.fsdp.fully_shard) on every decoder layer and the whole model: fp32 shards of the
    parameters, gradients and AdamW states (ZeRO-3's layout); bf16/fp16 compute through MixedPrecisionPolicy with
    fp32 gradient reduction (fp16 with the sharded gradient scaler)."""

    def wrap(self, model):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device, (dist.get_world_size(),))
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.settings.precision]
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in model.model.layers:  # one all-gather per decoder layer, freed after its use
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)  # embeddings, final norm and head
        return model

    def make_scaler(self):
        # the plain GradScaler checks only this rank's gradient shards for inf/NaN; the sharded one agrees
        # across ranks, so every rank skips the same steps
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(self.device)

    def sync_gradients(self, boundary: bool):
        self.model.set_requires_gradient_sync(boundary)
        return contextlib.nullcontext()

    def save(self, folder: Path, writer, client_state: dict) -> None:
        """engine_rank<r>.pt passes through `writer` (hashed while written). The DCP folder is written by
        torch.distributed.checkpoint's own FileSystemWriter, which takes no file object to write through: its files
        are hashed when the checkpoint is committed (checkpoint.write_marker reads every file of the folder that no
        writer recorded), and the marker lists them, with their sizes and sha256, like every other file."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        try:
            dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=str(folder / DCP_FOLDER))
        except CheckpointException as error:  # a BaseException: carry it as the error the save expects
            raise OSError(f"torch.distributed.checkpoint failed writing {folder / DCP_FOLDER}: {error}") from None
        writer.save(self.engine_state(), folder / engine_state_file(dist.get_rank()))

    def load(self, folder: Path) -> None:
        """torch.distributed.checkpoint reads through buffers, which cannot be mapped."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optim": optimizer_state}
        try:
            dcp.load(state, checkpoint_id=str(folder / DCP_FOLDER))  # resharded to this world size as needed
        except CheckpointException as error:
            raise RuntimeError(f"torch.distributed.checkpoint failed reading {folder / DCP_FOLDER}: {error}") from None
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.load_engine_state(folder)

    @classmethod
    def holds_checkpoint(cls, folder: Path) -> bool:
        return (folder / DCP_FOLDER / ".metadata").is_file()

    @classmethod
    def read_model_state(cls, folder: Path, *, lazy: bool) -> dict:
        return read_dcp_model(folder / DCP_FOLDER)


def read_dcp_model(folder: Path) -> dict:
    """The model's full state dict from a torch.distributed.checkpoint folder written by FSDPEngine, in one process
    (no process group): tensors are allocated from the folder's metadata and filled by dcp.load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(folder))
    metadata = reader.read_metadata().state_dict_metadata
    state = {key[len("model."):]: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.items()
             if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    nested = {"model": state}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(nested, storage_reader=reader, no_dist=True)
    return nested["model"]


ENGINE_CLASSES: dict[str, type[Engine]] = {"deepspeed": DeepSpeedEngine, "ddp": DDPEngine, "fsdp": FSDPEngine}
assert tuple(ENGINE_CLASSES) == ENGINES, "settings.ENGINES names the engines of this module"


def engine_class(name: str) -> type[Engine]:
    """The engine of train.engine `name`."""
    if name not in ENGINE_CLASSES:
        raise ValueError(f"unknown train.engine {name!r}; choose one of {list(ENGINES)}")
    return ENGINE_CLASSES[name]
