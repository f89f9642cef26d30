"""Physical checks on measured figures: what makes a timing untrustworthy, said as a flag beside the figure.

A figure that fails one of these checks is never quoted without its flag (the report's "At a glance", the
recommendation and the claims all read the flags from here):

- the machine was busier than it has cores: the 1-minute load average at rank 0 before the first step or after
  the last (summary.json provenance `load_before` / `load_after`, os.getloadavg()) above the cores it has
  (provenance.hardware.cpu_count). The run's own ranks and threads count towards the load after it, so a run
  that kept to its cores leaves at most the cores; above them, something else was competing.
- the machine's peak FLOP/s was measured under the same load (bench/peak.json's load before or after the
  measurement above the cores): every MFU that divides by that peak is inflated.
- scaling efficiency above 100 %: for weak scaling (a fixed micro batch per rank) N ranks cannot do more than N
  times the work of one, so the baseline was slowed by something else.
"""
from __future__ import annotations

from .formats import fmt

SCALING_LIMIT_PCT = 100.0  # efficiency above this is not physical for weak scaling


def one_minute(load: list | None) -> float | None:
    """The 1-minute figure of an os.getloadavg() triple [1m, 5m, 15m] (None where it was unavailable)."""
    return float(load[0]) if load else None


def cores_of(provenance: dict) -> int | None:
    """The cores of the machine a run (or the peak measurement) recorded in its hardware provenance."""
    return (provenance.get("hardware") or {}).get("cpu_count")


def load_flag(load_before: list | None, load_after: list | None, cores: int | None) -> str | None:
    """'load above the 2 cores (1-min 7.97 before, 8.10 after)', or None when both stayed within the cores (or the
    load or the cores are unknown: nothing to check)."""
    before, after = one_minute(load_before), one_minute(load_after)
    if not cores or not any(value is not None and value > cores for value in (before, after)):
        return None
    return f"load above the {cores} cores ({load_text(load_before, load_after)})"


def load_text(load_before: list | None, load_after: list | None) -> str:
    """'1-min 0.52 before, 2.10 after' (n/a where unavailable)."""
    return f"1-min {fmt(one_minute(load_before), 2)} before, {fmt(one_minute(load_after), 2)} after"


def run_load_flag(provenance: dict) -> str | None:
    """The load flag of one run from its summary.json provenance."""
    return load_flag(provenance.get("load_before"), provenance.get("load_after"), cores_of(provenance))


def peak_flag(peak: dict | None) -> str | None:
    """Why the machine's measured peak (bench/peak.json) cannot be trusted, or None."""
    if not peak:
        return None
    busy = load_flag(peak.get("load_before"), peak.get("load_after"), (peak.get("hardware") or {}).get("cpu_count"))
    return f"peak measured under load: {busy}, so this MFU is inflated" if busy else None


def efficiency_flag(efficiency_pct: float | None, baseline: str) -> str | None:
    """'efficiency 412 % over <baseline> is above 100 %: not physical', or None."""
    if efficiency_pct is None or efficiency_pct <= SCALING_LIMIT_PCT:
        return None
    return (f"efficiency {fmt(efficiency_pct, 0)} % over {baseline} is above {fmt(SCALING_LIMIT_PCT, 0)} %: not "
            "physical, the baseline was slowed by something else")


def flagged(text: str, flags: list[str]) -> str:
    """`text` followed by its flags: 'X [⚠ flag; ⚠ flag]' (just `text` when there is none)."""
    flags = list(dict.fromkeys(f for f in flags if f))
    return f"{text} [{'; '.join('⚠ ' + f for f in flags)}]" if flags else text
