"""The report: tables and plots computed only from a run's JSON files, rendered as Markdown and self-contained HTML.

Inputs: the main run's summary.json / metrics.jsonl, eval/step<N>.json, and the benchmark's matrix.json and
bench/<cell>/rep<r>/summary.json. Tables come from `pretrain_bench.tables` (pure, so a test can recompute them),
the claims from `pretrain_bench.claims`, plots from `pretrain_bench.plots`. Figures that were not measured in this
run are labelled *predicted* or *extrapolated* with their formula.
"""
from __future__ import annotations

import base64
import json
import re
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from . import plots as plotting
from .claims import CLAIMS, SETUP, check_claims
from .io import atomic_write_text, read_jsonl
from .tables import (
    GIB,
    backend_rows,
    communication_rows,
    engine_label,
    engine_rows,
    fmt,
    fmt_duration,
    headline,
    lm_eval_rows,
    main_run_tables,
    matrix_rows,
    memory_rows,
    mfu_rows,
    provenance,
    scaling_rows,
)

__all__ = ["GIB", "fmt", "fmt_duration", "build_tables", "load_bench", "build_report"]


def load_bench(summary_paths: list[Path]) -> dict[str, list[dict]]:
    """{cell: [summary of rep1, rep2, ...]} from results/<name>/bench/<cell>/rep<r>/summary.json paths."""
    runs: dict[str, list[tuple[int, dict]]] = {}
    for path in map(Path, summary_paths):
        rep = int(path.parent.name.removeprefix("rep"))
        runs.setdefault(path.parent.parent.name, []).append((rep, json.loads(path.read_text())))
    return {cell: [s for _, s in sorted(reps, key=lambda item: item[0])] for cell, reps in runs.items()}


def build_tables(summary: dict, evals: list[dict], target_corpus_tokens: float, matrix: dict | None = None,
                 runs_by_cell: dict[str, list[dict]] | None = None, lm_evals: list[dict] = ()) -> dict:
    """Every table of the report, as rows of formatted strings (plus raw `_` fields the plots use)."""
    tables = main_run_tables(summary, evals, target_corpus_tokens)
    matrix = matrix or {"cells": [], "device": summary["device"]}
    runs_by_cell = runs_by_cell or {}
    scaling = scaling_rows(matrix, runs_by_cell, target_corpus_tokens)
    memory = memory_rows(matrix, runs_by_cell)
    comms = communication_rows(matrix, runs_by_cell)
    backends = backend_rows(matrix, runs_by_cell)
    engines = engine_rows(matrix, runs_by_cell)
    bench_summaries = [s for runs in runs_by_cell.values() for s in runs]
    tables.update(
        matrix=matrix_rows(matrix, runs_by_cell), scaling=scaling, memory=memory, communication=comms,
        backends=backends, engines=engines, lm_eval=lm_eval_rows(list(lm_evals)), mfu=mfu_rows(matrix, runs_by_cell),
        headline=headline(matrix, scaling, backends),
        claims=check_claims(scaling, memory, backends, comms, target_corpus_tokens, matrix["device"]),
        provenance={"main": provenance([summary]), "bench": provenance(bench_summaries) if bench_summaries else None},
    )
    return tables


def _cell(text) -> str:
    """A Markdown table cell: pipes escaped, line breaks shown as ⏎."""
    return str(text).replace("|", "\\|").replace("\r", "").replace("\n", "⏎")


def _code(text) -> str:
    """Verbatim text in a Markdown table cell (a code span; ⏎ marks line breaks)."""
    text = _cell(text)
    fence = "``" if "`" in text else "`"
    return f"{fence} {text} {fence}"  # CommonMark drops one padding space on each side


