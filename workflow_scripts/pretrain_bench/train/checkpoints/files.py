"""Self-describing, commit-marked, self-verifying checkpoints and their discovery, pruning and conversion.

A DeepSpeed checkpoint is written by every rank into `<root>/step<N>/`. It counts only once rank 0 has written
`<root>/step<N>/COMMITTED.json` after a barrier: a crash mid-save leaves a folder without the marker, which resume
and evaluation ignore. The marker repeats the client state (step, data position, config hash) so a reader needs
no torch to see what a checkpoint holds, and lists every file with its size and sha256.

Integrity: every file a rank saves goes through `CheckpointWriter`, which hashes the bytes as they are written (never
read back) and fsyncs the file; the marker is written, fsynced and its folder fsynced last. Before a resume,
`newest_verified` checks the newest checkpoint: by default every byte of every file against the sha256 recorded at
save time (`train.verify_checkpoints: full`, files hashed in parallel), so nothing a resume loads has changed since it
was saved. `sampled` is the cheaper opt-out: sizes plus a hash of SAMPLE_BYTES at every SAMPLE_STRIDE bytes (about
1/64 of the data), which misses damage between the sampled windows. A damaged checkpoint is renamed aside
(`step<N>.damaged`) and the run falls back to the newest one that verifies.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pretrain_bench.config.schema import schema_default

# the hashing lives in core.digests (token shards are verified the same way); these names are the checkpoint's too
from pretrain_bench.core.digests import (  # noqa: F401
    SAMPLE_BYTES,
    SAMPLE_STRIDE,
    HashingFile,
    digest_file,
    full_digest,
    sampled_digest,
)
from pretrain_bench.train.settings import VERIFY_MODES

MARKER = "COMMITTED.json"
UNIVERSAL_SUFFIX = "-universal"  # step<N>-universal: DeepSpeed's world-size-independent copy of step<N>, pruned with it
_TAG = re.compile(r"^step(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, damaged or incompatible; the message names its path."""


class CheckpointSaveError(CheckpointError):
    """Writing a checkpoint failed; the message says which step, where, and why."""


def tag_for(step: int) -> str:
    return f"step{step}"


def save_failure(step: int, folder: Path, error: BaseException, writing: Path | None = None) -> str:
    """'saving checkpoint step N to <folder> failed: <reason>', with the free bytes when the disk is full.
    `writing`: the file being written, where the error itself does not name one (a failed write() names none)."""
    target = getattr(error, "filename", None) or writing or folder
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        probe = Path(folder)
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        reason = (f"no space left on device ({shutil.disk_usage(probe).free:,} bytes free on the file system of "
                  f"{probe}; writing {target})")
    elif isinstance(error, OSError):
        reason = f"{error.strerror or error} ({target})"
    else:
        reason = f"{type(error).__name__}: {error}"
    return f"saving checkpoint step {step} to {folder} failed: {reason}"


class CheckpointWriter:
    """What one rank writes into checkpoint `step`: every file hashed as it is written and fsynced.

    A write error is recorded (with the free space at that moment) rather than raised, and the partial file removed,
    so that this rank still takes part in DeepSpeed's collectives; the ranks then decide together that the save
    failed (Checkpointer.save). `save` has the signature of DeepSpeed's checkpoint engine's `save`, which it replaces.
    """

    def __init__(self, step: int, folder: Path, *, zipfile: bool = True, fail_after: int | None = None):
        self.step, self.folder, self.zipfile, self.fail_after = step, Path(folder), zipfile, fail_after
        self.files: dict[str, dict] = {}
        self.error: str | None = None

    def save(self, state_dict, path) -> None:
        import torch

        if self.error:
            return  # this save has already failed: write nothing more
        target = HashingFile(Path(path), self.fail_after)
        try:
            torch.save(state_dict, target, _use_new_zipfile_serialization=self.zipfile)
            record = target.close()
        except (OSError, RuntimeError) as error:
            self.error = save_failure(self.step, self.folder, target.error or error, writing=target.path)
            target.discard()
            return
        self.files[str(Path(path).resolve().relative_to(self.folder.resolve()))] = record


# --- the commit marker -------------------------------------------------------------------------------------------


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_marker(root: Path, step: int, info: dict, files: dict[str, dict] | None = None) -> None:
    """Commit checkpoint `step`: the marker lists every file of the folder (those in `files` as recorded while they
    were written, any other read and hashed here), is fsynced, and the folders holding it are fsynced after it."""
    folder = Path(root) / tag_for(step)
    files = dict(files or {})
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = str(path.relative_to(folder))
        if name not in files and name not in (MARKER, MARKER + ".tmp"):
            files[name] = digest_file(path)
    missing = sorted(name for name in files if not (folder / name).is_file())
    if missing:
        raise CheckpointError(f"checkpoint {folder} lacks {missing} after saving: not committed")
    tmp = folder / (MARKER + ".tmp")
    with open(tmp, "w") as handle:
        handle.write(json.dumps({"step": step, **info, "files": files}, indent=2, sort_keys=True))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, folder / MARKER)
    _fsync_dir(folder)  # the marker's name is durable …
    _fsync_dir(Path(root))  # … and so is the folder's


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
    try:
        text = path.read_text()
        marker = json.loads(text)
    except OSError as error:
        raise CheckpointError(f"{path} cannot be read: {error.strerror or error}") from error
    except ValueError as error:
        what = "empty" if not text.strip() else f"not valid JSON ({error})"
        raise CheckpointError(f"{path} is {what}: the save that wrote it did not reach the disk") from error
    if not isinstance(marker, dict) or marker.get("step") != step:
        raise CheckpointError(f"{path} does not describe step {step}")
    return marker


