"""The engine classes by train.engine name: `ENGINE_CLASSES` and `engine_class`, and the names the engines' modules
export, for the trainer, the checkpointer and the ranks' preloading (this imports torch and DeepSpeed)."""
from __future__ import annotations

from pretrain_bench.train.engines.base import Engine, EngineRun, engine_state_file, lr_schedule, mmap_loads
from pretrain_bench.train.engines.ddp import DDP_MODEL_FILE, DDP_OPTIMIZER_FILE, DDPEngine
from pretrain_bench.train.engines.deepspeed_engine import (
    DS_MODEL_FILE,
    DeepSpeedEngine,
    deepspeed_comm_ms,
    skip_muon_import,
    universal_tag,
)
from pretrain_bench.train.engines.fsdp import DCP_FOLDER, FSDPEngine, read_dcp_model
from pretrain_bench.train.engines.spec import ENGINES
from pretrain_bench.train.engines.torch_engine import CommIntervals, CudaEventClock, HostClock, TorchEngine

ENGINE_CLASSES: dict[str, type[Engine]] = {"deepspeed": DeepSpeedEngine, "ddp": DDPEngine, "fsdp": FSDPEngine}
assert tuple(ENGINE_CLASSES) == ENGINES, "every registered spec (spec.ENGINE_SPECS) has its engine class"


def engine_class(name: str) -> type[Engine]:
    """The engine of train.engine `name`."""
    if name not in ENGINE_CLASSES:
        raise ValueError(f"unknown train.engine {name!r}; choose one of {list(ENGINES)}")
    return ENGINE_CLASSES[name]


__all__ = ["DCP_FOLDER", "DDP_MODEL_FILE", "DDP_OPTIMIZER_FILE", "DS_MODEL_FILE", "ENGINE_CLASSES", "CommIntervals",
           "CudaEventClock", "DDPEngine", "DeepSpeedEngine", "Engine", "EngineRun", "FSDPEngine", "HostClock",
           "TorchEngine", "deepspeed_comm_ms", "engine_class", "engine_state_file", "lr_schedule", "mmap_loads",
           "read_dcp_model", "skip_muon_import", "universal_tag"]