def _template(html: bool):
    """templates/report.j2 compiled for one format (Jinja fixes autoescaping when it compiles: HTML escapes every
    value, Markdown keeps them as written and escapes table cells with the `cell` and `code` filters)."""
    env = Environment(loader=FileSystemLoader(Path(__file__).parent / "templates"), undefined=StrictUndefined,
                      autoescape=html, keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
    env.filters["cell"] = _cell
    env.filters["code"] = _code
    return env.get_template("report.j2")


def weights_origin(summary: dict) -> str:
    """Where the main run's starting weights came from, for the report's first lines."""
    init = summary.get("init_from")
    if init:
        revision = f", revision {init['revision']}" if init.get("revision") else ""
        return f"continued from {init['uri']} (model.init_from{revision}; read from {init['path']})"
    if summary.get("init_seed") is not None:
        return f"random initialisation (train.seed {summary['init_seed']})"
    return "random initialisation (this summary.json predates model.init_from)"


def eval_during_training(summary: dict) -> str | None:
    """One sentence on train.eval_every's evaluations: how many, the last result and the wall time they took."""
    held = summary.get("eval_during_training")
    if not held:
        return None
    text = (f"train.eval_every {held['every']}: {held['evaluations']} evaluation(s) on a fixed slice of "
            f"{held['samples']} val samples ({fmt(held['tokens'])} tokens, split over the ranks)")
    if held["last"]:
        text += (f"; the last, at step {held['last']['step']}, gave held-out loss {held['last']['loss']:.4f} "
                 f"(perplexity {fmt(held['last']['perplexity'], 2)})")
    took = f"{held['time_s']:.1f} s" if held["time_s"] < 60 else fmt_duration(held["time_s"])
    return text + f". Evaluation took {took} of wall time in all, kept out of the step timings and tokens/s above."


def build_report(summary_path: Path, metrics_path: Path, eval_paths: list[Path], out_md: Path, out_html: Path,
                 plot_dir: Path, *, target_corpus_tokens: float, matrix_path: Path | None = None,
                 bench_paths: list[Path] = (), lm_eval_paths: list[Path] = ()) -> dict:
    summary = json.loads(Path(summary_path).read_text())
    records = read_jsonl(metrics_path)
    evals = [json.loads(Path(p).read_text()) for p in eval_paths]
    matrix = json.loads(Path(matrix_path).read_text()) if matrix_path else None
    runs_by_cell = load_bench(bench_paths)
    lm_evals = [json.loads(Path(p).read_text()) for p in lm_eval_paths]
    tables = build_tables(summary, evals, target_corpus_tokens, matrix, runs_by_cell, lm_evals)

    plot_dir = Path(plot_dir)
    plot_dir.mkdir(parents=True, exist_ok=True)
    device = (matrix or {}).get("device", summary["device"])
    paths = {
        "throughput": plotting.throughput_plot(records, summary["warmup_timing_steps"],
                                               summary.get("checkpoints") or [], plot_dir / "throughput.png"),
        "loss": plotting.loss_plot(records, evals, plot_dir / "loss.png"),
    }
    if evals:
        paths["eval"] = plotting.eval_plot(evals, plot_dir / "eval.png")
    if tables["scaling"]:
        paths["scaling"] = plotting.scaling_plot(tables["scaling"], plot_dir / "scaling.png")
    if tables["memory"]:
        paths["memory"] = plotting.memory_plot(tables["memory"], device, plot_dir / "memory.png")
    if tables["communication"]:
        paths["communication"] = plotting.communication_plot(tables["communication"], plot_dir / "communication.png")
    plots = {key: {"name": p.name, "rel": f"plots/{p.name}", "data": base64.b64encode(p.read_bytes()).decode()}
             for key, p in paths.items()}

    bench = [s for runs in runs_by_cell.values() for s in runs]
    context = {
        "summary": summary, "tables": tables, "fmt": fmt, "plots": plots, "matrix": matrix,
        "peak": (matrix or {}).get("peak"), "claims_source": CLAIMS, "setup": SETUP, "GIB": GIB,
        "bench_count": len(bench), "cells_run": len(runs_by_cell),
        "bench_oversubscribed": sum(bool(s.get("oversubscribed")) for s in bench),
        "comm_method": next((s["comm_method"] for s in bench if s.get("comm_fraction") is not None),
                            summary.get("comm_method")),
        "peak_mem_kind": (bench[0] if bench else summary)["peak_mem_kind"],
        "weights_origin": weights_origin(summary), "eval_during": eval_during_training(summary),
        "flops_formula": (bench[0] if bench else summary)["flops_formula"],
        "main_engine": engine_label({"offload_optimizer": "none", **summary}),
    }
    out_md, out_html = Path(out_md), Path(out_html)
    out_md.parent.mkdir(parents=True, exist_ok=True)
    # one template, two formats: captions and notes are written once (templates/report.j2)
    markdown = _template(html=False).render(**context, html=False)
    atomic_write_text(out_md, re.sub(r"\n{3,}", "\n\n", markdown).lstrip("\n"))  # blocks apart by one blank line
    atomic_write_text(out_html, _template(html=True).render(**context, html=True))
    return tables
