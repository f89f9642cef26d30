"""The report's tables, computed only from a run's JSON files (summary.json, matrix.json, eval/*.json).

Each table is computed once, as a pandas frame of numbers (`report_frames`): the claims and the plots read those
numbers. It is formatted once, where the template receives it (`format_frame`, called by report.format_tables): one
number format (`fmt`) and one column format per table (`*_COLUMNS`), which the claims reuse for the figures they
quote. The benchmark frames all start from `cell_table` (per cell: median, min and max over its repeats), built
once per report from `repeats_frame` (one row per cell × repeat, from each summary.json).
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from pretrain_bench.core.formats import fmt, fmt_duration, fmt_spread
from pretrain_bench.report.physical_checks import (
    baseline_flag,
    efficiency_flag,
    mfu_over_peak_flag,
    peak_flag,
    repeats_busy_flag,
    run_contention_text,
    untrusted,
)
from pretrain_bench.train.engines.spec import engine_spec
from pretrain_bench.train.models.flops import mfu_ratio
from pretrain_bench.train.run_summary import RunSummary

__all__ = ["GIB", "fmt", "fmt_duration", "spread", "ReportFrames", "report_frames", "format_frame"]

GIB = 1024**3
NOISY_SPREAD = 0.25  # (max - min) / median of a cell's tokens/s over repeats above which timings are flagged


def spread(values: list[float], digits: int = 1, scale: float = 1.0) -> str:
    """'median (min–max)' over repeats (formats.fmt_spread) of the values × scale; just the value when there is one."""
    return fmt_spread([v * scale for v in values if v is not None], digits)


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _number(value):
    """A frame's number as the plain Python value the formats expect (None for NaN; an integral count as int)."""
    if value is None or value != value:
        return None
    return value.item() if hasattr(value, "item") else value


def records(frame: pd.DataFrame) -> list[dict]:
    """A frame's rows as dicts of plain Python values (None where a number is missing)."""
    return [{key: _number(value) for key, value in row.items()} for row in frame.to_dict("records")]


def frame(rows: list[dict], columns: tuple[str, ...]) -> pd.DataFrame:
    """A frame of `rows` with exactly `columns` (so an empty table still has them)."""
    return pd.DataFrame.from_records(rows, columns=list(columns))


def format_frame(table: pd.DataFrame, columns: dict[str, Callable[[dict], str]]) -> list[dict]:
    """The rows the template prints: each column's text from its format."""
    return [format_row(row, columns) for row in records(table)]


def format_row(row: dict, columns: dict[str, Callable[[dict], str]]) -> dict:
    return {key: text(row) for key, text in columns.items()}


def _times(value) -> str:
    return f"{fmt(value, 2)}×"


# ---- the frames ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ReportFrames:
    """Every table of the report as numbers, computed once from the JSON files."""

    main: RunSummary
    bench: list[RunSummary]  # every benchmark repeat's summary
    device: str  # the benchmark's device (the main run's when there is no matrix)
    target_corpus_tokens: float
    epoch_s: float | None  # the main run's time per epoch
    throughput: pd.DataFrame  # one row: the main run
    evaluation: pd.DataFrame
    generations: pd.DataFrame
    lm_eval: pd.DataFrame
    cells: pd.DataFrame  # per benchmark cell that ran: figures over its repeats
    matrix: pd.DataFrame
    scaling: pd.DataFrame
    memory: pd.DataFrame
    communication: pd.DataFrame
    backends: pd.DataFrame
    engines: pd.DataFrame
    mfu: pd.DataFrame
    left_out: dict[str, int]  # why declared cells did not run: reason → cells
    peak: dict | None = None  # bench/peak.json: the machine's peak FLOP/s, with the load around its measurement


def report_frames(summary: RunSummary, evals: list[dict], target_corpus_tokens: float, matrix: dict | None = None,
                  runs_by_cell: dict[str, list[RunSummary]] | None = None, lm_evals: list[dict] = (),
                  peak: dict | None = None) -> ReportFrames:
    """peak: bench/peak.json (else the copy matrix.json holds)."""
    matrix = matrix or {"cells": [], "device": summary.device}
    peak = peak or matrix.get("peak")
    runs_by_cell = runs_by_cell or {}
    cells = cell_table(matrix, runs_by_cell)
    return ReportFrames(
        main=summary, bench=[s for runs in runs_by_cell.values() for s in runs], device=matrix["device"],
        target_corpus_tokens=target_corpus_tokens,
        epoch_s=target_corpus_tokens / summary.tokens_per_s if summary.tokens_per_s else None,
        throughput=throughput_frame(summary), evaluation=evaluation_frame(evals),
        generations=generations_frame(evals), lm_eval=lm_eval_frame(list(lm_evals)), cells=cells,
        matrix=matrix_frame(matrix, cells), scaling=scaling_frame(matrix, cells, target_corpus_tokens),
        memory=memory_frame(matrix, cells), communication=communication_frame(matrix, cells),
        backends=backend_frame(matrix, cells), engines=engine_frame(matrix, cells),
        mfu=mfu_frame(matrix, cells, peak), left_out=left_out(matrix), peak=peak,
    )


# ---- the main run --------------------------------------------------------------------------------------------------

