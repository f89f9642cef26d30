"""Progress of long stages (download, cleaning, sharding) as plain log lines with rate and ETA.

Plain lines, not a tqdm bar: a Snakemake job's stderr goes to its log file, where carriage-return bars become one
unreadable line; `tail -f logs/<name>/...` shows these as they come. At most one line per INTERVAL_S seconds
(plus the final one), so a multi-hour job writes a few hundred lines, not millions.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time

from pretrain_bench.core.formats import fmt_duration

INTERVAL_S = 10.0


def _size(value: float, unit: str) -> str:
    if unit == "bytes":
        return f"{value / 2**20:,.1f} MiB"
    return f"{value:,.0f} {unit}"


class Progress:
    """Counts work done on `what` and logs 'what: done of total (pct), rate/s, ETA' every INTERVAL_S seconds."""

    def __init__(self, what: str, log: logging.Logger, *, total: float | None = None, unit: str = "bytes"):
        self.what, self.log, self.total, self.unit = what, log, total, unit
        self.done = 0.0
        self.start = self.last = time.monotonic()

    def advance(self, amount: float, note=None) -> None:
        """Add `amount` done; log a line when INTERVAL_S has passed since the last one. `note`: a callable giving
        extra text, called only when a line is written (the hot loops call this once per document)."""
        self.done += amount
        now = time.monotonic()
        if now - self.last >= INTERVAL_S:
            self.last = now
            self.log.info("%s", self.line(note() if note else ""))

    def line(self, note: str = "") -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.done / elapsed
        text = f"{self.what}: {_size(self.done, self.unit)}"
        if self.total:
            share = min(self.done / self.total, 1.0)
            eta = (self.total - self.done) / rate if rate > 0 and self.done < self.total else 0.0
            text += (f" of {_size(self.total, self.unit)} ({share:.0%}), {_size(rate, self.unit)}/s, "
                         f"ETA {fmt_duration(eta)}")
        else:
            text += f", {_size(rate, self.unit)}/s, {fmt_duration(elapsed)} so far (total not known in advance)"
        return text + (f"; {note}" if note else "")

    def finish(self, note: str = "") -> None:
        elapsed = time.monotonic() - self.start
        self.log.info("%s: done, %s in %s (%s/s)%s", self.what, _size(self.done, self.unit), fmt_duration(elapsed),
                      _size(self.done / max(elapsed, 1e-9), self.unit), f"; {note}" if note else "")


@contextlib.contextmanager
def heartbeat(what: str, log: logging.Logger):
    """Log 'what: running, <elapsed> so far' every INTERVAL_S seconds while the with-block runs, from a thread: for
    work that reports no progress of its own (the tokenizers library's BPE merges run in Rust, without a callback)."""
    stop = threading.Event()
    start = time.monotonic()

    def beat() -> None:
        while not stop.wait(INTERVAL_S):
            log.info("%s: running, %s so far", what, fmt_duration(time.monotonic() - start))

    thread = threading.Thread(target=beat, name=f"heartbeat {what}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        log.info("%s: done in %s", what, fmt_duration(time.monotonic() - start))
