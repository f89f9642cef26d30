"""Which training run the state folder holds, and what a rerun does with it.

results/<name>/state/ holds one run's resumable state (checkpoints/, metrics.jsonl, tensorboard/), outside the
pretrain rule's declared outputs. ACTIVE.json names the run it belongs to by its resume fingerprint (what must not
change between a checkpoint and the run that resumes it: model, data, and the train settings that shape the
weights). When the pretrain job starts, rank 0 decides before anything loads:

- same fingerprint, not finished (or finished with fewer steps than now asked): resume from the newest checkpoint
  — a compatible edit such as more `train.max_steps` continues the run;
- another fingerprint (learning rate, model shape, data … changed): the old run moves, whole, to
  state/runs/<its fingerprint id>/ and training starts fresh; a later edit back to those settings moves it back
  and resumes it;
- same fingerprint and already finished at exactly the steps now asked:
  - with the very same plan (`--forcerun pretrain`, or deleted outputs), that is a request to train again: the
    finished run moves to state/runs/<id>-<UTC time>/ and training starts fresh;
  - with a plan that differs only where the weights do not (say `train.warmup_timing_steps`), the run resumes at
    its last step and rewrites its outputs, when every checkpoint the plan keeps exists; else it trains again.

Nothing is deleted; every move is logged with both paths.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from .checkpoint import committed_steps, read_marker
from .io import atomic_write_json

ACTIVE = "ACTIVE.json"
FINISHED = "FINISHED.json"
# What belongs to one run; run.lock (held by the running job) and nvme/ (scratch) stay where they are.
RUN_ITEMS = ("checkpoints", "metrics.jsonl", "tensorboard", ACTIVE, FINISHED)


def fingerprint_id(fingerprint: dict) -> str:
    """A short, stable name for a fingerprint (folder names, logs)."""
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:12]


def _held_fingerprint(state_dir: Path) -> dict | None:
    """The fingerprint of the run the state folder holds: ACTIVE.json, else the newest checkpoint's marker."""
    active = state_dir / ACTIVE
    if active.is_file():
        return json.loads(active.read_text())["fingerprint"]
    steps = committed_steps(state_dir / "checkpoints")
    return read_marker(state_dir / "checkpoints", steps[-1])["fingerprint"] if steps else None


def _holds_anything(state_dir: Path) -> bool:
    return any((state_dir / item).exists() for item in RUN_ITEMS)


def _move_run(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for item in RUN_ITEMS:
        if (src / item).exists():
            os.replace(src / item, dst / item)


def changed_parts(old: dict, new: dict) -> list[str]:
    """'train.lr', 'model', 'data' … : what differs between two fingerprints."""
    parts = []
    for key in sorted(set(old) | set(new)):
        if isinstance(old.get(key), dict) and isinstance(new.get(key), dict):
            parts += [f"{key}.{k}" for k in sorted(set(old[key]) | set(new[key])) if old[key].get(k) != new[key].get(k)]
        elif old.get(key) != new.get(key):
            parts.append(key)
    return parts


def prepare_state(state_dir: Path, fingerprint: dict, total_steps: int, digest: str,
                  needed_steps: list[int]) -> list[str]:
    """Make `state_dir` hold the run this fingerprint resumes (or nothing, to start fresh); returns log lines.

    Rank 0 only, with the state lock held, before any rank reads a checkpoint.
    """
    state_dir = Path(state_dir)
    runs = state_dir / "runs"
    new_id = fingerprint_id(fingerprint)
    messages = []
    held = _held_fingerprint(state_dir) if _holds_anything(state_dir) else None
    if _holds_anything(state_dir) and held != fingerprint:
        old_id = fingerprint_id(held) if held else "unknown"
        target = runs / old_id
        if target.exists():
            target = runs / f"{old_id}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
        _move_run(state_dir, target)
        what = ", ".join(changed_parts(held, fingerprint)) if held else "no fingerprint recorded"
        messages.append(f"the settings changed since the run in {state_dir} ({what}): that run is kept in "
                        f"{target}; this run ({new_id}) starts fresh")
    elif (state_dir / FINISHED).is_file() and json.loads((state_dir / FINISHED).read_text())["steps"] == total_steps:
        finished = json.loads((state_dir / FINISHED).read_text())
        kept = set(committed_steps(state_dir / "checkpoints"))
        if finished.get("plan_digest") != digest and set(needed_steps) <= kept:
            messages.append(f"the run in {state_dir} already finished step {total_steps}, and the plan changed only "
                            "where the weights do not: resuming at its last step to rewrite the outputs")
        else:
            why = ("with the same plan: training again from scratch" if finished.get("plan_digest") == digest else
                   f"but the plan keeps checkpoints {sorted(set(needed_steps) - kept)} that it does not have: "
                   "training again from scratch")
            target = runs / f"{new_id}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
            _move_run(state_dir, target)
            messages.append(f"the run in {state_dir} already finished step {total_steps} {why}; the finished run "
                            f"is kept in {target}")
    if not _holds_anything(state_dir) and (runs / new_id).is_dir():
        _move_run(runs / new_id, state_dir)
        (runs / new_id).rmdir()
        messages.append(f"these settings were trained before: resuming the run kept in {runs / new_id}")
    # Nothing else is written: a run refused after this (say, a checkpoint beyond train.max_steps) leaves the folder
    # as it was. FINISHED.json stays until this job finishes and rewrites it; it only counts for its exact step count.
    active = {"fingerprint": fingerprint, "id": new_id}
    if not (state_dir / ACTIVE).is_file() or json.loads((state_dir / ACTIVE).read_text()) != active:
        atomic_write_json(state_dir / ACTIVE, active, sort_keys=True)
    return messages


def mark_finished(state_dir: Path, steps: int, digest: str) -> None:
    """Record that the run in `state_dir` completed `steps` steps under the plan with this digest."""
    atomic_write_json(Path(state_dir) / FINISHED, {"steps": steps, "plan_digest": digest, "finished_at": time.time()},
                      sort_keys=True)


def plan_digest(plan) -> str:
    """Digest of a plan (a Plan) as the plan rule wrote it."""
    written = plan.to_dict()
    return hashlib.sha256(json.dumps(written, sort_keys=True, default=str).encode()).hexdigest()


__all__ = ["changed_parts", "fingerprint_id", "mark_finished", "plan_digest", "prepare_state"]