def throughput_frame(summary: RunSummary) -> pd.DataFrame:
    """The main run's throughput row."""
    step = summary.step_time_s
    return frame([{
        "ranks": summary.world_size, "device": summary.device, "engine": engine_label(vars(summary)),
        "zero_stage": summary.zero_stage, "precision": summary.precision, "comm_backend": summary.comm_backend,
        "global_batch_size": summary.global_batch_size, "tokens_per_s": summary.tokens_per_s,
        "step_time_s": step["median"], "step_time_s_min": step["min"], "step_time_s_max": step["max"],
        "peak_mem_bytes": summary.peak_mem_bytes, "peak_mem_allocated_bytes": summary.peak_mem_allocated_bytes,
        "mfu": summary.mfu, "mfu_note": summary.mfu_note, "comm_fraction": summary.comm_fraction,
    }], ("ranks", "device", "engine", "zero_stage", "precision", "comm_backend", "global_batch_size", "tokens_per_s",
         "step_time_s", "step_time_s_min", "step_time_s_max", "peak_mem_bytes", "peak_mem_allocated_bytes", "mfu",
         "mfu_note", "comm_fraction"))


THROUGHPUT_COLUMNS = {
    "ranks": lambda r: str(r["ranks"]), "device": lambda r: r["device"], "engine": lambda r: r["engine"],
    "zero_stage": lambda r: str(r["zero_stage"]), "precision": lambda r: r["precision"],
    "comm_backend": lambda r: r["comm_backend"], "global_batch": lambda r: fmt(r["global_batch_size"]),
    "tokens_per_s": lambda r: fmt(r["tokens_per_s"]),
    "step_time": lambda r: f"{fmt(r['step_time_s'], 3)} ({fmt(r['step_time_s_min'], 3)}–"
                           f"{fmt(r['step_time_s_max'], 3)})",
    "peak_mem_gib": lambda r: " / ".join(fmt(b / GIB if b is not None else None, 2) for b in r["peak_mem_bytes"]),
    "peak_mem_allocated_gib": lambda r: " / ".join(fmt(b / GIB if b is not None else None, 2)
                                                   for b in r["peak_mem_allocated_bytes"] or ()),
    "mfu_pct": lambda r: mfu_figure_text([r["mfu"]], [r["mfu_note"]] if r["mfu_note"] else []),
    "comm_pct": lambda r: fmt(r["comm_fraction"] * 100 if r["comm_fraction"] is not None else None, 1),
}


def evaluation_frame(evals: list[dict]) -> pd.DataFrame:
    """One row per evaluated checkpoint (eval/step<N>.json), in step order; integers stay integers."""
    columns = ["step", "train_tokens", "loss", "perplexity", "bits_per_byte", "tokens", "eval_tokens_per_s"]
    table = pd.DataFrame.from_records([{key: e.get(key) for key in columns} for e in evals], columns=columns)
    return table.astype({"step": object, "tokens": object, "train_tokens": object}).sort_values("step", kind="stable")


EVALUATION_COLUMNS = {
    "step": lambda r: fmt(r["step"]), "train_tokens": lambda r: fmt(r["train_tokens"]),
    "loss": lambda r: fmt(r["loss"], 4), "perplexity": lambda r: fmt(r["perplexity"], 2),
    "bits_per_byte": lambda r: fmt(r["bits_per_byte"], 4), "eval_tokens": lambda r: fmt(r["tokens"]),
    "eval_tokens_per_s": lambda r: fmt(r["eval_tokens_per_s"], 0),
}


def generations_frame(evals: list[dict]) -> pd.DataFrame:
    """Continuations of the first and the last evaluated checkpoint: one row per (step, prompt)."""
    with_text = sorted((e for e in evals if e.get("generations")), key=lambda e: e["step"])
    shown = with_text[:1] + with_text[1:][-1:]
    rows = []
    for e in shown:
        by_prompt: dict[str, dict] = {}
        for g in e["generations"]:
            by_prompt.setdefault(g["prompt"], {})[g["mode"]] = g["text"]
        rows += [{"step": e["step"], "perplexity": e.get("perplexity"), "prompt": prompt,
                  "greedy": texts.get("greedy", ""), "sampled": texts.get("sampled", "")}
                 for prompt, texts in by_prompt.items()]
    return frame(rows, ("step", "perplexity", "prompt", "greedy", "sampled")).astype({"step": object})


# Held-out perplexity above which a checkpoint's continuations are not expected to show structure: its next-token
# choice is as uncertain as a uniform pick among this many tokens, so it emits the most frequent ones (whitespace,
# punctuation, common identifiers) rather than code.
BABBLE_PERPLEXITY = 100.0

GENERATION_COLUMNS = {"step": lambda r: fmt(r["step"]), "perplexity": lambda r: fmt(r["perplexity"], 1),
                      "prompt": lambda r: r["prompt"], "greedy": lambda r: r["greedy"],
                      "sampled": lambda r: r["sampled"]}


def babbling_steps(generations: pd.DataFrame) -> list[dict]:
    """The checkpoints shown in the generation table whose held-out perplexity is above BABBLE_PERPLEXITY."""
    shown = generations.drop_duplicates("step")
    return [{"step": fmt(row["step"]), "perplexity": fmt(row["perplexity"], 1)} for row in records(shown)
            if row["perplexity"] is not None and row["perplexity"] > BABBLE_PERPLEXITY]


def lm_eval_frame(results: list[dict]) -> pd.DataFrame:
    """lm-eval's scores (lm_eval/step<N>.json): one row per checkpoint × task × metric, with its stderr where lm-eval
    gives one; long form, so any number of tasks and metrics fits."""
    rows = [{"step": result["step"], "task": task, "metric": metric, "value": value,
             "stderr": scores.get(f"{metric}_stderr"), "samples": result["samples"].get(task)}
            for result in results for task, scores in result["tasks"].items()
            for metric, value in scores.items()
            if metric not in ("name", "alias", "sample_len") and not metric.endswith("_stderr")
            and isinstance(value, (int, float))]
    table = frame(rows, ("step", "task", "metric", "value", "stderr", "samples"))
    return table.sort_values(["task", "metric", "step"], kind="stable")


