"""The report's tables, computed only from a run's JSON files (summary.json, matrix.json, eval/*.json).

Every function here is pure (dicts in, rows of formatted strings out) so a test can recompute any table from the
same files and compare it with the rendered report. One number format (`fmt`) serves every table. The benchmark
tables all read one pandas frame: `repeats_frame` (one row per cell × repeat, from each summary.json) grouped by
cell into `cell_table` (median, min and max over the repeats).
"""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

GIB = 1024**3
NOISY_SPREAD = 0.25  # (max - min) / median of a cell's tokens/s over repeats above which timings are flagged


def fmt(value, digits: int = 1) -> str:
    """One number format for every table, so tests can reproduce the strings."""
    if value is None:
        return "n/a"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    if seconds < 3600:
        return f"{seconds / 60:,.1f} min"
    if seconds < 86400 * 2:
        return f"{seconds / 3600:,.1f} h"
    if seconds < 86400 * 730:
        return f"{seconds / 86400:,.1f} days"
    return f"{seconds / (86400 * 365.25):,.1f} years"


def spread(values: list[float], digits: int = 1, scale: float = 1.0) -> str:
    """'median (min–max)' over repeats; just the value when there is one."""
    values = [v * scale for v in values if v is not None]
    if not values:
        return "n/a"
    if len(values) == 1:
        return fmt(values[0], digits)
    return f"{fmt(statistics.median(values), digits)} ({fmt(min(values), digits)}–{fmt(max(values), digits)})"


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# ---- the main run ------------------------------------------------------------------------------------------------

def main_run_tables(summary: dict, evals: list[dict], target_corpus_tokens: float) -> dict:
    """The main (pretrain) run: its throughput row, held-out evaluation rows and epoch extrapolation."""
    step = summary["step_time_s"]
    throughput = [{
        "ranks": str(summary["world_size"]),
        "device": summary["device"],
        "engine": engine_label({"offload_optimizer": "none", **summary}),
        "zero_stage": str(summary["zero_stage"]),
        "precision": summary["precision"],
        "comm_backend": summary["comm_backend"],
        "global_batch": fmt(summary["global_batch_size"]),
        "tokens_per_s": fmt(summary["tokens_per_s"]),
        "step_time": f"{fmt(step['median'], 3)} ({fmt(step['min'], 3)}–{fmt(step['max'], 3)})",
        "peak_mem_gib": " / ".join(fmt(b / GIB if b is not None else None, 2) for b in summary["peak_mem_bytes"]),
        "mfu_pct": mfu_text([summary]),
        "comm_pct": fmt(summary["comm_fraction"] * 100 if summary["comm_fraction"] is not None else None, 1),
    }]
    epoch_s = target_corpus_tokens / summary["tokens_per_s"] if summary["tokens_per_s"] else None
    evaluation = [{
        "step": fmt(row.step),
        "train_tokens": fmt(_number(row.train_tokens)),
        "loss": fmt(_number(row.loss), 4),
        "perplexity": fmt(_number(row.perplexity), 2),
        "bits_per_byte": fmt(_number(row.bits_per_byte), 4),
        "eval_tokens": fmt(row.tokens),
        "eval_tokens_per_s": fmt(_number(row.eval_tokens_per_s), 0),
    } for row in evaluation_frame(evals).itertuples(index=False)]
    generations = generation_rows(evals)
    return {
        "throughput": throughput,
        "evaluation": evaluation,
        "generations": generations,
        "epoch": {"target_tokens": fmt(float(target_corpus_tokens), 0), "seconds": epoch_s,
                  "text": fmt_duration(epoch_s)},
    }


def evaluation_frame(evals: list[dict]) -> pd.DataFrame:
    """One row per evaluated checkpoint (eval/step<N>.json), in step order; integers stay integers."""
    import pandas as pd

    columns = ["step", "train_tokens", "loss", "perplexity", "bits_per_byte", "tokens", "eval_tokens_per_s"]
    frame = pd.DataFrame.from_records([{key: e.get(key) for key in columns} for e in evals], columns=columns)
    return frame.astype({"step": object, "tokens": object, "train_tokens": object}).sort_values("step", kind="stable")


