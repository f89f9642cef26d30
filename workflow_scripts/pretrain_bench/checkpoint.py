"""Self-describing, commit-marked checkpoints and their discovery, pruning and conversion.

A DeepSpeed checkpoint is written by every rank into `<root>/step<N>/`. It counts only once rank 0 has written
`<root>/step<N>/COMMITTED.json` after a barrier: a crash mid-save leaves a folder without the marker, which resume
and evaluation ignore. The marker repeats the client state (step, data position, config hash) so a reader needs
no torch to see what a checkpoint holds.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

MARKER = "COMMITTED.json"
_TAG = re.compile(r"^step(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or incompatible; the message names its path."""


def tag_for(step: int) -> str:
    return f"step{step}"


def write_marker(root: Path, step: int, info: dict) -> None:
    """Write the commit marker atomically: the checkpoint exists from this moment on."""
    folder = Path(root) / tag_for(step)
    tmp = folder / (MARKER + ".tmp")
    tmp.write_text(json.dumps({"step": step, **info}, indent=2, sort_keys=True))
    os.replace(tmp, folder / MARKER)


def committed_steps(root: Path) -> list[int]:
    """Steps of complete checkpoints under root, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for child in root.iterdir():
        match = _TAG.match(child.name)
        if match and (child / MARKER).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def read_marker(root: Path, step: int) -> dict:
    path = Path(root) / tag_for(step) / MARKER
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path.parent} is missing or incomplete (no {MARKER})")
    return json.loads(path.read_text())


def prune(root: Path, keep: int | None, protect: set[int] = frozenset()) -> list[int]:
    """Delete complete checkpoints beyond the newest `keep` (never an incomplete one being written, never protected)."""
    if keep is None:
        return []
    steps = committed_steps(root)
    doomed = [s for s in steps[:-keep] if s not in protect] if len(steps) > keep else []
    for step in doomed:
        folder = Path(root) / tag_for(step)
        # Remove the marker first: a crash during rmtree leaves an incomplete (ignored) folder, not a broken one.
        (folder / MARKER).unlink()
        shutil.rmtree(folder)
        shutil.rmtree(Path(root) / f"{tag_for(step)}-universal", ignore_errors=True)
    return doomed


def load_fp32_state_dict(root: Path, step: int) -> dict:
    """The full fp32 model state dict of a committed checkpoint, on CPU, for any ZeRO stage."""
    import torch

    read_marker(root, step)  # raises with the path if incomplete
    folder = Path(root) / tag_for(step)
    if list(folder.glob("*optim_states.pt")) and (list(folder.glob("zero_pp_rank_*")) or list(folder.glob("bf16_zero_pp_rank_*"))):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag_for(step))
    else:
        model_file = folder / "mp_rank_00_model_states.pt"
        if not model_file.is_file():
            raise CheckpointError(f"checkpoint {folder} has no mp_rank_00_model_states.pt")
        state = torch.load(model_file, map_location="cpu", weights_only=False)["module"]
    return {k: v.float() for k, v in state.items()}


def universal_tag(root: Path, step: int, rank: int) -> str:
    """Tag of a universal (world-size-independent) copy of checkpoint `step`, made once by rank 0.

    DeepSpeed's ds_to_universal merges the ZeRO partitions into per-parameter files that any world size can load
    (with `checkpoint.load_universal` in the DeepSpeed config). The copy is written to a temporary folder and
    renamed when complete; the original checkpoint is never modified.
    """
    import subprocess
    import sys

    import torch.distributed as dist

    tag = f"{tag_for(step)}-universal"
    target = Path(root) / tag
    if rank == 0 and not (target / "zero").is_dir():
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