LM_EVAL_COLUMNS = {
    "step": lambda r: fmt(int(r["step"])), "task": lambda r: r["task"], "metric": lambda r: r["metric"],
    "value": lambda r: fmt(float(r["value"]), 4),
    "stderr": lambda r: fmt(float(r["stderr"]), 4) if r["stderr"] is not None else "n/a",
    "samples": lambda r: fmt(int(r["samples"])) if r["samples"] is not None else "n/a",
}


# ---- benchmark cells -----------------------------------------------------------------------------------------------

# What one repeat of a cell measured (its summary.json), aggregated per cell over the repeats.
FIGURES = ("tokens_per_s", "step_time_s", "mem_bytes", "mfu", "comm_fraction", "peak_flops_per_rank")
REPEAT_COLUMNS = ("cell", "repeat", *FIGURES, "oversubscribed", "global_batch_size", "tokens_per_step",
                  "mfu_note", "precision_note", "comm_method", "peak_flops_source", "flops_per_token", "load",
                  "other_cpu", "mfu_ratio")


def repeats_frame(matrix: dict, runs_by_cell: dict[str, list[RunSummary]]) -> pd.DataFrame:
    """One row per benchmark cell × repeat, read from that repeat's summary.json (peak memory: its worst rank)."""
    rows = [{"cell": entry["cell"], "repeat": number, "tokens_per_s": run.tokens_per_s,
             "step_time_s": run.step_time_s["median"], "mem_bytes": max(run.peak_mem_bytes), "mfu": run.mfu,
             "comm_fraction": run.comm_fraction, "peak_flops_per_rank": run.peak_flops_per_rank,
             "oversubscribed": run.oversubscribed, "global_batch_size": run.global_batch_size,
             "tokens_per_step": run.tokens_per_step, "mfu_note": run.mfu_note,
             "precision_note": run.precision_note, "comm_method": run.comm_method,
             "peak_flops_source": run.peak_flops_source, "flops_per_token": run.flops_per_token,
             "load": run_contention_text(run.provenance), "other_cpu": run.provenance.get("other_cpu"),
             "mfu_ratio": run_mfu_ratio(run)}
            for entry in matrix["cells"] for number, run in enumerate(runs_by_cell.get(entry["cell"], []), 1)]
    table = frame(rows, REPEAT_COLUMNS)
    # None (not measured) as NaN, so that every figure column is numeric
    table[list(FIGURES)] = table[list(FIGURES)].apply(pd.to_numeric)
    return table


def run_mfu_ratio(run: RunSummary) -> float | None:
    """A run's MFU as computed, above 1 included (its summary then holds none, only the note saying why), or None
    without a throughput, FLOPs per token or peak to compute it from."""
    if not (run.tokens_per_s and run.flops_per_token and run.peak_flops_per_rank):
        return None
    return mfu_ratio(run.tokens_per_s, run.flops_per_token, run.peak_flops_per_rank, run.world_size)


def run_over_peak_flags(run: RunSummary) -> list[str]:
    """The flag of a run whose MFU would exceed 100 % (physical_checks.mfu_over_peak_flag), as a list."""
    ratio = run_mfu_ratio(run)
    flag = mfu_over_peak_flag([ratio] if ratio is not None and ratio > 1.0 else [])
    return [flag] if flag else []


def cell_table(matrix: dict, runs_by_cell: dict[str, list[RunSummary]]) -> pd.DataFrame:
    """Per cell that ran (the index): its repeats, and for each measured figure the median, min and max over them
    (`<figure>`, `<figure>_min`, `<figure>_max`; NaN where no repeat measured it) and the values themselves
    (`<figure>_values`, what `spread` prints and the plots draw); the first repeat's descriptive fields."""
    repeats = repeats_frame(matrix, runs_by_cell)
    grouped = repeats.groupby("cell", sort=False)
    table = grouped[list(FIGURES)].agg(["median", "min", "max"])
    table.columns = [figure if stat == "median" else f"{figure}_{stat}" for figure, stat in table.columns]
    for figure in FIGURES:
        table[f"{figure}_values"] = grouped[figure].agg(lambda column: column.dropna().tolist())
    table["repeats"] = grouped.size()
    table["oversubscribed"] = grouped["oversubscribed"].any()
    for column in ("global_batch_size", "tokens_per_step", "comm_method", "peak_flops_source", "flops_per_token"):
        table[column] = grouped[column].first()
    table["mfu_notes"] = grouped["mfu_note"].agg(lambda column: column.dropna().tolist())
    table["precision_notes"] = grouped["precision_note"].agg(lambda column: list(dict.fromkeys(column.dropna())))
    table["loads"] = grouped["load"].agg(list)  # per repeat: the 1-min load before and after it, others' CPU share
    # the physical checks of the cell's own timings, each stated once over its repeats
    table["busy_flags"] = grouped["other_cpu"].agg(lambda column: [flag for flag in [repeats_busy_flag(list(column))]
                                                                   if flag])
    table["over_peak_flags"] = grouped["mfu_ratio"].agg(
        lambda column: [flag for flag in [mfu_over_peak_flag([v for v in column.dropna() if v > 1.0])] if flag])
    return table


