"""Which training run the state folder holds, and what a rerun does with it.

results/<name>/state/ holds one run's resumable state (checkpoints/, metrics.jsonl, each tracker's folder), outside the
pretrain rule's declared outputs. ACTIVE.json names the run it belongs to by its resume fingerprint (what must not
change between a checkpoint and the run that resumes it: model, data, and the train settings that shape the
weights). When the pretrain job starts, rank 0 decides before anything loads:

- same fingerprint, not finished (or finished with fewer steps than now asked): resume from the newest checkpoint
  — a compatible edit such as more `train.max_steps` continues the run;
- another fingerprint (learning rate, model shape, data … changed): the old run moves, whole, to
  state/runs/<its fingerprint id>/ and training starts fresh; a later edit back to those settings moves it back
  and resumes it;
- same fingerprint, another world size (train.gpus × train.nodes) than its newest checkpoint: with
  `train.allow_reshape` an unfinished run resumes at the new size; otherwise, or when it had finished, the old run
  moves to state/runs/<id>-world<its size>/ and training starts fresh (an edit back to that size resumes it);
- same fingerprint and already finished at exactly the steps now asked (outputs deleted or marked incomplete,
  `--forcerun pretrain`, or an edit where the weights do not change, say `train.warmup_timing_steps`): it is never
  trained again; the run resumes at its final checkpoint and rewrites its outputs. Its summary keeps what the run
  that trained measured (SUMMARY, kept here when it finished): byte for byte under the same plan, else the figures
  only a training process measures (run_summary.MEASURED_WHILE_TRAINING); the launcher says so on the terminal.
  Only when the plan changed and keeps checkpoints the run does not have (`train.checkpoint_every` edited) does it
  move to state/runs/<id>-<UTC time>/ and train again. To train the same settings again from step 0, move the
  state folder away first.

Nothing is deleted; every move is logged with both paths.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import NamedTuple

from pretrain_bench.config.schema import ModelSettings, keys_with
from pretrain_bench.core.io import atomic_write_json
from pretrain_bench.train.checkpoints.files import newest_readable_marker, readable_markers
from pretrain_bench.train.run_summary import RunSummary
from pretrain_bench.train.settings import RESUMABLE_KEYS
from pretrain_bench.train.trackers import TRACKER_FOLDERS

ACTIVE = "ACTIVE.json"
FINISHED = "FINISHED.json"
SUMMARY = "summary.json"  # the finished run's summary.json as it wrote it (the outputs may be deleted, not this)
# What belongs to one run: its checkpoints, metrics, every tracker's folder (train.loggers) and markers; run.lock
# (held by the running job) and nvme/ (scratch) stay where they are.
RUN_ITEMS = ("checkpoints", "metrics.jsonl", *TRACKER_FOLDERS, ACTIVE, FINISHED, SUMMARY)


def resume_fingerprint(plan) -> dict:
    """What must not change between a checkpoint and the run that resumes it."""
    train = {k: v for k, v in plan.train.as_dict().items() if k not in RESUMABLE_KEYS}
    # the attention kernel may change on resume, as train.compile may: the same maths through another kernel
    model = {k: v for k, v in plan.model.as_dict().items() if k not in keys_with(ModelSettings, "fingerprint", False)}
    fingerprint = {"model": model, "train": train, "data": plan.data_sha256}
    if plan.init_from:  # other weights at the same path or hf:// revision are another run
        fingerprint["init_from"] = plan.init_from["identity"]
    return fingerprint


def fingerprint_id(fingerprint: dict) -> str:
    """A short, stable name for a fingerprint (folder names, logs)."""
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:12]


def _held_fingerprint(state_dir: Path) -> dict | None:
    """The fingerprint of the run the state folder holds: ACTIVE.json, else the newest checkpoint's marker."""
    active = state_dir / ACTIVE
    if active.is_file():
        return json.loads(active.read_text())["fingerprint"]
    marker = newest_readable_marker(state_dir / "checkpoints")
    return marker["fingerprint"] if marker else None


def held_world_size(state_dir: Path) -> int | None:
    """The world size the newest committed checkpoint in `state_dir` was saved with (None: no checkpoint). A marker
    that does not read (a save that never reached the disk) is passed over: the resume sets that checkpoint aside
    and falls back to the one before it (checkpoint.newest_verified)."""
    marker = newest_readable_marker(Path(state_dir) / "checkpoints")
    return marker.get("world_size") if marker else None


def _holds_anything(state_dir: Path) -> bool:
    return any((state_dir / item).exists() for item in RUN_ITEMS)


