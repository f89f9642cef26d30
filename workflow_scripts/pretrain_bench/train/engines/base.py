"""The interface every engine implements (`Engine`), what it is told of the run (`EngineRun`), and what the engines
share: the learning-rate schedule, the per-rank state file, mapped checkpoint loads."""
from __future__ import annotations

import abc
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import ClassVar

import torch

from pretrain_bench.train.checkpoints.files import tag_for


def engine_state_file(rank: int) -> str:
    return f"engine_rank{rank}.pt"


def lr_schedule(settings, total_steps: int):
    """A factory of the run's LambdaLR (see settings.learning_rate)."""
    from pretrain_bench.train.settings import learning_rate

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
    # where the engine writes its own config file (write_config) before it starts, so the file is there to read
    # when starting fails; None on every rank but one
    config_dir: Path | None = None


class Engine(abc.ABC):
    """One training engine, as the Trainer sees it.

    Before the engine is built (class level): `preload` (in torchrun's agent, for forked ranks), `init_distributed`,
    `build_precision`, `gradient_checkpointing_kwargs`, `comm_timing_is_free`, and the checkpoint layout it writes
    (`holds_checkpoint`, `read_model_state`).
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
        eval() · train()

    An engine with a configuration file of its own (DeepSpeed's ds_config.json) writes it into `EngineRun.config_dir`
    before it starts.
    """

    # The keyword arguments of the model's gradient_checkpointing_enable (train.activation_checkpointing).
    gradient_checkpointing_kwargs: ClassVar[dict | None] = None
    # How its collectives are timed for the summary's comm_fraction (None: not at all).
    comm_method: ClassVar[str | None] = None
    # Timing them costs nothing (no synchronisation), so every run measures them, not only where the plan asks.
    comm_timing_is_free: ClassVar[bool] = False
    skipped_steps: int  # optimizer steps skipped (fp16 overflow)

    # What a rank of this engine imports before its first step (train.rank_start fork: torchrun's agent imports it once,
    # before forking the ranks; pretrain_bench.train.forked_ranks).
    rank_libraries: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def preload(cls, settings) -> None:
        """In torchrun's agent on CPU, before it forks the ranks: import `rank_libraries`, so no rank imports them."""
        import importlib

        for name in cls.rank_libraries:
            importlib.import_module(name)

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

    def all_to_all_ms(self) -> float | None:
        """Milliseconds a mixture-of-experts model's all-to-alls were in flight on this rank so far (None: the
        engine splits no experts over ranks, or does not time them)."""
        return None

    @abc.abstractmethod
    def save(self, folder: Path, writer, client_state: dict) -> None:
        """Write this rank's part of a checkpoint into `folder` (which files pass through `writer`: see the engine)."""

    def checkpoint_folder(self, root: Path, step: int) -> Path:
        """The folder to load checkpoint `step` from (every rank calls it)."""
        return Path(root) / tag_for(step)

    @abc.abstractmethod
    def load(self, folder: Path) -> None:
        """Load this rank's states from checkpoint `folder`."""


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