def generation_rows(evals: list[dict]) -> list[dict]:
    """Continuations of the first and the last evaluated checkpoint: one row per (step, prompt)."""
    with_text = sorted((e for e in evals if e.get("generations")), key=lambda e: e["step"])
    shown = with_text[:1] + with_text[1:][-1:]
    rows = []
    for e in shown:
        by_prompt: dict[str, dict] = {}
        for g in e["generations"]:
            by_prompt.setdefault(g["prompt"], {})[g["mode"]] = g["text"]
        rows += [{"step": fmt(e["step"]), "prompt": prompt, "greedy": texts.get("greedy", ""),
                  "sampled": texts.get("sampled", "")} for prompt, texts in by_prompt.items()]
    return rows


def headline(matrix: dict, scaling: list[dict], backends: list[dict]) -> dict:
    """The few sentences at the top: scaling per series, what was left out, warnings about the timings."""
    lines = []
    series: dict[str, list[dict]] = {}
    for row in scaling:
        series.setdefault(row["series"], []).append(row)
    for label, rows in series.items():
        one = next((r for r in rows if r["_gpus"] == 1), None)
        top = max(rows, key=lambda r: r["_gpus"])
        if one and top is not one:
            lines.append(f"{label}: 1 → {top['ranks']} ranks, {fmt(median(one['_tps']), 0)} → "
                         f"{fmt(median(top['_tps']), 0)} tokens/s ({top['speedup']}, {top['efficiency_pct']}% "
                         f"scaling efficiency)")
    for row in backends:
        lines.append(f"NCCL vs Gloo at {row['ranks']} ranks, ZeRO-{row['zero_stage']}: NCCL "
                     f"{row['nccl_faster_pct']}% faster")
    reasons: dict[str, int] = {}
    for entry in matrix["cells"]:
        if entry["status"] != "run":
            key = "predicted OOM" if entry["status"] == "predicted_oom" else entry["reason"]
            reasons[key] = reasons.get(key, 0) + 1
    if reasons:
        lines.append("left out: " + "; ".join(f"{count} cell(s): {reason}" for reason, count in reasons.items()))
    superlinear = [r["cell"] for r in scaling if r["_speedup"] and r["_speedup"] / r["_gpus"] > 1.05]
    # repeats that disagree by more than a quarter of their median: the machine was not quiet
    spreads = {r["cell"]: (max(r["_tps"]) - min(r["_tps"])) / median(r["_tps"]) for r in scaling if len(r["_tps"]) > 1}
    noisy = {cell: value for cell, value in spreads.items() if value > NOISY_SPREAD}
    return {"lines": lines, "superlinear": superlinear, "noisy": noisy, "noisy_threshold_pct": NOISY_SPREAD * 100,
            "noisy_text": ", ".join(f"{cell} ±{fmt(value * 50, 0)}%" for cell, value in sorted(noisy.items()))}


# ---- benchmark cells ---------------------------------------------------------------------------------------------

# What one repeat of a cell measured (its summary.json), aggregated per cell over the repeats.
FIGURES = ("tokens_per_s", "step_time_s", "mem_bytes", "mfu", "comm_fraction", "peak_flops_per_rank")
REPEAT_COLUMNS = ("cell", "repeat", *FIGURES, "oversubscribed", "global_batch_size", "tokens_per_step",
                  "mfu_note", "comm_method", "peak_flops_source", "flops_per_token")


