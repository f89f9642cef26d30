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

from pretrain_bench.config.settings import ENGINES
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
from pretrain_bench.train.engines.torch_engine import CommIntervals, CudaEventClock, HostClock, TorchEngine

ENGINE_CLASSES: dict[str, type[Engine]] = {"deepspeed": DeepSpeedEngine, "ddp": DDPEngine, "fsdp": FSDPEngine}
assert tuple(ENGINE_CLASSES) == ENGINES, "settings.ENGINES names the engines of this package"


def engine_class(name: str) -> type[Engine]:
    """The engine of train.engine `name`."""
    if name not in ENGINE_CLASSES:
        raise ValueError(f"unknown train.engine {name!r}; choose one of {list(ENGINES)}")
    return ENGINE_CLASSES[name]


__all__ = ["DCP_FOLDER", "DDP_MODEL_FILE", "DDP_OPTIMIZER_FILE", "DS_MODEL_FILE", "ENGINE_CLASSES", "CommIntervals",
           "CudaEventClock", "DDPEngine", "DeepSpeedEngine", "Engine", "EngineRun", "FSDPEngine", "HostClock",
           "TorchEngine", "deepspeed_comm_ms", "engine_class", "engine_state_file", "lr_schedule", "mmap_loads",
           "read_dcp_model", "skip_muon_import", "universal_tag"]
