"""How numbers and durations read wherever a person sees them: the report, the dry run, progress lines."""
from __future__ import annotations


def fmt(value, digits: int = 1) -> str:
    """One number format for every table, so tests can reproduce the strings."""
    if value is None:
        return "n/a"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}"


def fmt_duration(seconds: float | None) -> str:
    """A duration in the unit that reads naturally, to a tenth: seconds below a minute, minutes below an hour, hours
    below two days, days below two years, years beyond. The one duration format: the report, the dry run's
    predicted wall time and the progress lines' ETA all read the same."""
    if seconds is None:
        return "n/a"
    if seconds < 60:
        return f"{seconds:,.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:,.1f} min"
    if seconds < 86400 * 2:
        return f"{seconds / 3600:,.1f} h"
    if seconds < 86400 * 730:
        return f"{seconds / 86400:,.1f} days"
    return f"{seconds / (86400 * 365.25):,.1f} years"