def repeats_frame(matrix: dict, runs_by_cell: dict[str, list[dict]]) -> pd.DataFrame:
    """One row per benchmark cell × repeat, read from that repeat's summary.json (peak memory: its worst rank)."""
    import pandas as pd

    records = [{"cell": entry["cell"], "repeat": number, "tokens_per_s": run.get("tokens_per_s"),
                "step_time_s": run["step_time_s"]["median"], "mem_bytes": max(run["peak_mem_bytes"]),
                "mfu": run.get("mfu"), "comm_fraction": run.get("comm_fraction"),
                "peak_flops_per_rank": run.get("peak_flops_per_rank"),
                "oversubscribed": bool(run.get("oversubscribed")),
                "global_batch_size": run["global_batch_size"], "tokens_per_step": run["tokens_per_step"],
                "mfu_note": run.get("mfu_note"), "comm_method": run.get("comm_method"),
                "peak_flops_source": run.get("peak_flops_source"), "flops_per_token": run.get("flops_per_token")}
               for entry in matrix["cells"] for number, run in enumerate(runs_by_cell.get(entry["cell"]) or [], 1)]
    frame = pd.DataFrame.from_records(records, columns=list(REPEAT_COLUMNS))
    # None (not measured) as NaN, so that every figure column is numeric
    frame[list(FIGURES)] = frame[list(FIGURES)].apply(pd.to_numeric)
    return frame


def cell_table(matrix: dict, runs_by_cell: dict[str, list[dict]]) -> pd.DataFrame:
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
    return table


def _number(value):
    """A frame's number as the plain Python value the formats expect (None for NaN; an integral count as int)."""
    if value is None or value != value:
        return None
    return value.item() if hasattr(value, "item") else value


def engine_of(entry: dict) -> str:
    return entry.get("engine", "deepspeed")  # matrix.json and summaries written before train.engine: DeepSpeed


def engine_label(entry: dict) -> str:
    """'DeepSpeed ZeRO-2', 'DeepSpeed ZeRO-2 + optimizer offload', 'DDP' or 'FSDP2'."""
    engine = engine_of(entry)
    if engine != "deepspeed":
        return {"ddp": "DDP", "fsdp": "FSDP2"}[engine]
    label = f"DeepSpeed ZeRO-{entry['zero_stage']}"
    return label + (" + optimizer offload" if entry.get("offload_optimizer", "none") != "none" else "")


def group_key(entry: dict) -> tuple:
    """Cells that differ only in their rank count form one scaling series."""
    return (engine_of(entry), entry["zero_stage"], entry["precision"], entry["comm_backend"],
            entry["micro_batch_size"], entry["offload_optimizer"])


def group_label(entry: dict) -> str:
    layout = f"ZeRO-{entry['zero_stage']}" if engine_of(entry) == "deepspeed" else engine_label(entry)
    label = f"{layout}, {entry['precision']}, {entry['comm_backend']}"
    label += f", micro batch {entry['micro_batch_size']}"
    if entry["offload_optimizer"] != "none":
        label += ", optimizer offload"
    return label


def scaling_rows(matrix: dict, runs_by_cell: dict[str, list[dict]], target_corpus_tokens: float) -> list[dict]:
    """The source articles' table: per series, 1 vs N ranks — tokens/s, speedup, efficiency, memory, time per epoch."""
    cells = cell_table(matrix, runs_by_cell)
    entries = [e for e in matrix["cells"] if e["cell"] in cells.index]
    rows = []
    for key in sorted({group_key(e) for e in entries}, key=str):
        series = sorted((e for e in entries if group_key(e) == key), key=lambda e: e["gpus"])
        base = next((e for e in series if e["gpus"] == 1), None)
        base_tps = _number(cells.at[base["cell"], "tokens_per_s"]) if base else None
        for entry in series:
            cell = cells.loc[entry["cell"]]
            tps = _number(cell["tokens_per_s"])
            speedup = tps / base_tps if base_tps and tps else None
            rows.append({
                "series": group_label(entry), "cell": entry["cell"], "ranks": str(entry["gpus"]),
                "global_batch": fmt(_number(cell["global_batch_size"])), "repeats": str(cell["repeats"]),
                "tokens_per_s": spread(cell["tokens_per_s_values"], 0),
                "speedup": f"{fmt(speedup, 2)}×" if speedup else "n/a",
                "efficiency_pct": fmt(speedup / entry["gpus"] * 100, 0) if speedup else "n/a",
                "mem_gib": spread(cell["mem_bytes_values"], 2, 1 / GIB),
                "epoch": fmt_duration(target_corpus_tokens / tps) if tps else "n/a",
                "oversubscribed": "yes" if cell["oversubscribed"] else "no",
                "_tps": cell["tokens_per_s_values"], "_speedup": speedup, "_gpus": entry["gpus"],
                "_engine": engine_of(entry),
            })
    return rows


