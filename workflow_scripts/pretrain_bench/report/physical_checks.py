"""Physical checks on measured figures: what makes a timing untrustworthy, said as a flag beside the figure.

A figure that fails one of these checks is never quoted without its flag (the report's "At a glance", the
recommendation and the claims all read the flags from here):

- something else ran on the run's cores: processes outside the job used more than OTHER_CPU_LIMIT_PCT of the cores'
  time during the training loop (summary.json provenance `other_cpu`, metrics.OtherCpu: the cores' busy time less
  the job's own CPU time). The 1-minute load average (provenance `load_before` / `load_after`) is shown beside the
  timings but flags nothing: it lags a minute behind (a benchmark cell inherits the previous cell's ranks) and a run
  with more ranks than cores raises it above them by itself (that run is labelled oversubscribed instead).
- the machine's peak FLOP/s was measured while something else ran (bench/peak.json's `other_cpu` above the same
  limit): every MFU that divides by that peak is inflated.
- scaling efficiency above 100 %: for weak scaling (a fixed micro batch per rank) N ranks cannot do more than N
  times the work of one, so the baseline was slowed by something else.
- an MFU above 100 %: the run did more than the peak it divided by allows, so its timing or that peak is wrong.

A cell with any flag is not trustworthy: it never heads the recommendation, and the "at a glance" lines and the
claims quote it only as such (`untrusted`). Each flag is stated once per cell, whatever its number of repeats
(`repeats_busy_flag`).
"""
from __future__ import annotations

from pretrain_bench.core.formats import fmt

SCALING_LIMIT_PCT = 100.0  # efficiency above this is not physical for weak scaling
# Others' share of a run's cores above which its timing is flagged. Measured on a quiet 2-core machine: 0–1 % over
# training loops of 4 to 64 s, up to 7 % over the demo's benchmark cells, whose loops last 1 to 3 s (the workflow
# manager's own work between jobs weighs more there); one busy process beside a 1-rank run: 46 %.
OTHER_CPU_LIMIT_PCT = 10.0


def one_minute(load: list | None) -> float | None:
    """The 1-minute figure of an os.getloadavg() triple [1m, 5m, 15m] (None where it was unavailable)."""
    return float(load[0]) if load else None


def busy_flag(other_cpu: dict | None) -> str | None:
    """'other processes used 48 % of the 2 cores', or None when they used at most OTHER_CPU_LIMIT_PCT of them (or
    nothing was measured: nothing to check)."""
    share = (other_cpu or {}).get("share_pct")
    if share is None or share <= OTHER_CPU_LIMIT_PCT:
        return None
    return f"other processes used {fmt(share, 0)} % of the {cores_text(other_cpu['cpus'])}"


def repeats_busy_flag(other_cpus: list[dict | None]) -> str | None:
    """The busy flag of a cell, stated once over its repeats' `other_cpu`: 'other processes used 75 % of the 2 cores',
    '… 29–35 % of the 2 cores' where the busy repeats differ, '… in 1 of 3 repeats' where not every repeat was busy;
    None when none was."""
    busy = [other for other in other_cpus if busy_flag(other)]
    if not busy:
        return None
    shares = sorted(other["share_pct"] for other in busy)
    low, high = fmt(shares[0], 0), fmt(shares[-1], 0)
    share = low if low == high else f"{low}–{high}"
    cores = " or ".join(dict.fromkeys(cores_text(other["cpus"]) for other in busy))
    some = f" in {len(busy)} of {len(other_cpus)} repeats" if len(busy) < len(other_cpus) else ""
    return f"other processes used {share} % of the {cores}{some}"


def mfu_over_peak_flag(mfus_above_one: list[float]) -> str | None:
    """'MFU would be 169 % (above 100 %): the timing or the peak it divides by is wrong' for the highest of a cell's
    repeats whose MFU exceeds 1 (the ratios themselves, flops.mfu_ratio), or None when none does."""
    if not mfus_above_one:
        return None
    return (f"MFU would be {fmt(max(mfus_above_one) * 100, 0)} % (above 100 %): the timing or the peak it divides by "
            "is wrong")


def load_text(load_before: list | None, load_after: list | None) -> str:
    """'1-min 0.52 before, 2.10 after' (n/a where unavailable)."""
    return f"1-min {fmt(one_minute(load_before), 2)} before, {fmt(one_minute(load_after), 2)} after"


def cores_text(cpus: list[int]) -> str:
    """'2 cores', '1 core'."""
    return f"{len(cpus)} core{'' if len(cpus) == 1 else 's'}"


def contention_text(load_before: list | None, load_after: list | None, other_cpu: dict | None) -> str:
    """'1-min 0.52 before, 2.10 after, other processes 3 % of the 2 cores' (n/a where not measured)."""
    share = (other_cpu or {}).get("share_pct")
    others = f"{fmt(share, 0)} % of the {cores_text(other_cpu['cpus'])}" if share is not None else "n/a"
    return f"{load_text(load_before, load_after)}, other processes {others}"


def run_contention_text(record: dict) -> str:
    """contention_text of a summary.json provenance or of bench/peak.json."""
    return contention_text(record.get("load_before"), record.get("load_after"), record.get("other_cpu"))


def run_busy_flag(provenance: dict) -> str | None:
    """The flag of one run whose cores something else used, from its summary.json provenance."""
    return busy_flag(provenance.get("other_cpu"))


def peak_flag(peak: dict | None) -> str | None:
    """Why the machine's measured peak (bench/peak.json) cannot be trusted, or None."""
    if not peak:
        return None
    busy = busy_flag(peak.get("other_cpu"))
    return f"peak measured while {busy}, so this MFU is inflated" if busy else None


def efficiency_flag(efficiency_pct: float | None, baseline: str) -> str | None:
    """'efficiency 412 % over <baseline> is above 100 %: not physical', or None."""
    if efficiency_pct is None or efficiency_pct <= SCALING_LIMIT_PCT:
        return None
    return (f"efficiency {fmt(efficiency_pct, 0)} % over {baseline} is above {fmt(SCALING_LIMIT_PCT, 0)} %: not "
            "physical, the baseline was slowed by something else")


def baseline_flag(cell: str, efficiency_pct: float) -> str:
    """The flag of a 1-rank cell that another cell's speedup divided by at an efficiency above 100 %."""
    return (f"slowed by something else: {cell}'s scaling efficiency over it is {fmt(efficiency_pct, 0)} % (above "
            f"{fmt(SCALING_LIMIT_PCT, 0)} %)")


def flagged(text: str, flags: list[str]) -> str:
    """`text` followed by its flags: 'X [⚠ flag; ⚠ flag]' (just `text` when there is none)."""
    flags = list(dict.fromkeys(f for f in flags if f))
    return f"{text} [{'; '.join('⚠ ' + f for f in flags)}]" if flags else text


UNTRUSTED = "Not trustworthy (failed a physical check)"


def untrusted(text: str, flags: list[str]) -> str:
    """A measured figure as the report may quote it: `text` when it passed every check, else 'Not trustworthy (failed
    a physical check): X [⚠ flag; …]', never as a finding."""
    return flagged(f"{UNTRUSTED}: {text}", flags) if any(flags) else text
