"""One way to log. The library logs through `logging` (a module-level `log = logging.getLogger(__name__)`); a process
decides once where that goes:

- a Snakemake adapter wraps its work in `with job_log(snakemake.log[0], "<script>"):` — the job's log file receives
  every library record, this process's stderr (tracebacks, other libraries' warnings) and, when the work fails, the
  error itself, so the log says why without Snakemake's console;
- a command-line entry point (launch.py, pretrain.py's ranks) calls `console_log()`: records go to stderr, which the
  launcher points at the job's attempt log.

Every process of a run also logs, through the same records, when it reached its first useful work (`log_startup`):
bench/bench_pipeline.py reads those lines back from the job logs to say what starting each process cost.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import time

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Launcher and rank lines: the training progress a user tails, one fact per line, without a logger name.
CONSOLE_FORMAT = "%(message)s"


@contextlib.contextmanager
def job_log(path: str, what: str, fmt: str = FORMAT, append: bool = False):
    """Send stderr and every `logging` record to `path` (line-buffered; after what it holds when `append`) for the
    duration; log a failure of `what` (the adapter's name) there, with its traceback, and re-raise it. Handlers are
    removed on exit, so tests may call adapters' `main` repeatedly."""
    with open(path, "a" if append else "w", buffering=1) as stream, contextlib.redirect_stderr(stream):
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter(fmt))
        root = logging.getLogger()
        level = root.level
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        logging.captureWarnings(True)
        try:
            yield logging.getLogger("pretrain_bench")
        except Exception:
            logging.getLogger("pretrain_bench").exception("%s failed", what)
            raise
        finally:
            logging.captureWarnings(False)
            root.removeHandler(handler)
            root.setLevel(level)


def console_log(fmt: str = CONSOLE_FORMAT) -> None:
    """Records to this process's stderr (file descriptor 2, wherever it points), flushed per record."""
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format=fmt, force=True)


def exit_without_teardown(code: int) -> None:
    """End a process whose work is done without the interpreter's module-by-module teardown of torch, DeepSpeed and
    transformers: about 1.5 s of CPU per process on 2 cores (measured), paid by every training rank and evaluation
    job after its files are written and closed. The atexit handlers still run and every log and stream is flushed
    first. For processes that import torch and write their outputs atomically (ranks, rule evaluate)."""
    finish_process()
    os._exit(code)


def finish_process() -> None:
    """What a process does at its end before it goes without teardown: its atexit handlers, every log and stream
    flushed (exit_without_teardown; a forked rank, pretrain_bench.train.forked_ranks, whose end torch's wrapper
    makes)."""
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()


# A start-up record's line: this prefix, then the record as JSON (read back by bench/bench_pipeline.py).
STARTUP_PREFIX = "start-up: "
# The libraries whose import is most of a process's start-up: a record names those loaded when it was taken.
HEAVY_LIBRARIES = ("torch", "torch._dynamo", "deepspeed", "transformers", "lm_eval", "mlflow", "wandb", "pandas",
                   "matplotlib")
_startup_logged: set[str] = set()


def log_startup(what: str, parents: int = 0, **labels) -> dict | None:
    """Log, once per `what` and process, this process's start-up: seconds from its launch (the kernel's record of
    its creation, so the interpreter's own start and every import count) to now, where it begins `what` (its first
    training step, its first evaluated token, its first useful work). `parents`: also record when that many
    ancestors were launched (a rank's torchrun agent and launcher: each one's start-up ends where its child begins).
    `labels` (the rank, ...) go into the record as they are; `imported` names the HEAVY_LIBRARIES loaded by then.
    Returns the record, or None when already logged."""
    if what in _startup_logged:
        return None
    _startup_logged.add(what)
    now = time.time()  # before psutil's import, which is the record's cost, not the process's
    import psutil

    process = psutil.Process()
    record = {"what": what, **labels, "pid": process.pid, "launched": process.create_time(), "reached": now,
              "startup_s": round(now - process.create_time(), 3), "parents_launched": [],
              "imported": [name for name in HEAVY_LIBRARIES if sys.modules.get(name) is not None]}
    for _ in range(parents):
        process = process.parent()
        if process is None:
            break
        record["parents_launched"].append(process.create_time())
    logging.getLogger(__name__).info("%s%s", STARTUP_PREFIX, json.dumps(record))
    return record


def read_startups(text: str) -> list[dict]:
    """The start-up records (log_startup) among a log's lines, in order."""
    return [json.loads(line.split(STARTUP_PREFIX, 1)[1]) for line in text.splitlines()
            if STARTUP_PREFIX + "{" in line]


__all__ = ["CONSOLE_FORMAT", "FORMAT", "HEAVY_LIBRARIES", "STARTUP_PREFIX", "console_log", "exit_without_teardown",
           "job_log", "log_startup", "read_startups"]
