"""One training run per state folder: an exclusive lock on `<state_dir>/run.lock` that names its holder.

The launcher takes it before any rank starts and before the job's log is opened, so a second run on the same name
is refused without touching the first run's log or checkpoints. The kernel drops a flock when the last process
holding its file descriptor dies, however it dies, so a crashed run never blocks its rerun. The launcher hands the
descriptor to torchrun as well: the lock stays held while torchrun's ranks finish a checkpoint after the launcher
itself was killed. The file holds the holder's pid, host and start time, for the refusal message.

The data stages (corpus, tokenizer, shards) take the same kind of lock per job through `stage_job_log`: a second
pipeline running the same job on the same name (say with `snakemake --nolock`) is refused naming the holder, before
it writes anything. Each job's log is its own file in `<log stem>.attempts/`, the declared log a second name for it:
Snakemake deletes a job's declared log before it starts it, which, for a job that some other pipeline still runs,
would take that job's record with it.
"""
from __future__ import annotations

import contextlib
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
    return _acquire_file(path, lambda: f"another training run ({holder(path)}) holds {state_dir}: two runs must "
                                       "never write the same checkpoints; wait for it to finish or stop it, then run "
                                       "again")


def _acquire_file(path: Path, refusal):
    """An exclusive flock on `path`, which then names this process; StateInUse(refusal()) when another holds it."""
    handle = open(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise StateInUse(refusal()) from None
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "started_at": time.strftime("%Y-%m-%d %H:%M:%S %z")}))
    handle.flush()
    return handle


@contextlib.contextmanager
def stage_job_log(log_path: str, what: str):
    """For one data-stage job: its lock (refused, naming the holder, while another pipeline runs the same job), then
    `logs.job_log` into a new file of `<log stem>.attempts/`, which `log_path` names while the job runs and after it
    (re-pointed at the end, in case another pipeline's Snakemake deleted the name meanwhile)."""
    from pretrain_bench.core.logs import job_log

    log = Path(log_path)
    attempt = attempt_path(log)
    lock_path = attempt.parent / "job.lock"
    lock = _acquire_file(lock_path, lambda: (
        f"another pipeline ({holder(lock_path)}) is running {what} for these outputs right now (its log: "
        f"{log}): two jobs must never write the same files; wait for it to finish, or stop it, then run again"))
    with lock:
        attempt.touch()
        point_log_at(log, attempt)
        try:
            with job_log(str(attempt), what) as logger:
                yield logger
        finally:
            point_log_at(log, attempt)


def attempt_path(log: Path) -> Path:
    """A new attempt's own log file for the declared `log`: `<log stem>.attempts/<start time>-pid<N>.log` (the folder
    is made; the file is not)."""
    attempts = Path(log).with_name(Path(log).stem + ".attempts")
    attempts.mkdir(parents=True, exist_ok=True)
    return attempts / f"{time.strftime('%Y%m%dT%H%M%S')}-pid{os.getpid()}.log"


def point_log_at(log: Path, attempt: Path) -> None:
    """Make `log` a hard link to `attempt`, replacing whatever it named (never writing into that file)."""
    with contextlib.suppress(OSError):
        if os.path.samefile(log, attempt):
            return  # already its name
    tmp = log.with_name(f"{log.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(attempt, tmp)
    except OSError:  # a file system without hard links
        tmp.symlink_to(attempt.resolve())
    os.replace(tmp, log)
    # rename() between two names of one file does nothing and succeeds (POSIX), leaving the temporary name behind
    tmp.unlink(missing_ok=True)