def engine_label(entry: dict) -> str:
    """'DeepSpeed ZeRO-2', 'DeepSpeed ZeRO-2 + optimizer offload', 'DDP', 'FSDP2', and with the experts split over
    ranks 'DDP + expert parallel 2'."""
    label = engine_spec(entry["engine"]).label(entry["zero_stage"], entry["offload_optimizer"])
    return label + expert_parallel_suffix(entry, " + ")


def expert_parallel_suffix(entry: dict, joint: str) -> str:
    """'<joint>expert parallel N' for a run or cell whose experts are split over N ranks; '' otherwise."""
    ep = entry.get("expert_parallel") or 1
    return f"{joint}expert parallel {ep}" if ep > 1 else ""


def group_key(entry: dict) -> tuple:
    """Cells that differ only in their rank count form one scaling series (experts split over the same EP)."""
    return (entry["engine"], entry["zero_stage"], entry["precision"], entry["comm_backend"],
            entry["micro_batch_size"], entry["offload_optimizer"], entry.get("expert_parallel") or 1)


def group_label(entry: dict) -> str:
    layout = engine_spec(entry["engine"]).layout_label(entry["zero_stage"])
    label = f"{layout}, {entry['precision']}, {entry['comm_backend']}"
    label += f", micro batch {entry['micro_batch_size']}"
    if entry["offload_optimizer"] != "none":
        label += ", optimizer offload"
    return label + expert_parallel_suffix(entry, ", ")


def _ran(matrix: dict, cells: pd.DataFrame) -> list[dict]:
    """The matrix's entries of the cells that ran, in the matrix's order."""
    return [e for e in matrix["cells"] if e["cell"] in cells.index]


def _tokens_per_s(cells: pd.DataFrame, cell: str) -> float | None:
    return _number(cells.at[cell, "tokens_per_s"])


def fastest_one_rank(matrix: dict, cells: pd.DataFrame) -> dict | None:
    """The matrix entry of the fastest measured 1-rank cell, whatever its engine (a plain single-device run, DDP on
    one rank, among them where it ran): the baseline a user compares N devices against."""
    ones = [e for e in _ran(matrix, cells) if e["gpus"] == 1 and _tokens_per_s(cells, e["cell"])]
    return max(ones, key=lambda e: _tokens_per_s(cells, e["cell"]), default=None)


def scaling_frame(matrix: dict, cells: pd.DataFrame, target_corpus_tokens: float) -> pd.DataFrame:
    """The source articles' table: per series, 1 vs N ranks — tokens/s, speedup and efficiency over the series' own
    1-rank cell and over the fastest 1-rank cell of the matrix, memory, time per epoch, the load around each repeat
    and the flags of the physical checks (pretrain_bench.report.physical_checks)."""
    entries = _ran(matrix, cells)
    best = fastest_one_rank(matrix, cells)
    best_tps = _tokens_per_s(cells, best["cell"]) if best else None
    rows = []
    for key in sorted({group_key(e) for e in entries}, key=str):
        series = sorted((e for e in entries if group_key(e) == key), key=lambda e: e["gpus"])
        base = next((e for e in series if e["gpus"] == 1), None)
        base_tps = _tokens_per_s(cells, base["cell"]) if base else None
        for entry in series:
            cell = cells.loc[entry["cell"]]
            tps = _number(cell["tokens_per_s"])
            speedup = tps / base_tps if base_tps and tps else None
            speedup_best = tps / best_tps if best_tps and tps else None
            efficiency = speedup / entry["gpus"] * 100 if speedup else None
            efficiency_best = speedup_best / entry["gpus"] * 100 if speedup_best else None
            # a timing is as trustworthy as the busiest of the runs it is divided by (their flags name them)
            divisors = dict.fromkeys(b["cell"] for b in (base, best) if b and entry["gpus"] > 1)
            flags = list(cells.at[entry["cell"], "busy_flags"])
            flags += [f"{name}, divided by: {flag}" for name in divisors for flag in cells.at[name, "busy_flags"]]
            rows.append({
                "series": group_label(entry), "cell": entry["cell"], "ranks": entry["gpus"],
                "engine": entry["engine"], "global_batch_size": _number(cell["global_batch_size"]),
                "repeats": _number(cell["repeats"]), "tokens_per_s": tps,
                "tokens_per_s_values": cell["tokens_per_s_values"], "speedup": speedup,
                "efficiency_pct": efficiency, "baseline_cell": base["cell"] if base else None,
                "speedup_best": speedup_best, "efficiency_best_pct": efficiency_best,
                "best_cell": best["cell"] if best else None,
                "mem_bytes_values": cell["mem_bytes_values"],
                "epoch_s": target_corpus_tokens / tps if tps else None,
                "oversubscribed": bool(cell["oversubscribed"]), "loads": cell["loads"],
                "flags": flags, "efficiency_flags": [],
            })
    # an efficiency above 100 % flags both cells of its ratio: the N-rank cell, and the 1-rank cell it divided by,
    # which something else slowed
    by_cell = {row["cell"]: row for row in rows}
    for row in rows:
        ratios = {row["baseline_cell"]: (row["efficiency_pct"], "its 1-rank cell")}
        ratios.setdefault(row["best_cell"], (row["efficiency_best_pct"], "the fastest 1-rank cell"))  # once per cell
        for baseline, (pct, which) in ratios.items():
            if baseline not in (None, row["cell"]) and (flag := efficiency_flag(pct, f"{which} {baseline}")):
                row["efficiency_flags"].append(flag)
                by_cell[baseline]["efficiency_flags"].append(baseline_flag(row["cell"], pct))
    for row in rows:
        row["flags"] = list(dict.fromkeys(row["flags"] + row["efficiency_flags"]))
    return frame(rows, ("series", "cell", "ranks", "engine", "global_batch_size", "repeats", "tokens_per_s",
                        "tokens_per_s_values", "speedup", "efficiency_pct", "baseline_cell", "speedup_best",
                        "efficiency_best_pct", "best_cell", "mem_bytes_values", "epoch_s", "oversubscribed", "loads",
                        "flags", "efficiency_flags"))