def measurable_prediction(estimate: dict, device: str) -> int:
    """The part of the predicted peak that the run's own measurement counts.

    CUDA: torch.cuda.max_memory_allocated leaves out the CUDA context (runtime). CPU: peak RSS holds everything,
    offloaded states included.
    """
    if device == "cuda":
        return estimate["per_rank"] - estimate["runtime"]
    return estimate["per_rank"] + estimate["host_states"]


def memory_rows(matrix: dict, runs_by_cell: dict[str, list[dict]]) -> list[dict]:
    """Per cell: measured peak per rank against the memory model's prediction, by ZeRO stage."""
    rows = []
    cells = cell_table(matrix, runs_by_cell)
    entries = [e for e in matrix["cells"] if e["cell"] in cells.index and e.get("estimate")]
    for entry in sorted(entries, key=lambda e: (e["gpus"], e["zero_stage"], e["cell"])):
        est = entry["estimate"]
        cell = cells.loc[entry["cell"]]
        predicted = measurable_prediction(est, matrix["device"])
        measured = _number(cell["mem_bytes"])
        rows.append({
            "cell": entry["cell"], "engine": engine_label(entry), "zero_stage": str(entry["zero_stage"]),
            "ranks": str(entry["gpus"]),
            "precision": entry["precision"], "measured_gib": spread(cell["mem_bytes_values"], 3, 1 / GIB),
            "predicted_gib": fmt(predicted / GIB, 3),
            "states_gib": fmt(est["model_states"] / GIB, 3), "activations_gib": fmt(est["activations"] / GIB, 3),
            "other_gib": fmt((predicted - est["model_states"] - est["activations"]) / GIB, 3),
            "ratio": fmt(measured / predicted, 2) if predicted else "n/a",
            "formula": est["state_formula"],
            "_measured": measured, "_predicted": predicted, "_states": est["model_states"],
            "_activations": est["activations"],
        })
    return rows


def communication_rows(matrix: dict, runs_by_cell: dict[str, list[dict]]) -> list[dict]:
    """Communication share of step time per multi-rank cell."""
    rows = []
    cells = cell_table(matrix, runs_by_cell)
    for entry in matrix["cells"]:
        if entry["cell"] not in cells.index or entry["gpus"] < 2:
            continue
        cell = cells.loc[entry["cell"]]
        rows.append({"cell": entry["cell"], "engine": engine_of(entry), "ranks": str(entry["gpus"]),
                     "comm_backend": entry["comm_backend"],
                     "comm_pct": spread(cell["comm_fraction_values"], 1, 100) if cell["comm_fraction_values"]
                     else "not measured",
                     "method": cell["comm_method"] or "n/a",
                     "_comm": _number(cell["comm_fraction"])})
    return rows


def backend_rows(matrix: dict, runs_by_cell: dict[str, list[dict]]) -> list[dict]:
    """NCCL against Gloo for cells that ran with both and are otherwise equal."""
    by_key = {}
    cells = cell_table(matrix, runs_by_cell)
    for entry in matrix["cells"]:
        if entry["cell"] in cells.index:
            key = (entry["gpus"], engine_of(entry), entry["zero_stage"], entry["precision"],
                   entry["micro_batch_size"], entry["offload_optimizer"])
            by_key.setdefault(key, {})[entry["comm_backend"]] = entry
    rows = []
    for key, pair in sorted(by_key.items()):
        if {"nccl", "gloo"} <= set(pair):
            nccl = _number(cells.at[pair["nccl"]["cell"], "tokens_per_s"])
            gloo = _number(cells.at[pair["gloo"]["cell"], "tokens_per_s"])
            rows.append({"ranks": str(key[0]), "engine": engine_label(pair["nccl"]), "zero_stage": str(key[2]),
                         "precision": key[3],
                         "nccl_tokens_per_s": fmt(nccl, 0), "gloo_tokens_per_s": fmt(gloo, 0),
                         "nccl_faster_pct": fmt((nccl / gloo - 1) * 100, 1),
                         "_ratio": nccl / gloo})
    return rows


