"""One training run per state folder: an exclusive lock on `<state_dir>/run.lock` that names its holder.

The launcher takes it before any rank starts and before the job's log is opened, so a second run on the same name
is refused without touching the first run's log or checkpoints. The kernel drops a flock when the last process
holding its file descriptor dies, however it dies, so a crashed run never blocks its rerun. The launcher hands the
descriptor to torchrun as well: the lock stays held while torchrun's ranks finish a checkpoint after the launcher
itself was killed. The file holds the holder's pid, host and start time, for the refusal message.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = "run.lock"
# Set in the ranks' environment when their launcher (or, multi-node, node rank 0's launcher) holds the lock, so
# rank 0 does not try to take it a second time; a rank started without the launcher takes it itself.
HELD_ENV = "PRETRAIN_BENCH_STATE_LOCK_HELD"


class StateInUse(RuntimeError):
    """Another training run holds the state folder; the message names it and its holder."""


def holder(lock_path: Path) -> str:
    """'pid N, started at T on host H' from a lock file, or what is known of it."""
    try:
        info = json.loads(Path(lock_path).read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info.get("pid"):
        return "holder unknown: it has not written its pid yet"
    return f"pid {info['pid']}, started at {info.get('started_at', '?')} on host {info.get('host', '?')}"


def acquire(state_dir: Path):
    """Lock `state_dir` for this process (and the children it passes the descriptor to); returns the open lock file,
    which must stay open for as long as the run writes there. Raises StateInUse naming the holder."""
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / LOCK_FILE
    handle = open(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise StateInUse(f"another training run ({holder(path)}) holds {state_dir}: two runs must never write the "
                         "same checkpoints; wait for it to finish or stop it, then run again") from None
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "started_at": time.strftime("%Y-%m-%d %H:%M:%S %z")}))
    handle.flush()
    return handle