SCALING_COLUMNS = {
    "series": lambda r: r["series"], "cell": lambda r: r["cell"], "ranks": lambda r: str(r["ranks"]),
    "global_batch": lambda r: fmt(r["global_batch_size"]), "repeats": lambda r: str(r["repeats"]),
    "tokens_per_s": lambda r: spread(r["tokens_per_s_values"], 0),
    "speedup": lambda r: _times(r["speedup"]) if r["speedup"] else "n/a",
    "efficiency_pct": lambda r: fmt(r["efficiency_pct"], 0) if r["speedup"] else "n/a",
    "speedup_best": lambda r: _times(r["speedup_best"]) if r["speedup_best"] else "n/a",
    "efficiency_best_pct": lambda r: fmt(r["efficiency_best_pct"], 0) if r["speedup_best"] else "n/a",
    "load": lambda r: "; ".join(r["loads"]),
    "best_cell": lambda r: r["best_cell"] or "",
    "flags": lambda r: "; ".join(r["flags"]) or "—",
    "mem_gib": lambda r: spread(r["mem_bytes_values"], 2, 1 / GIB),
    "epoch": lambda r: fmt_duration(r["epoch_s"]) if r["epoch_s"] is not None else "n/a",
    "oversubscribed": lambda r: "yes" if r["oversubscribed"] else "no",
}


def measurable_prediction(estimate: dict, device: str) -> int:
    """The part of the predicted peak that the run's own measurement counts.

    CUDA: torch.cuda.max_memory_reserved leaves out the CUDA context (runtime). CPU: peak RSS holds everything,
    offloaded states included.
    """
    if device == "cuda":
        return estimate["per_rank"] - estimate["runtime"]
    return estimate["per_rank"] + estimate["host_states"]


def memory_frame(matrix: dict, cells: pd.DataFrame) -> pd.DataFrame:
    """Per cell: measured peak per rank against the memory model's prediction, by ZeRO stage."""
    rows = []
    entries = [e for e in _ran(matrix, cells) if e.get("estimate")]
    for entry in sorted(entries, key=lambda e: (e["gpus"], e["zero_stage"], e["cell"])):
        est = entry["estimate"]
        cell = cells.loc[entry["cell"]]
        predicted = measurable_prediction(est, matrix["device"])
        measured = _number(cell["mem_bytes"])
        rows.append({
            "cell": entry["cell"], "engine": engine_label(entry), "zero_stage": entry["zero_stage"],
            "ranks": entry["gpus"], "precision": entry["precision"], "measured_bytes": measured,
            "measured_bytes_values": cell["mem_bytes_values"], "predicted_bytes": predicted,
            "states_bytes": est["model_states"], "expert_states_bytes": est.get("expert_states", 0),
            "activations_bytes": est["activations"], "all_to_all_bytes": est.get("all_to_all_bytes", 0),
            "other_bytes": predicted - est["model_states"] - est["activations"],
            "ratio": measured / predicted if predicted else None, "formula": est["state_formula"],
        })
    return frame(rows, ("cell", "engine", "zero_stage", "ranks", "precision", "measured_bytes",
                        "measured_bytes_values", "predicted_bytes", "states_bytes", "expert_states_bytes",
                        "activations_bytes", "all_to_all_bytes", "other_bytes", "ratio", "formula"))


MEMORY_COLUMNS = {
    "cell": lambda r: r["cell"], "engine": lambda r: r["engine"], "zero_stage": lambda r: str(r["zero_stage"]),
    "ranks": lambda r: str(r["ranks"]), "precision": lambda r: r["precision"],
    "measured_gib": lambda r: spread(r["measured_bytes_values"], 3, 1 / GIB),
    "predicted_gib": lambda r: fmt(r["predicted_bytes"] / GIB, 3),
    "states_gib": lambda r: fmt(r["states_bytes"] / GIB, 3),
    "activations_gib": lambda r: fmt(r["activations_bytes"] / GIB, 3),
    "other_gib": lambda r: fmt(r["other_bytes"] / GIB, 3),
    "ratio": lambda r: fmt(r["ratio"], 2) if r["ratio"] is not None else "n/a", "formula": lambda r: r["formula"],
}


def communication_frame(matrix: dict, cells: pd.DataFrame) -> pd.DataFrame:
    """Communication share of step time per multi-rank cell."""
    rows = []
    for entry in _ran(matrix, cells):
        if entry["gpus"] < 2:
            continue
        cell = cells.loc[entry["cell"]]
        rows.append({"cell": entry["cell"], "engine": entry["engine"], "ranks": entry["gpus"],
                     "comm_backend": entry["comm_backend"], "comm_fraction": _number(cell["comm_fraction"]),
                     "comm_fraction_values": cell["comm_fraction_values"], "method": cell["comm_method"],
                     "flags": cell["busy_flags"]})
    return frame(rows, ("cell", "engine", "ranks", "comm_backend", "comm_fraction", "comm_fraction_values", "method",
                        "flags"))