def readable_markers(root: Path) -> dict[int, dict]:
    """The markers of the committed checkpoints under root whose marker reads, by step (ascending). A marker that is
    empty or cut short (a save that never reached the disk) is passed over, as `newest_verified` later sets its folder
    aside: what a run decides before it resumes must not stop at a checkpoint the resume itself falls back from."""
    markers = {}
    for step in committed_steps(root):
        try:
            markers[step] = read_marker(root, step)
        except CheckpointError:
            continue
    return markers


def newest_readable_marker(root: Path) -> dict | None:
    """The marker of the newest committed checkpoint whose marker reads (None: none does); see readable_markers."""
    markers = readable_markers(root)
    return markers[max(markers)] if markers else None


def _file_problem(path: Path, record: dict, mode: str) -> str | None:
    """What is wrong with one listed file (None when it matches its record)."""
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != record["size"]:
        return f"{path} has {size:,} bytes, {record['size']:,} were saved"
    if mode == "full" and full_digest(path) != record["sha256"]:
        return f"{path} does not match the sha256 recorded when it was saved"
    if mode == "sampled" and sampled_digest(path, size) != record["sampled_sha256"]:
        return f"{path} does not match the sampled sha256 recorded when it was saved"
    return None


def verify(root: Path, step: int, mode: str | None = None) -> dict:
    """Check checkpoint `step` against its marker: every file present with its size and its whole sha256 (mode
    'full'), or its sampled sha256 (mode 'sampled'). Returns the marker; raises CheckpointError naming every bad
    file. No mode: train.verify_checkpoints' default."""
    mode = mode or schema_default("train", "verify_checkpoints")
    if mode not in VERIFY_MODES:
        raise ValueError(f"checkpoint verification mode {mode!r} is not one of {list(VERIFY_MODES)}")
    marker = read_marker(root, step)
    folder = Path(root) / tag_for(step)
    files = marker.get("files")
    if files is None:
        return marker  # committed before markers listed their files: nothing to verify against
    # hashlib releases the GIL while hashing, so threads hash one file per core: the ranks' shards in parallel
    with ThreadPoolExecutor(max_workers=max(1, min(len(files), os.cpu_count() or 1))) as pool:
        found = pool.map(lambda item: _file_problem(folder / item[0], item[1], mode), sorted(files.items()))
        problems = [problem for problem in found if problem]
    if problems:
        raise CheckpointError(f"checkpoint {folder} is damaged: {'; '.join(problems)}")
    return marker


def aside_path(root: Path, step: int, reason: str = "damaged") -> Path:
    """Where `set_aside` moves checkpoint `step`: `step<N>.<reason>`, or `.<reason>2`, … when that exists."""
    folder = Path(root) / tag_for(step)
    target, n = folder.with_name(f"{folder.name}.{reason}"), 1
    while target.exists():
        n += 1
        target = folder.with_name(f"{folder.name}.{reason}{n}")
    return target


def set_aside(root: Path, step: int, reason: str = "damaged") -> Path:
    """Rename a checkpoint out of the way (`step<N>.damaged`, `.damaged2`, …; `.nonfinite` for one whose resume
    gave a non-finite loss): kept for inspection, never loaded, pruned or exported again."""
    target = aside_path(root, step, reason)
    os.replace(Path(root) / tag_for(step), target)
    return target


def set_aside_steps(root: Path, reason: str) -> list[int]:
    """Steps of the checkpoints set aside for `reason` under root, ascending."""
    pattern = re.compile(rf"^step(\d+)\.{re.escape(reason)}\d*$")
    root = Path(root)
    found = (pattern.match(child.name) for child in root.iterdir()) if root.is_dir() else ()
    return sorted(int(match.group(1)) for match in found if match)


def newest_verified(root: Path, mode: str | None = None, warn=print) -> int | None:
    """The newest committed checkpoint that verifies (None when there is none at all).

    Newer ones that fail are set aside with a warning naming the bad file. When none verifies nothing is moved and
    CheckpointError names every checkpoint and its bad files: starting over must be the user's decision.
    """
    steps = committed_steps(root)
    problems: dict[int, str] = {}
    good = None
    for step in reversed(steps):
        try:
            verify(root, step, mode)
        except CheckpointError as error:
            problems[step] = str(error)
            continue
        good = step
        break
    if steps and good is None:
        raise CheckpointError(
            f"no checkpoint in {root} verifies, so there is nothing to resume from:\n  "
            + "\n  ".join(problems[s] for s in sorted(problems, reverse=True))
            + f"\nmove {root} away to start over, or restore the files named above")
    for step, problem in sorted(problems.items(), reverse=True):
        aside = set_aside(root, step)
        warn(f"warning: {problem}. Moved it aside to {aside}; falling back to checkpoint step {good}")
    return good


def remove_incomplete(root: Path) -> list[Path]:
    """Delete step folders without a marker: saves that crashed or failed. Only the run holding the state lock may
    call this, so no save of another run can be in flight."""
    root = Path(root)
    removed = []
    if root.is_dir():
        for child in sorted(root.iterdir()):
            if _TAG.match(child.name) and child.is_dir() and not (child / MARKER).exists():
                shutil.rmtree(child)
                removed.append(child)
    return removed


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
        shutil.rmtree(Path(root) / f"{tag_for(step)}{UNIVERSAL_SUFFIX}", ignore_errors=True)
    return doomed