def engine_rows(matrix: dict, runs_by_cell: dict[str, list[dict]]) -> list[dict]:
    """Engines side by side on the same work: cells equal in ranks, precision, backend and micro batch (so the same
    model, data and global batch), one row per engine setup, fastest first. Empty unless two engines ran."""
    cells = cell_table(matrix, runs_by_cell)
    entries = [e for e in matrix["cells"] if e["cell"] in cells.index]
    groups: dict[tuple, list[dict]] = {}
    for entry in entries:
        key = (entry["gpus"], entry["precision"], entry["comm_backend"], entry["micro_batch_size"])
        groups.setdefault(key, []).append(entry)
    one_rank = {group_key(e): e for e in entries if e["gpus"] == 1}
    rows = []
    for key, group in sorted(groups.items()):
        if len({engine_of(e) for e in group}) < 2:
            continue
        tps = {e["cell"]: _number(cells.at[e["cell"], "tokens_per_s"]) for e in group}
        fastest = max(v for v in tps.values() if v)
        for entry in sorted(group, key=lambda e: -(tps[e["cell"]] or 0)):
            cell, st = entry["cell"], cells.loc[entry["cell"]]
            base = one_rank.get(group_key(entry))
            base_tps = _number(cells.at[base["cell"], "tokens_per_s"]) if base else None
            speedup = tps[cell] / base_tps if base_tps and tps[cell] else None
            predicted = measurable_prediction(entry["estimate"], matrix["device"]) if entry.get("estimate") else None
            measured = _number(st["mem_bytes"])
            comm = st["comm_fraction_values"]
            rows.append({
                "ranks": str(key[0]), "precision": key[1], "comm_backend": key[2], "engine": engine_label(entry),
                "cell": cell, "repeats": str(st["repeats"]), "tokens_per_s": spread(st["tokens_per_s_values"], 0),
                "vs_fastest": f"{fmt(tps[cell] / fastest, 2)}×" if tps[cell] else "n/a",
                "speedup": f"{fmt(speedup, 2)}×" if speedup and entry["gpus"] > 1 else "—",
                "measured_gib": spread(st["mem_bytes_values"], 3, 1 / GIB),
                "predicted_gib": fmt(predicted / GIB, 3) if predicted else "n/a",
                "ratio": fmt(measured / predicted, 2) if predicted and measured else "n/a",
                "formula": entry["estimate"]["state_formula"] if entry.get("estimate") else "n/a",
                "comm_pct": spread(comm, 1, 100) if comm else ("—" if key[0] == 1 else "not measured"),
                "_tps": tps[cell], "_engine": engine_of(entry),
            })
    return rows


def lm_eval_rows(results: list[dict]) -> list[dict]:
    """lm-eval's scores (lm_eval/step<N>.json): one row per checkpoint × task × metric, with its stderr where lm-eval
    gives one; checkpoints in step order. A pandas frame, long form, so any number of tasks and metrics fits."""
    import pandas as pd

    records = [{"step": result["step"], "task": task, "metric": metric, "value": value,
                "stderr": scores.get(f"{metric}_stderr"), "samples": result["samples"].get(task)}
               for result in results for task, scores in result["tasks"].items()
               for metric, value in scores.items()
               if metric not in ("name", "alias", "sample_len") and not metric.endswith("_stderr")
               and isinstance(value, (int, float))]
    if not records:
        return []
    frame = pd.DataFrame.from_records(records).sort_values(["task", "metric", "step"], kind="stable")
    return [{"step": fmt(int(row.step)), "task": row.task, "metric": row.metric, "value": fmt(float(row.value), 4),
             "stderr": fmt(float(row.stderr), 4) if pd.notna(row.stderr) else "n/a",
             "samples": fmt(int(row.samples)) if pd.notna(row.samples) else "n/a"}
            for row in frame.itertuples(index=False)]


