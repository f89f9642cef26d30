"""The lines a failed or interrupted job leaves where the user looks: the end of the terminal.

Snakemake ends a failed run with "Error in rule pretrain … CalledProcessError" and the path of the job's log; what to
do next ("checkpoint step 45 saved … rerun the same command to resume", or the error's cause) is in that log, among
tracebacks and other libraries' lines. From Snakemake's `onerror:` handler, `failure_report` prints, for every job
that failed or was still running when the run stopped, the tail of its log filtered to this project's own messages:
no traceback frames, no other library's records, the exception's one-line cause kept.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

from pretrain_bench.core.logs import STARTUP_PREFIX

# How many of a job's own lines the terminal shows: the last ones, where the outcome and the next command are.
TAIL_LINES = 8
# A record of pretrain_bench.core.logs.FORMAT ("2026-12-04 16:39:28,123 INFO pretrain_bench.x: message"): kept (as
# "message", "WARNING: message") when the logger is this project's, dropped when it is another library's.
_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (?P<level>[A-Z]+) (?P<logger>[\w.]+): (?P<message>.*)$")
# Other libraries' own formats: DeepSpeed's "[2026-12-04 16:39:28,123] [INFO] [...]", glog's "W1204 16:39:28.123 …",
# Python warnings ("/path/x.py:12: UserWarning: …" and the source line after it), and the launcher's command line.
_FOREIGN = re.compile(r"^(\[\d{4}-\d\d-\d\d[ T][\d:,.]+\]|[WIEF]\d{4} \d\d:\d\d:\d\d|\S+\.py:\d+: \w*Warning\b"
                      r"|\s+warnings\.warn\(|launch: "
                      # a library's tqdm progress bar: "Loading checkpoint shards: 100%|██| 1/1 [00:00<…]"
                      r"|.*\d%\|.*\| *\d+/\d+ \[)")
_TRACEBACK = "Traceback (most recent call last):"
# torchrun's own exit, by the SIGTERM the launcher passed on to stop the ranks: no cause of its own once the launcher's
# "<SIGNAL> received: asking the ranks to save the step in flight and stop" is among the kept lines.
_TORCHRUN_STOPPED = "torch.distributed.elastic.multiprocessing.api.SignalException:"
_STOP_PASSED_ON = " received: asking the ranks to save the step in flight and stop"
# A rank's last words after a stop (pretrain_bench.train.trainer.Trainer.stop).
_SAVED = re.compile(r"checkpoint step (?P<step>\d+) saved in (?P<folder>\S+?);")
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")


def own_lines(text: str) -> list[str]:
    """The project's own lines of a job log: traceback frames and other libraries' lines dropped, the last line of a
    traceback (the exception and its message: the cause) kept."""
    kept, in_traceback = [], False
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith(_TRACEBACK) or line.startswith(_CHAINED):
            in_traceback = True
            continue
        if in_traceback:
            if line[0].isspace():  # a frame, its source line or a ^^^ marker
                continue
            in_traceback = False  # "SomeError: message": the cause
        record = _RECORD.match(line)
        if record:
            if record["logger"].split(".")[0] != "pretrain_bench":
                continue
            level = record["level"]
            line = record["message"] if level == "INFO" else f"{level}: {record['message']}"
        if line.startswith(_TORCHRUN_STOPPED) and any(_STOP_PASSED_ON in earlier for earlier in kept):
            continue
        if _FOREIGN.match(line) or line.startswith(STARTUP_PREFIX):  # a start-up record is for bench_pipeline.py
            continue
        if not kept or kept[-1] != line:
            kept.append(line)
    return kept


def job_summary(rule: str, logs: list[str], tail: int = TAIL_LINES) -> str | None:
    """'rule <rule> (<log>):' and the last `tail` of the project's own lines of each of its logs; None when no log
    has any."""
    parts = []
    for log in logs:
        path = Path(log)
        try:
            lines = own_lines(path.read_text(errors="replace"))
        except OSError:
            continue
        if lines:
            parts.append(f"rule {rule} ({log}):\n" + "\n".join(f"  {line}" for line in lines[-tail:]))
    return "\n".join(parts) or None


def _job_lines(job) -> list[str]:
    lines = []
    for log in job.log:
        try:
            lines += own_lines(Path(str(log)).read_text(errors="replace"))
        except OSError:
            continue
    return lines


def rerun_command(argv: list[str]) -> str:
    """The command that started this Snakemake (its sys.argv), as a user types it again: `snakemake ARGS`, also when
    it was started as `python -m snakemake`."""
    return shlex.join(["snakemake", *argv[1:]])


def closing_lines(jobs, argv: list[str]) -> str | None:
    """The very last lines for the terminal after a stopped run (printed at Snakemake's exit, after its own "Complete
    log" and WorkflowError lines): for every job whose log says a checkpoint was saved when it stopped, that step and
    where, then the exact command that continues from it. None when no job saved one."""
    saved = []
    for job in jobs:
        matches = [match for line in _job_lines(job) if (match := _SAVED.search(line))]
        if matches:
            saved.append(f"rule {job.rule.name}: checkpoint step {matches[-1]['step']} saved in "
                         f"{matches[-1]['folder']}")
    if not saved:
        return None
    return "\n".join([*saved, "To continue from it, run the same command again:", f"  {rerun_command(argv)}"])


def failure_report(jobs) -> str | None:
    """For Snakemake jobs (objects with .rule.name and .log, as the scheduler's failed and running sets hold), the
    text the terminal ends with; None when none of them left a line of its own."""
    summaries = [job_summary(job.rule.name, [str(log) for log in job.log]) for job in jobs]
    summaries = [summary for summary in summaries if summary]
    if not summaries:
        return None
    return "What the stopped job(s) said (the full logs are named above):\n" + "\n".join(summaries)
