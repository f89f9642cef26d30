"""How numbers and durations read wherever a person sees them: the report, the dry run, progress lines."""
from __future__ import annotations

import math
import statistics

SCIENTIFIC_FROM = 1e6  # magnitudes from here up print in scientific notation: 1.034e9, not 1,033,970,070.3378
SIGNIFICANT = 4  # significant digits of a number in scientific notation, and at most of a spread


def fmt(value, digits: int = 1) -> str:
    """One number format for every table, so tests can reproduce the strings: by magnitude, `digits` decimals below
    SCIENTIFIC_FROM (thousands separated; an int exactly), scientific notation with SIGNIFICANT digits from there up
    and for a non-zero value that `digits` decimals would show as zero."""
    if value is None:
        return "n/a"
    if value and (abs(value) >= SCIENTIFIC_FROM or abs(value) < 0.5 * 10.0**-digits):
        return scientific(value)
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}"


def scientific(value: float, significant: int = SIGNIFICANT) -> str:
    """'1.034e9', '2.5e-5': `significant` digits at most, trailing zeros of the mantissa dropped."""
    mantissa, exponent = f"{value:.{significant - 1}e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".") if "." in mantissa else mantissa
    return f"{mantissa}e{int(exponent)}"


def fmt_spread(values: list[float], digits: int = 1) -> str:
    """'median (min–max)' over repeats, just the value when there is one; 'n/a' for none. All three share one
    precision: `digits` decimals, fewer where the largest has SIGNIFICANT digits before the point already, and
    rounded to SIGNIFICANT significant digits beyond that (12,346 reads 12,350)."""
    if not values:
        return "n/a"
    largest = max(abs(v) for v in values)
    whole = math.floor(math.log10(largest)) + 1 if largest >= 1 else 0  # digits before the point
    decimals = max(0, min(digits, SIGNIFICANT - whole))

    def text(value):
        if whole > SIGNIFICANT and abs(value) < SCIENTIFIC_FROM:
            return fmt(int(round(value, SIGNIFICANT - whole)))
        return fmt(value, decimals)

    if len(values) == 1:
        return text(values[0])
    return f"{text(statistics.median(values))} ({text(min(values))}–{text(max(values))})"


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