def mfu_text(runs: list[dict]) -> str:
    """MFU in percent over repeats (summary.json dicts), or why it is not printed (see `mfu_figure_text`)."""
    return mfu_figure_text([r.get("mfu") for r in runs], [r["mfu_note"] for r in runs if r.get("mfu_note")],
                           runs[0].get("peak_flops_source"))


def mfu_figure_text(mfus: list, notes: list[str], peak_source: str | None) -> str:
    """MFU in percent over repeats, or why it is not printed: above 100 % is impossible (a peak below what the run
    achieved is not its peak), whether the run refused it itself or an older summary.json holds one."""
    impossible = [m for m in mfus if m is not None and m > 1.0]
    if impossible or notes:
        return ("not reported: " + notes[0]) if notes else (
            f"not reported: MFU would be {fmt(max(impossible) * 100, 0)}%, above 100 %, so the peak "
            f"({peak_source or 'n/a'}) is not this run's peak")
    return spread(mfus, 2, 100)


def mfu_rows(matrix: dict, runs_by_cell: dict[str, list[dict]]) -> list[dict]:
    rows = []
    cells = cell_table(matrix, runs_by_cell)
    for entry in matrix["cells"]:
        if entry["cell"] not in cells.index:
            continue
        cell = cells.loc[entry["cell"]]
        rows.append({"cell": entry["cell"], "ranks": str(entry["gpus"]),
                     "mfu_pct": mfu_figure_text(cell["mfu_values"], cell["mfu_notes"], cell["peak_flops_source"]),
                     "peak_tflops": spread(cell["peak_flops_per_rank_values"], 3, 1e-12),
                     "peak_source": cell["peak_flops_source"] or "n/a",
                     "flops_per_token": fmt(_number(cell["flops_per_token"]), 0)})
    return rows


STATUS_LABELS = {"run": "ran", "unsupported": "left out: not supported here", "predicted_oom": "predicted OOM"}


def matrix_rows(matrix: dict, runs_by_cell: dict[str, list[dict]]) -> list[dict]:
    """Every declared cell: what happened to it, the pre-flight prediction and the time estimate."""
    rows = []
    order = {"run": 0, "predicted_oom": 1, "unsupported": 2}
    cells = cell_table(matrix, runs_by_cell)
    for entry in sorted(matrix["cells"], key=lambda e: order[e["status"]]):
        ran = entry["cell"] in cells.index
        est = entry.get("estimate")
        estimate = entry.get("time_estimate")
        measured_step = _number(cells.at[entry["cell"], "step_time_s"]) if ran else None
        status = STATUS_LABELS[entry["status"]] + (" (forced)" if entry.get("forced") else "")
        rows.append({
            "cell": entry["cell"], "status": status, "reason": entry.get("reason") or "",
            "predicted_gib": fmt(est["per_rank"] / GIB, 2) if est else "n/a",
            "min_step_s": fmt(estimate["min_step_time_s"], 4) if estimate else "n/a",
            "measured_step_s": fmt(measured_step, 3),
            "repeats": str(cells.at[entry["cell"], "repeats"] if ran else 0),
            "_class": "" if entry["status"] == "run" or entry.get("forced") else "left-out",  # shown greyed
        })
    return rows


def provenance(summaries: list[dict]) -> dict:
    """Where a table's numbers came from: one line per distinct value, never silently merged."""
    def distinct(values):
        return sorted({str(v) for v in values})
    hardware = [s["provenance"]["hardware"] for s in summaries]
    versions = [s["provenance"]["versions"] for s in summaries]
    return {
        "files": len(summaries),
        "git_commit": ", ".join(distinct(s["provenance"]["git_commit"] for s in summaries)) or "n/a",
        "config_sha256": ", ".join(distinct(s["provenance"]["config_sha256"] for s in summaries)) or "n/a",
        "versions": " | ".join(distinct(", ".join(f"{k} {v}" for k, v in sorted(ver.items())) for ver in versions)),
        "hardware": " | ".join(distinct(
            ", ".join(f"{k}={v}" for k, v in sorted(h.items()) if k != "threads_per_rank") for h in hardware)),
        "oversubscribed": f"{sum(bool(s.get('oversubscribed')) for s in summaries)} of {len(summaries)} runs",
    }
