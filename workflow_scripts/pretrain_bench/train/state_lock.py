"""One training run per state folder: an exclusive lock on `<state_dir>/run.lock` that names its holder.

The launcher takes it before any rank starts and before the job's log is opened, so a second run on the same name
is refused without touching the first run's log or checkpoints. The kernel drops a flock when the last process
holding its file descriptor dies, however it dies, so a crashed run never blocks its rerun. The launcher hands the
descriptor to torchrun as well: the lock stays held while torchrun's ranks finish a checkpoint after the launcher
itself was killed. The file holds the holder's pid, host and start time, for the refusal message.

The data stages (corpus, tokenizer, shards) take the same kind of lock per product through `stage_job_log`, in
results/data/.locks/ (beside the shared products, so pipelines in other working directories that share results/data
see it too). A pipeline whose job finds another building the same product (two experiments at once with
`snakemake --nolock`) waits for it with a progress line ("waiting for pid N … building data/corpus-…"), then uses
the finished product instead of building it again: it never fails, so its Snakemake never deletes the other's
outputs. Each job's log is its own file in `<log stem>.attempts/`, the declared log a second name for it: Snakemake
deletes a job's declared log before it starts it, which, for a job that some other pipeline still runs, would take
that job's record with it.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

LOCK_FILE = "run.lock"
PRODUCT_LOCKS = Path("results/data/.locks")  # one lock file per data product job, named after its first output
WAIT_REPORT_S = 30.0  # how often a job waiting for another pipeline's says so
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


@dataclass
class StageJob:
    """What `stage_job_log` yields: `reused` when another pipeline finished building this job's outputs while this
    job waited for it (the caller then writes nothing), and the logger of the job's log."""

    reused: bool
    logger: object


def product_lock_path(output: str) -> Path:
    """The lock file of the data product `output` (a job's first output): under PRODUCT_LOCKS by its path below
    results/data, else beside it."""
    path = Path(output)
    try:
        return PRODUCT_LOCKS / f"{path.relative_to('results/data')}.lock"
    except ValueError:
        return path.with_name(f".{path.name}.lock")


def _process_start() -> float:
    """When this process started (epoch seconds): Snakemake deleted the job's outputs before that."""
    import psutil

    return psutil.Process().create_time()


def _wait_for_product(lock_path: Path, product: str, say) -> tuple:
    """An exclusive flock on `lock_path`, waiting while another process holds it and calling `say` with a progress
    line at once and every WAIT_REPORT_S; returns (the open lock file, the holder's record as it was left)."""
    handle = open(os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644), "r+")
    started, reported = time.monotonic(), None
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            now = time.monotonic()
            if reported is None or now - reported >= WAIT_REPORT_S:
                who = holder(lock_path).split(",")[0]
                say(f"waiting for {who} building {product} ({now - started:.0f} s so far; another pipeline's job, "
                    "whose product this job then uses)")
                reported = now
            time.sleep(0.5)
    handle.seek(0)
    try:
        record = json.loads(handle.read() or "{}")
    except ValueError:
        record = {}
    return handle, record


def _write_record(handle, **extra) -> None:
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "started_at": time.strftime("%Y-%m-%d %H:%M:%S %z"), **extra}))
    handle.flush()


@contextlib.contextmanager
def stage_job_log(log_path: str, what: str, outputs=()):
    """For one data-stage job writing `outputs`: the product's lock (waiting, with a progress line, while another
    pipeline builds the same product), then `logs.job_log` into a new file of `<log stem>.attempts/`, which
    `log_path` names while the job runs and after it (re-pointed at the end, in case another pipeline's Snakemake
    deleted the name meanwhile). Yields a StageJob: `reused` when the other pipeline finished every output after this
    job's process started (its Snakemake had already deleted the old ones), so the job is done."""
    from pretrain_bench.core.logs import job_log

    log = Path(log_path)
    attempt = attempt_path(log)
    outputs = [str(output) for output in outputs]
    lock_path = product_lock_path(outputs[0]) if outputs else attempt.parent / "job.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    product = str(Path(outputs[0]).parent.relative_to("results")) if outputs and outputs[0].startswith(
        "results/") else (outputs[0] if outputs else what)
    attempt.touch()
    point_log_at(log, attempt)
    with open(attempt, "a", buffering=1) as early:
        def say(line: str) -> None:
            early.write(f"{time.strftime('%H:%M:%S')} {line}\n")
            print(f"{what}: {line}", file=sys.stderr, flush=True)

        lock, record = _wait_for_product(lock_path, product, say)
    with lock:
        reused = (bool(outputs) and record.get("finished_at", 0) >= _process_start()
                  and all(Path(output).exists() for output in outputs))
        _write_record(lock)
        try:
            with job_log(str(attempt), what, append=True) as logger:
                if reused:
                    logger.info("%s: pid %s finished building %s while this job waited: using it", what,
                                record.get("pid"), product)
                yield StageJob(reused=reused, logger=logger)
            _write_record(lock, finished_at=time.time(), outputs=outputs)
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


def snakemake_lock_note(locks: Path, argv: list[str]) -> str | None:
    """A note for the terminal when another Snakemake holds this working directory's lock (its files in `locks`,
    .snakemake/locks) and this one, whose command line is `argv`, takes it (no --nolock, no --dry-run): Snakemake's
    own refusal says only "Directory cannot be locked". None otherwise."""
    if {"--nolock", "-n", "--dry-run", "--dryrun", "--unlock"} & set(argv) or not any(Path(locks).glob("*.lock")):
        return None
    return ("another Snakemake holds this working directory's lock (.snakemake/locks). If this one is refused with "
            "\"Directory cannot be locked\": to run two experiments at once, add --nolock, which is safe here: each "
            "data product has its own lock (a job that finds another pipeline building the same product waits for "
            "it, then uses it) and each run its state lock (a second run on the same name is refused). If no other "
            "Snakemake is running, `snakemake --unlock` clears the lock a killed one left.")
