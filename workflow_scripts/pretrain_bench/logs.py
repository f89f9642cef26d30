"""One way to log. The library logs through `logging` (a module-level `log = logging.getLogger(__name__)`); a process
decides once where that goes:

- a Snakemake adapter wraps its work in `with job_log(snakemake.log[0], "<script>"):` — the job's log file receives
  every library record, this process's stderr (tracebacks, other libraries' warnings) and, when the work fails, the
  error itself, so the log says why without Snakemake's console;
- a command-line entry point (launch.py, pretrain.py's ranks) calls `console_log()`: records go to stderr, which the
  launcher points at the job's attempt log.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Launcher and rank lines: the training progress a user tails, one fact per line, without a logger name.
CONSOLE_FORMAT = "%(message)s"


@contextlib.contextmanager
def job_log(path: str, what: str, fmt: str = FORMAT):
    """Send stderr and every `logging` record to `path` (line-buffered) for the duration; log a failure of `what`
    (the adapter's name) there, with its traceback, and re-raise it. Handlers are removed on exit, so tests may call
    adapters' `main` repeatedly."""
    with open(path, "w", buffering=1) as stream, contextlib.redirect_stderr(stream):
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
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


__all__ = ["CONSOLE_FORMAT", "FORMAT", "console_log", "exit_without_teardown", "job_log"]
