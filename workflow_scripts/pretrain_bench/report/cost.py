"""What a setup costs: device-hours, and money at report.gpu_hour_price, per billion tokens and per epoch.

    device-hours per 10⁹ tokens = devices × 10⁹ ÷ tokens/s ÷ 3600
    device-hours per epoch      = devices × report.target_corpus_tokens ÷ tokens/s ÷ 3600
    cost                        = device-hours × report.gpu_hour_price.amount

Devices: the GPUs of a CUDA run (its ranks); a CPU run's ranks share one machine, so it counts one machine-hour
per hour. The throughputs are this run's measured medians (benchmark cells, the main run) and, priced beside them,
the source articles' claimed setups (claims.CLAIMS: their tokens/s on their GPU count).
"""
from __future__ import annotations

import pandas as pd

from pretrain_bench.core.formats import fmt
from pretrain_bench.report.claims import CLAIMS, SETUP

BILLION = 1e9
HOUR_S = 3600.0


def devices(ranks: int, device: str) -> int:
    """What is rented by the hour: each GPU of a CUDA run; one machine for a CPU run (its ranks share it)."""
    return ranks if device == "cuda" else 1


def hours_per_tokens(tokens: float, tokens_per_s: float | None, device_count: int) -> float | None:
    """Device-hours to process `tokens` at `tokens_per_s` on `device_count` devices."""
    return device_count * tokens / tokens_per_s / HOUR_S if tokens_per_s else None


def cost_row(setup: str, source: str, tokens_per_s: float | None, device_count: int, unit: str,
             target_corpus_tokens: float, price: dict | None, flags: list[str] = ()) -> dict:
    per_billion = hours_per_tokens(BILLION, tokens_per_s, device_count)
    per_epoch = hours_per_tokens(target_corpus_tokens, tokens_per_s, device_count)
    amount = price["amount"] if price else None
    return {"setup": setup, "source": source, "tokens_per_s": tokens_per_s, "devices": device_count, "unit": unit,
            "hours_per_billion": per_billion, "hours_per_epoch": per_epoch,
            "cost_per_billion": per_billion * amount if amount is not None and per_billion is not None else None,
            "cost_per_epoch": per_epoch * amount if amount is not None and per_epoch is not None else None,
            "flags": list(flags)}


COST_COLUMNS_ORDER = ("setup", "source", "tokens_per_s", "devices", "unit", "hours_per_billion", "hours_per_epoch",
                      "cost_per_billion", "cost_per_epoch", "flags")


def cost_frame(ranking: pd.DataFrame, main, target_corpus_tokens: float, price: dict | None,
               main_flags: list[str] = ()) -> pd.DataFrame:
    """One row per measured cell (`ranking`: recommendation.ranking), the main run, and the articles' claims."""
    rows = []
    for row in ranking.to_dict("records"):
        unit = "GPU-hours" if row["device"] == "cuda" else "machine-hours"
        rows.append(cost_row(row["cell"], "measured (benchmark median)", row["tokens_per_s"],
                             devices(row["ranks"], row["device"]), unit, target_corpus_tokens, price,
                             row["timing_flags"]))
    unit = "GPU-hours" if main.device == "cuda" else "machine-hours"
    rows.append(cost_row("the main run", "measured", main.tokens_per_s, devices(main.world_size, main.device), unit,
                         target_corpus_tokens, price, main_flags))
    for key in ("one_gpu", "three_gpus"):
        claim = CLAIMS[key]
        rows.append(cost_row(f"{claim['gpus']} × {SETUP['gpu']}" + (f", ZeRO-{claim['zero_stage']}"
                                                                   if "zero_stage" in claim else ""),
                             "claimed by " + claim["source"], float(claim["tokens_per_s"]), claim["gpus"],
                             "GPU-hours", target_corpus_tokens, price))
    eight = CLAIMS["eight_nodes"]
    rows.append(cost_row(f"{eight['nodes']} × {eight['gpu']}, {eight['engine']}", "claimed by " + eight["source"],
                         float(eight["tokens_per_s"][1]), eight["nodes"], "GPU-hours", target_corpus_tokens, price))
    return pd.DataFrame.from_records(rows, columns=list(COST_COLUMNS_ORDER))


def money(value: float | None, price: dict | None) -> str:
    """'12.34 USD', or 'n/a' without a price."""
    return f"{fmt(value, 2)} {price['currency']}" if price and value is not None else "n/a"


def cost_columns(price: dict | None) -> dict:
    """How the cost table prints (report.format_tables): hours always, money when a price is set."""
    return {
        "setup": lambda r: r["setup"], "source": lambda r: r["source"],
        "tokens_per_s": lambda r: fmt(r["tokens_per_s"], 0), "devices": lambda r: f"{r['devices']}",
        "unit": lambda r: r["unit"], "hours_per_billion": lambda r: fmt(r["hours_per_billion"], 2),
        "hours_per_epoch": lambda r: fmt(r["hours_per_epoch"], 0),
        "cost_per_billion": lambda r: money(r["cost_per_billion"], price),
        "cost_per_epoch": lambda r: money(r["cost_per_epoch"], price),
        "flags": lambda r: "; ".join(r["flags"]) or "—",
    }
