"""What decides a checkpoint evaluation's result, recorded with it: the checkpoint's bytes (the digest of its commit
marker, which lists each of its files with its size and sha256) and the evaluate settings.

Rule evaluate records both in eval/step<N>.json (`evaluated_with`); before a run that only trains on (a raised
train.max_steps), rules/common.smk compares them with the checkpoint and settings of now, and keeps an evaluation
that still matches instead of making it again.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pretrain_bench.train.checkpoints.files import MARKER, tag_for

STAMP = "evaluated_with"


def marker_digest(state_dir: Path, step: int) -> str | None:
    """sha256 of checkpoint `step`'s commit marker under `state_dir`, None while there is none."""
    path = Path(state_dir) / "checkpoints" / tag_for(int(step)) / MARKER
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def evaluation_stamp(state_dir: Path, step: int, settings: dict) -> dict:
    """What an evaluation of checkpoint `step` with these evaluate settings is made from."""
    encoded = json.dumps(settings, sort_keys=True, default=str).encode()
    return {"checkpoint_marker_sha256": marker_digest(state_dir, step),
            "settings_sha256": hashlib.sha256(encoded).hexdigest()}


def evaluation_is_current(eval_path: Path, state_dir: Path, step: int, settings: dict) -> bool:
    """Whether eval/step<N>.json was made from checkpoint `step` as it is now, with these settings."""
    try:
        recorded = json.loads(Path(eval_path).read_text()).get(STAMP)
    except (OSError, ValueError, AttributeError):
        return False
    stamp = evaluation_stamp(state_dir, step, settings)
    return stamp["checkpoint_marker_sha256"] is not None and recorded == stamp


__all__ = ["STAMP", "evaluation_is_current", "evaluation_stamp", "marker_digest"]