COMMUNICATION_COLUMNS = {
    "cell": lambda r: r["cell"], "engine": lambda r: r["engine"], "ranks": lambda r: str(r["ranks"]),
    "comm_backend": lambda r: r["comm_backend"],
    "comm_pct": lambda r: spread(r["comm_fraction_values"], 1, 100) if r["comm_fraction_values"] else "not measured",
    "method": lambda r: r["method"] or "n/a",
}


def backend_frame(matrix: dict, cells: pd.DataFrame) -> pd.DataFrame:
    """NCCL against Gloo for cells that ran with both and are otherwise equal."""
    by_key = {}
    for entry in _ran(matrix, cells):
        key = (entry["gpus"], entry["engine"], entry["zero_stage"], entry["precision"], entry["micro_batch_size"],
               entry["offload_optimizer"])
        by_key.setdefault(key, {})[entry["comm_backend"]] = entry
    rows = []
    for key, pair in sorted(by_key.items()):
        if {"nccl", "gloo"} <= set(pair):
            nccl = _tokens_per_s(cells, pair["nccl"]["cell"])
            gloo = _tokens_per_s(cells, pair["gloo"]["cell"])
            rows.append({"ranks": key[0], "engine": engine_label(pair["nccl"]), "zero_stage": key[2],
                         "precision": key[3], "nccl_tokens_per_s": nccl, "gloo_tokens_per_s": gloo,
                         "nccl_faster_pct": (nccl / gloo - 1) * 100, "ratio": nccl / gloo,
                         "flags": list(dict.fromkeys(cells.at[pair["nccl"]["cell"], "busy_flags"]
                                                     + cells.at[pair["gloo"]["cell"], "busy_flags"]))})
    return frame(rows, ("ranks", "engine", "zero_stage", "precision", "nccl_tokens_per_s", "gloo_tokens_per_s",
                        "nccl_faster_pct", "ratio", "flags"))


BACKEND_COLUMNS = {
    "ranks": lambda r: str(r["ranks"]), "engine": lambda r: r["engine"], "zero_stage": lambda r: str(r["zero_stage"]),
    "precision": lambda r: r["precision"], "nccl_tokens_per_s": lambda r: fmt(r["nccl_tokens_per_s"], 0),
    "gloo_tokens_per_s": lambda r: fmt(r["gloo_tokens_per_s"], 0),
    "nccl_faster_pct": lambda r: fmt(r["nccl_faster_pct"], 1),
}


def engine_frame(matrix: dict, cells: pd.DataFrame) -> pd.DataFrame:
    """Engines side by side on the same work: cells equal in ranks, precision, backend and micro batch (so the same
    model, data and global batch), one row per engine setup, fastest first. Empty unless two engines ran."""
    entries = _ran(matrix, cells)
    groups: dict[tuple, list[dict]] = {}
    for entry in entries:
        key = (entry["gpus"], entry["precision"], entry["comm_backend"], entry["micro_batch_size"])
        groups.setdefault(key, []).append(entry)
    one_rank = {group_key(e): e for e in entries if e["gpus"] == 1}
    rows = []
    for key, group in sorted(groups.items()):
        if len({e["engine"] for e in group}) < 2:
            continue
        tps = {e["cell"]: _tokens_per_s(cells, e["cell"]) for e in group}
        fastest = max(v for v in tps.values() if v)
        for entry in sorted(group, key=lambda e: -(tps[e["cell"]] or 0)):
            cell, st = entry["cell"], cells.loc[entry["cell"]]
            base = one_rank.get(group_key(entry))
            base_tps = _tokens_per_s(cells, base["cell"]) if base else None
            speedup = tps[cell] / base_tps if base_tps and tps[cell] else None
            predicted = measurable_prediction(entry["estimate"], matrix["device"]) if entry.get("estimate") else None
            measured = _number(st["mem_bytes"])
            rows.append({
                "ranks": key[0], "precision": key[1], "comm_backend": key[2], "engine": engine_label(entry),
                "cell": cell, "repeats": _number(st["repeats"]), "tokens_per_s": tps[cell],
                "tokens_per_s_values": st["tokens_per_s_values"],
                "vs_fastest": tps[cell] / fastest if tps[cell] else None,
                "speedup": speedup if speedup and entry["gpus"] > 1 else None,
                "measured_bytes": measured, "measured_bytes_values": st["mem_bytes_values"],
                "predicted_bytes": predicted,
                "ratio": measured / predicted if predicted and measured else None,
                "formula": entry["estimate"]["state_formula"] if entry.get("estimate") else None,
                "comm_fraction_values": st["comm_fraction_values"],
            })
    return frame(rows, ("ranks", "precision", "comm_backend", "engine", "cell", "repeats", "tokens_per_s",
                        "tokens_per_s_values", "vs_fastest", "speedup", "measured_bytes", "measured_bytes_values",
                        "predicted_bytes", "ratio", "formula", "comm_fraction_values"))


ENGINE_COLUMNS = {
    "ranks": lambda r: str(r["ranks"]), "precision": lambda r: r["precision"],
    "comm_backend": lambda r: r["comm_backend"], "engine": lambda r: r["engine"], "cell": lambda r: r["cell"],
    "repeats": lambda r: str(r["repeats"]), "tokens_per_s": lambda r: spread(r["tokens_per_s_values"], 0),
    "vs_fastest": lambda r: _times(r["vs_fastest"]) if r["vs_fastest"] is not None else "n/a",
    "speedup": lambda r: _times(r["speedup"]) if r["speedup"] is not None else "—",
    "measured_gib": lambda r: spread(r["measured_bytes_values"], 3, 1 / GIB),
    "predicted_gib": lambda r: fmt(r["predicted_bytes"] / GIB, 3) if r["predicted_bytes"] else "n/a",
    "ratio": lambda r: fmt(r["ratio"], 2) if r["ratio"] is not None else "n/a",
    "formula": lambda r: r["formula"] or "n/a",
    "comm_pct": lambda r: (spread(r["comm_fraction_values"], 1, 100) if r["comm_fraction_values"]
                           else ("—" if r["ranks"] == 1 else "not measured")),
}


