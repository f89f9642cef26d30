"""Files written whole or not at all, JSON-lines files read back, and the keys of a record read back checked against
the dataclass it becomes.

`atomic_write_text` writes to a temporary file in the target's folder, named per writer (pid and a random part), so
two processes writing the same path never share a temporary file; it is flushed to disk (fsync) and then renamed
onto the target (os.replace), so a reader sees the old file or the new one, never half of one. Checkpoints do not use
it: `pretrain_bench.train.checkpoints.files` adds its own sizes, hashes and commit marker.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import secrets
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)


class DiskFull(OSError):
    """A write that ran out of space, naming the file and the free space it needs (`disk_full`)."""

    def __str__(self) -> str:
        return self.strerror


def disk_full(path: Path, needed_bytes: int | None, error: OSError | None = None) -> DiskFull:
    """The error for `path` whose write ran out of space: the file, the free space on its file system, and (where
    known) about how much more it needs."""
    probe = Path(path).parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    need = f"; it needs about {needed_bytes:,} bytes in all: free that much there and run again" if needed_bytes else ""
    full = DiskFull(errno.ENOSPC, f"no space left on device writing {path} ({free:,} bytes free on the file system "
                                  f"of {probe}){need}")
    full.filename = str(path)
    return full


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` (UTF-8) in one rename; the temporary file is removed if anything fails."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, data, **dumps) -> None:
    """`atomic_write_text` of `json.dumps(data, indent=2, **dumps)` (keyword arguments as json.dumps takes them)."""
    atomic_write_text(path, json.dumps(data, **{"indent": 2, **dumps}))


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file (blank lines skipped); [] when there is no such file.

    A last line that is not JSON and has no newline after it is a record whose append was cut short (a crash, a
    full disk): it is dropped with a warning naming the file. Anything else that is not JSON raises ValueError
    naming the file and line."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = path.read_text().split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            if number == len(lines):  # no newline after it
                logger.warning(f"{path}: dropped its last line ({len(line.encode())} bytes), a record cut short "
                               f"while it was written: {line[:60]!r}")
                continue
            raise ValueError(f"{path} line {number} is not JSON ({error}): {line[:60]!r}; a record cut short can only "
                             "be the last line, so this file was edited or damaged") from error
    return records


def key_differences(record_type, data: dict, *, defaults_optional: bool = True) -> tuple[list[str], list[str]]:
    """(missing, unknown), each sorted: the fields of dataclass `record_type` that `data` lacks (a field with a default
    may be absent unless `defaults_optional` is false) and the keys of `data` that name no field of it."""
    fields = dataclasses.fields(record_type)
    required = {f.name for f in fields if not defaults_optional or f.default is dataclasses.MISSING}
    return sorted(required - set(data)), sorted(set(data) - {f.name for f in fields})