def _move_run(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for item in RUN_ITEMS:
        if (src / item).exists():
            os.replace(src / item, dst / item)


def _free_name(path: Path) -> Path:
    """`path`, or `path`-<UTC time> when that is taken."""
    return path.with_name(f"{path.name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}") if path.exists() else path


def _finished_steps(state_dir: Path) -> int | None:
    finished = state_dir / FINISHED
    return json.loads(finished.read_text())["steps"] if finished.is_file() else None


def changed_parts(old: dict, new: dict) -> list[str]:
    """'train.lr', 'model', 'data' … : what differs between two fingerprints."""
    parts = []
    for key in sorted(set(old) | set(new)):
        if isinstance(old.get(key), dict) and isinstance(new.get(key), dict):
            parts += [f"{key}.{k}" for k in sorted(set(old[key]) | set(new[key])) if old[key].get(k) != new[key].get(k)]
        elif old.get(key) != new.get(key):
            parts.append(key)
    return parts


def prepare_state(state_dir: Path, fingerprint: dict, total_steps: int, digest: str, needed_steps: list[int],
                  world_size: int, allow_reshape: bool = False) -> list[str]:
    """Make `state_dir` hold the run this fingerprint resumes (or nothing, to start fresh); returns log lines, one per
    decision: where a held run is set aside and a kept one of these settings comes back, one line says both.

    Rank 0 only, with the state lock held, before any rank reads a checkpoint.
    """
    state_dir = Path(state_dir)
    runs, new_id = state_dir / "runs", fingerprint_id(fingerprint)
    held = _held_fingerprint(state_dir) if _holds_anything(state_dir) else None
    held_size = held_world_size(state_dir)
    set_aside: SetAside | None = None  # what was done with the held run, when it moved away
    messages: list[str] = []
    if _holds_anything(state_dir) and held != fingerprint:
        set_aside = _set_aside_other_settings(state_dir, held, fingerprint)
    elif held_size is not None and held_size != world_size:
        if allow_reshape and _finished_steps(state_dir) != total_steps:
            messages = [f"the run in {state_dir} was saved at world size {held_size}, this run has {world_size} "
                        "(train.gpus × train.nodes): resuming it reshaped (train.allow_reshape)"]
        else:
            set_aside = _world_size_changed(state_dir, new_id, held_size, world_size, allow_reshape)
    elif _finished_steps(state_dir) == total_steps:
        messages = [_finished_run(state_dir, new_id, total_steps, digest, needed_steps)]
    brought = None if _holds_anything(state_dir) else _bring_back(runs, new_id, world_size, allow_reshape, state_dir)
    size = held_world_size(state_dir) if brought else None
    resumed = (f"resuming the run kept in {brought} (these settings"
               + (f", saved at world size {size})" if size else ")") if brought else None)
    if set_aside is not None:
        # one line: where the held run went, then what this run does (resumes the kept one, or starts fresh)
        fresh = f"this run ({new_id}) starts fresh" + (f" ({set_aside.why_fresh})" if set_aside.why_fresh else "")
        messages = [f"{set_aside.what}; {resumed or fresh}"]
    elif resumed:
        messages.append(f"these settings were trained before: {resumed}")
    if brought and _finished_steps(state_dir) == total_steps:  # a finished run came back: not trained again
        messages.append(_finished_run(state_dir, new_id, total_steps, digest, needed_steps))
    # Nothing else is written: a run refused after this (say, a checkpoint beyond train.max_steps) leaves the folder
    # as it was. FINISHED.json stays until this job finishes and rewrites it; it only counts for its exact step count.
    active = {"fingerprint": fingerprint, "id": new_id}
    if not (state_dir / ACTIVE).is_file() or json.loads((state_dir / ACTIVE).read_text()) != active:
        atomic_write_json(state_dir / ACTIVE, active, sort_keys=True)
    return messages


class SetAside(NamedTuple):
    """What became of a held run this one does not continue: `what` (why it moved and where), and `why_fresh`, the
    reason said when this run then starts fresh (None: the move says it)."""

    what: str
    why_fresh: str | None


def _set_aside_other_settings(state_dir: Path, held: dict | None, fingerprint: dict) -> SetAside:
    """Another fingerprint: the held run moves to runs/<its id>/."""
    old_id = fingerprint_id(held) if held else "unknown"
    target = _free_name(state_dir / "runs" / old_id)
    _move_run(state_dir, target)
    what = ", ".join(changed_parts(held, fingerprint)) if held else "no fingerprint recorded"
    return SetAside(f"the settings changed since the run in {state_dir} ({what}): that run is kept in {target}", None)


def _world_size_changed(state_dir: Path, new_id: str, held_size: int, world_size: int,
                        allow_reshape: bool) -> SetAside:
    """Same settings at another world size, not resumed reshaped: the held run moves to runs/<id>-world<its size>/."""
    target = _free_name(state_dir / "runs" / f"{new_id}-world{held_size}")
    _move_run(state_dir, target)
    why = ("it had finished, so there is nothing to continue" if allow_reshape else
           "set train.allow_reshape: true to continue it at the new size instead")
    return SetAside(f"the world size changed since the run in {state_dir} (train.gpus × train.nodes: {held_size} → "
                    f"{world_size}): that run is kept in {target} and resumes when the world size is {held_size} "
                    "again", why)


def _finished_run(state_dir: Path, new_id: str, total_steps: int, digest: str, needed_steps: list[int]) -> str:
    """Same settings, finished at exactly these steps: rewrite the outputs from the final checkpoint, unless the plan
    keeps checkpoints the run never saved (train.checkpoint_every edited); then it trains again beside the old run."""
    finished = json.loads((state_dir / FINISHED).read_text())
    kept = set(readable_markers(state_dir / "checkpoints"))
    if finished.get("plan_digest") == digest or set(needed_steps) <= kept:
        how = ("resuming at its final checkpoint to rewrite the outputs, no step is trained again"
               if total_steps in kept else
               f"its final checkpoint is gone, so the steps after {max(kept, default=0)} (its newest) are trained "
               "again")
        return (f"the run in {state_dir} already finished step {total_steps}: {how} (to train from step 0 instead, "
                f"move {state_dir} away first)")
    target = state_dir / "runs" / f"{new_id}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    _move_run(state_dir, target)
    return (f"the run in {state_dir} already finished step {total_steps}, but the plan keeps checkpoints "
            f"{sorted(set(needed_steps) - kept)} that it does not have: training again from scratch; the finished "
            f"run is kept in {target}")


def _bring_back(runs: Path, new_id: str, world_size: int, allow_reshape: bool, state_dir: Path) -> Path | None:
    """Move a kept run of these settings back into the empty `state_dir`: the one set aside at this world size,
    else the one set aside for other settings, when its world size is this one (or train.allow_reshape). Returns
    where it was kept (None: nothing came back)."""
    for kept in (runs / f"{new_id}-world{world_size}", runs / new_id):
        if not kept.is_dir():
            continue
        size = held_world_size(kept)
        if size is not None and size != world_size and not allow_reshape:
            continue
        _move_run(kept, state_dir)
        kept.rmdir()
        return kept
    return None


def mark_finished(state_dir: Path, steps: int, digest: str, summary: Path | None = None) -> None:
    """Record that the run in `state_dir` completed `steps` steps under the plan with this digest, keeping a copy of
    its `summary` file (summary.json) for the jobs that rewrite its outputs without training (kept_summary)."""
    if summary is not None:
        tmp = Path(state_dir) / f"{SUMMARY}.{os.getpid()}.tmp"
        shutil.copyfile(summary, tmp)
        os.replace(tmp, Path(state_dir) / SUMMARY)
    atomic_write_json(Path(state_dir) / FINISHED, {"steps": steps, "plan_digest": digest, "finished_at": time.time()},
                      sort_keys=True)


class KeptSummary(NamedTuple):
    """The summary a finished run kept in its state folder (mark_finished)."""

    path: Path
    summary: dict
    same_plan: bool  # finished under the plan with this digest: the file is the outputs' summary.json, byte for byte


def kept_summary(state_dir: Path, steps: int, digest: str) -> KeptSummary | None:
    """The summary of the run in `state_dir` when it finished exactly `steps` steps and kept one this code reads
    (None otherwise: a run finished before summaries were kept, or one of another summary version, which the job
    then writes anew)."""
    state_dir = Path(state_dir)
    finished, path = _finished(state_dir), state_dir / SUMMARY
    if not finished or finished["steps"] != steps or not path.is_file():
        return None
    try:
        summary = RunSummary.read(path).to_dict()
    except (OSError, ValueError):  # SummaryError is a ValueError, as a file cut short is
        return None
    return KeptSummary(path, summary, finished.get("plan_digest") == digest)


def already_finished(state_dir: Path, plan) -> str | None:
    """What the terminal is told when the run in `state_dir` is the one `plan` asks for, finished at exactly its steps,
    with its final checkpoint: its outputs are written again from that checkpoint and no step is trained (None
    otherwise). The same decision prepare_state takes when the job starts."""
    state_dir, settings = Path(state_dir), plan.train
    total_steps = settings.total_steps(plan.model.seq_len)
    if not _holds_anything(state_dir) or _held_fingerprint(state_dir) != resume_fingerprint(plan):
        return None
    if held_world_size(state_dir) not in (None, settings.world_size) or _finished_steps(state_dir) != total_steps:
        return None
    finished, kept = _finished(state_dir), set(readable_markers(state_dir / "checkpoints"))
    needed = settings.checkpoint_steps(plan.model.seq_len)
    if total_steps not in kept or not (finished.get("plan_digest") == plan_digest(plan) or set(needed) <= kept):
        return None
    return (f"the run in {state_dir} already finished step {total_steps}: its outputs are written again from its "
            f"final checkpoint with the figures it measured, no step is trained again (to train from step 0 instead, "
            f"move {state_dir} away first)")


def _finished(state_dir: Path) -> dict | None:
    path = Path(state_dir) / FINISHED
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None


def plan_digest(plan) -> str:
    """Digest of a plan (a Plan) as the plan rule wrote it."""
    written = plan.to_dict()
    return hashlib.sha256(json.dumps(written, sort_keys=True, default=str).encode()).hexdigest()


__all__ = ["KeptSummary", "already_finished", "changed_parts", "fingerprint_id", "held_world_size", "kept_summary",
           "mark_finished", "plan_digest", "prepare_state", "resume_fingerprint"]