def mfu_text(runs: list[RunSummary]) -> str:
    """MFU in percent over repeats, or why it is not printed (see `mfu_figure_text`)."""
    return mfu_figure_text([r.mfu for r in runs], [r.mfu_note for r in runs if r.mfu_note])


def mfu_figure_text(mfus: list, notes: list[str]) -> str:
    """MFU in percent over repeats, or why a run did not report it (its mfu_note)."""
    if notes:
        return "not reported: " + notes[0]
    return spread(mfus, 2, 100)


def mfu_flags(peak_source: str | None, peak: dict | None, busy_flags: list[str]) -> list[str]:
    """Why an MFU cannot be trusted: other processes on its run's cores, and a peak (rule measure_peak's) measured while
    other processes used the cores."""
    measured_here = bool(peak_source) and "rule measure_peak" in peak_source
    return [*busy_flags, *([peak_flag(peak)] if measured_here and peak_flag(peak) else [])]


def mfu_frame(matrix: dict, cells: pd.DataFrame, peak: dict | None = None) -> pd.DataFrame:
    rows = []
    for entry in _ran(matrix, cells):
        cell = cells.loc[entry["cell"]]
        rows.append({"cell": entry["cell"], "ranks": entry["gpus"], "mfu_values": cell["mfu_values"],
                     "mfu_notes": cell["mfu_notes"], "peak_flops_per_rank_values": cell["peak_flops_per_rank_values"],
                     "peak_flops_source": cell["peak_flops_source"],
                     "flops_per_token": _number(cell["flops_per_token"]),
                     "flags": mfu_flags(cell["peak_flops_source"], peak,
                                        cell["busy_flags"] + cell["over_peak_flags"])})
    return frame(rows, ("cell", "ranks", "mfu_values", "mfu_notes", "peak_flops_per_rank_values",
                        "peak_flops_source", "flops_per_token", "flags"))


MFU_COLUMNS = {
    "cell": lambda r: r["cell"], "ranks": lambda r: str(r["ranks"]),
    "mfu_pct": lambda r: mfu_figure_text(r["mfu_values"], r["mfu_notes"]),
    "peak_tflops": lambda r: spread(r["peak_flops_per_rank_values"], 3, 1e-12),
    "peak_source": lambda r: r["peak_flops_source"] or "n/a", "flops_per_token": lambda r: fmt(r["flops_per_token"], 0),
    "flags": lambda r: "; ".join(r["flags"]) or "—",
}

STATUS_LABELS = {"run": "ran", "unsupported": "left out: not supported here", "predicted_oom": "predicted OOM"}
STATUS_ORDER = {"run": 0, "predicted_oom": 1, "unsupported": 2}


def matrix_frame(matrix: dict, cells: pd.DataFrame) -> pd.DataFrame:
    """Every declared cell: what happened to it, the pre-flight prediction and the time estimate."""
    rows = []
    for entry in sorted(matrix["cells"], key=lambda e: STATUS_ORDER[e["status"]]):
        ran = entry["cell"] in cells.index
        est = entry.get("estimate")
        estimate = entry.get("time_estimate")
        rows.append({
            "cell": entry["cell"], "status": entry["status"], "forced": bool(entry.get("forced")),
            "searched": entry["origin"] == "search",
            "reason": entry.get("reason"), "predicted_bytes": est["per_rank"] if est else None,
            "min_step_time_s": estimate["min_step_time_s"] if estimate else None,
            "measured_step_time_s": _number(cells.at[entry["cell"], "step_time_s"]) if ran else None,
            "repeats": _number(cells.at[entry["cell"], "repeats"]) if ran else 0,
        })
    return frame(rows, ("cell", "status", "forced", "searched", "reason", "predicted_bytes", "min_step_time_s",
                        "measured_step_time_s", "repeats"))


MATRIX_COLUMNS = {
    "cell": lambda r: r["cell"],
    "status": lambda r: (STATUS_LABELS[r["status"]] + (" (forced)" if r["forced"] else "")
                         + (" (found by benchmark.search)" if r["searched"] else "")),
    "reason": lambda r: r["reason"] or "",
    "predicted_gib": lambda r: fmt(r["predicted_bytes"] / GIB, 2) if r["predicted_bytes"] is not None else "n/a",
    "min_step_s": lambda r: fmt(r["min_step_time_s"], 4),
    "measured_step_s": lambda r: fmt(r["measured_step_time_s"], 3),
    "repeats": lambda r: str(r["repeats"]),
    "_class": lambda r: "" if r["status"] == "run" or r["forced"] else "left-out",  # shown greyed
}


def left_out(matrix: dict) -> dict[str, int]:
    """Why declared cells did not run: reason → number of cells."""
    reasons: dict[str, int] = {}
    for entry in matrix["cells"]:
        if entry["status"] != "run":
            key = "predicted OOM" if entry["status"] == "predicted_oom" else entry["reason"]
            reasons[key] = reasons.get(key, 0) + 1
    return reasons


# ---- text from the frames ------------------------------------------------------------------------------------------

