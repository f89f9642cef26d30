"""Reading a committed checkpoint back whatever engine wrote it: `load_fp32_state_dict`, for the HF export."""
from __future__ import annotations

from pathlib import Path

from .checkpoint import CheckpointError, read_marker, tag_for
from .engines import ENGINE_CLASSES


def load_fp32_state_dict(root: Path, step: int, *, lazy: bool = False) -> dict:
    """The full fp32 model state dict of a committed checkpoint, on CPU, for any ZeRO stage and any engine: read by
    the engine whose layout the folder holds (Engine.holds_checkpoint, Engine.read_model_state).

    lazy: the tensors as stored, nothing converted: files mapped rather than read, a ZeRO-3 parameter a DeepSpeed
    GatheredTensor that `.contiguous()` gathers from the ranks' partitions. For a reader that converts one tensor at a
    time (export.cast_state_dict) instead of holding the whole fp32 dict."""
    read_marker(root, step)  # raises with the path if incomplete
    folder = Path(root) / tag_for(step)
    for engine in ENGINE_CLASSES.values():
        if engine.holds_checkpoint(folder):
            state = engine.read_model_state(folder, lazy=lazy)
            return state if lazy else {k: v.float() for k, v in state.items()}
    raise CheckpointError(f"checkpoint {folder} holds no engine's files (no mp_rank_00_model_states.pt, model.pt or "
                          "dcp/.metadata)")