def headline(frames: ReportFrames) -> dict:
    """The few sentences at the top: scaling per series, what was left out, warnings about the timings."""
    lines = []
    scaling = records(frames.scaling)
    series: dict[str, list[dict]] = {}
    for row in scaling:
        series.setdefault(row["series"], []).append(row)
    for label, rows in series.items():
        one = next((r for r in rows if r["ranks"] == 1), None)
        top = max(rows, key=lambda r: r["ranks"])
        if one and top is not one:
            lines.append(scaling_line(label, one, top))
    for row, text in zip(records(frames.backends), format_frame(frames.backends, BACKEND_COLUMNS)):
        lines.append(untrusted(f"NCCL vs Gloo at {text['ranks']} ranks, ZeRO-{text['zero_stage']}: NCCL "
                               f"{text['nccl_faster_pct']}% faster", row["flags"]))
    lines.extend(emulated_precision_lines(frames))
    if frames.left_out:
        lines.append("left out: " + "; ".join(f"{count} cell(s): {reason}"
                                              for reason, count in frames.left_out.items()))
    superlinear = [r["cell"] for r in scaling
                   if any(efficiency_flag(r[key], "") for key in ("efficiency_pct", "efficiency_best_pct"))]
    # repeats that disagree by more than a quarter of their median: the machine was not quiet
    spreads = {r["cell"]: (max(values) - min(values)) / median(values)
               for r in scaling if len(values := r["tokens_per_s_values"]) > 1}
    noisy = {cell: value for cell, value in spreads.items() if value > NOISY_SPREAD}
    return {"lines": lines, "superlinear": superlinear, "noisy": noisy, "noisy_threshold_pct": NOISY_SPREAD * 100,
            "noisy_text": ", ".join(f"{cell} ±{fmt(value * 50, 0)}%" for cell, value in sorted(noisy.items()))}


def emulated_precision_lines(frames: ReportFrames) -> list[str]:
    """Where the pretrain run or benchmark cells ran a precision the device emulates (bf16 on a CPU without bf16
    matmuls): which, and the note their summaries carry, once per distinct note. Their tokens/s and MFU are the
    emulation's, not the precision's on hardware that has it."""
    where: dict[str, list[str]] = {}
    if frames.main.precision_note:
        where.setdefault(frames.main.precision_note, []).append("the pretrain run")
    for cell, notes in frames.cells["precision_notes"].items():
        for note in notes:
            where.setdefault(note, []).append(cell)
    return [f"Emulated precision in {', '.join(runs)}: {note}" for note, runs in where.items()]


def scaling_line(label: str, one: dict, top: dict) -> str:
    """'<series>: 1 → 3 ranks, 223 → 2,757 tokens/s (12.35×, 412% scaling efficiency over its 1-rank cell; 0.73×,
    24% over the fastest 1-rank cell, ddp-ranks1-fp32-gloo; its 1-rank cell runs 94% below the fastest 1-rank cell,
    which flatters its speedup over its own 1-rank cell by 16.90×)'; where the top cell failed a physical check,
    said to be not trustworthy, with its flags (physical_checks.untrusted)."""
    text = format_row(top, SCALING_COLUMNS)
    line = (f"{label}: 1 → {text['ranks']} ranks, {fmt(median(one['tokens_per_s_values']), 0)} → "
            f"{fmt(median(top['tokens_per_s_values']), 0)} tokens/s ({text['speedup']}, "
            f"{text['efficiency_pct']}% scaling efficiency over its 1-rank cell")
    if top["best_cell"] and top["best_cell"] != one["cell"]:
        line += (f"; {text['speedup_best']}, {text['efficiency_best_pct']}% over the fastest 1-rank cell, "
                 f"{top['best_cell']}")
        line += one_rank_overhead(one)
    return untrusted(line + ")", top["flags"])


def one_rank_overhead(one: dict) -> str:
    """What a series' 1-rank cell costs beyond the fastest 1-rank cell (an engine's own work at one rank, such as
    ZeRO's partition copies, with nothing to communicate), and the factor by which that slower baseline inflates the
    series' speedup over its own 1-rank cell: fastest 1-rank tokens/s ÷ its own."""
    if not one["speedup_best"] or one["speedup_best"] >= 1:
        return ""
    return (f"; its 1-rank cell runs {fmt((1 - one['speedup_best']) * 100, 0)}% below the fastest 1-rank cell, "
            f"which flatters its speedup over its own 1-rank cell by {_times(1 / one['speedup_best'])}")


def provenance(summaries: list[RunSummary]) -> dict:
    """Where a table's numbers came from: one line per distinct value, never silently merged."""
    def distinct(values):
        return sorted({str(v) for v in values})
    hardware = [s.provenance["hardware"] for s in summaries]
    versions = [s.provenance["versions"] for s in summaries]
    return {
        "files": len(summaries),
        "git_commit": ", ".join(distinct(s.provenance["git_commit"] for s in summaries)) or "n/a",
        "config_sha256": ", ".join(distinct(s.provenance["config_sha256"] for s in summaries)) or "n/a",
        # results/data/<data_id>: the corpus, tokenizer and shards the runs read (absent from older summaries)
        "data_id": ", ".join(distinct(s.provenance.get("data_id") or "n/a" for s in summaries)),
        "versions": " | ".join(distinct(", ".join(f"{k} {v}" for k, v in sorted(ver.items())) for ver in versions)),
        "hardware": " | ".join(distinct(
            ", ".join(f"{k}={v}" for k, v in sorted(h.items()) if k != "threads_per_rank") for h in hardware)),
        "oversubscribed": f"{sum(s.oversubscribed for s in summaries)} of {len(summaries)} runs",
    }
