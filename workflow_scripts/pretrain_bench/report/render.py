"""The report: tables and plots computed only from a run's JSON files, rendered as Markdown and self-contained HTML.

Inputs: the main run's summary.json / metrics.jsonl, eval/step<N>.json, and the benchmark's matrix.json and
bench/<cell>/rep<r>/summary.json (each read as a `RunSummary`). The tables are computed once as frames of numbers
(`pretrain_bench.report.tables.report_frames`, pure, so a test can recompute them); the claims
(`pretrain_bench.report.claims`) and the plots (`pretrain_bench.report.plots`) read those numbers, and `format_tables`
formats them once for the template. Figures that were not measured in this run are labelled *predicted* or
*extrapolated* with their formula.
"""
from __future__ import annotations

import base64
import json
import re
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from pretrain_bench.core.formats import fmt, fmt_duration
from pretrain_bench.core.io import atomic_write_text, read_jsonl
from pretrain_bench.report import plots as plotting
from pretrain_bench.report import tables as t
from pretrain_bench.report.claims import CLAIMS, SETUP, check_claims, formula_texts
from pretrain_bench.report.cost import cost_columns, cost_frame
from pretrain_bench.report.experts import is_moe, load_records, moe_section
from pretrain_bench.report.physical_checks import OTHER_CPU_LIMIT_PCT, peak_flag, run_busy_flag, run_contention_text
from pretrain_bench.report.recommendation import ranking, recommend, rerun_benchmark_command
from pretrain_bench.report.tables import GIB, ReportFrames, engine_label, format_frame, report_frames
from pretrain_bench.train.engines.spec import PLAIN_BASELINE
from pretrain_bench.train.memory.model import labelled
from pretrain_bench.train.metrics import OTHER_CPU_METHOD
from pretrain_bench.train.run_summary import RunSummary

__all__ = ["GIB", "fmt", "fmt_duration", "build_tables", "format_tables", "load_bench", "build_report"]


def load_bench(summary_paths: list[Path]) -> dict[str, list[RunSummary]]:
    """{cell: [summary of rep1, rep2, ...]} from results/<name>/bench/<cell>/rep<r>/summary.json paths."""
    runs: dict[str, list[tuple[int, RunSummary]]] = {}
    for path in map(Path, summary_paths):
        rep = int(path.parent.name.removeprefix("rep"))
        runs.setdefault(path.parent.parent.name, []).append((rep, RunSummary.read(path)))
    return {cell: [s for _, s in sorted(reps, key=lambda item: item[0])] for cell, reps in runs.items()}


def format_recommendation(frames: ReportFrames, runs_by_cell: dict[str, list[RunSummary]],
                          configfiles: list[str] = ()) -> dict | None:
    """The recommendation (fastest measured setup that passed the physical checks, and the configured run against
    it) with its ranking as text; `configfiles`: the run's --configfile arguments, for the command that measures the
    benchmark again."""
    gpus = max([frames.main.world_size, *(run.world_size for run in frames.bench)])
    found = recommend(runs_by_cell, frames.main, frames.peak,
                      rerun_benchmark_command(frames.main.name, gpus, list(configfiles)))
    if found is None:
        return None
    ranking = format_frame(found["ranking"], RANKING_COLUMNS)
    return {"sentence": found["sentence"], "main": found["main"], "ranking": ranking, "trusted": found["trusted"],
            "rerun": found["rerun"]}


RANKING_COLUMNS = {
    "cell": lambda r: r["cell"], "setup": lambda r: r["setup"], "repeats": lambda r: str(r["repeats"]),
    "tokens_per_s": lambda r: t.spread(r["tokens_per_s_values"], 0),
    "mem_gib": lambda r: t.spread(r["mem_bytes_values"], 2, 1 / GIB),
    "mfu_pct": lambda r: t.mfu_figure_text(r["mfu_values"], r["mfu_notes"]),
    "flags": lambda r: "; ".join(r["flags"]) or "—",
}


def format_cost(frames: ReportFrames, runs_by_cell: dict[str, list[RunSummary]], price: dict | None,
                main_flags: list[str]) -> dict:
    """The cost table as text, and the price it used (None: device-hours only); main_flags: the main run's timing
    flags."""
    table = cost_frame(ranking(runs_by_cell, frames.peak), frames.main, frames.target_corpus_tokens, price,
                       main_flags)
    return {"rows": format_frame(table, cost_columns(price)), "price": price,
            "price_text": f"{fmt(price['amount'], 2)} {price['currency']}" if price else None}


def format_tables(frames: ReportFrames, runs_by_cell: dict[str, list[RunSummary]] | None = None,
                  price: dict | None = None, configfiles: list[str] = ()) -> dict:
    """Every table of the report as rows of text, as the template prints them: the frames formatted once.
    price: report.gpu_hour_price ({amount, currency}), or None for device-hours only; configfiles: the run's
    --configfile arguments (format_recommendation)."""
    runs_by_cell = runs_by_cell or {}
    main_flags = [flag for flag in [run_busy_flag(frames.main.provenance)] if flag]
    return {
        "recommendation": format_recommendation(frames, runs_by_cell, configfiles),
        "cost": format_cost(frames, runs_by_cell, price, main_flags),
        "throughput": format_frame(frames.throughput, t.THROUGHPUT_COLUMNS),
        "evaluation": format_frame(frames.evaluation, t.EVALUATION_COLUMNS),
        "generations": format_frame(frames.generations, t.GENERATION_COLUMNS),
        "babbling": t.babbling_steps(frames.generations), "babble_perplexity": fmt(t.BABBLE_PERPLEXITY, 0),
        "epoch": {"target_tokens": fmt(float(frames.target_corpus_tokens), 0), "seconds": frames.epoch_s,
                  "text": fmt_duration(frames.epoch_s)},
        "matrix": format_frame(frames.matrix, t.MATRIX_COLUMNS),
        "scaling": format_frame(frames.scaling, t.SCALING_COLUMNS),
        "memory": format_frame(frames.memory, t.MEMORY_COLUMNS),
        "communication": format_frame(frames.communication, t.COMMUNICATION_COLUMNS),
        "backends": format_frame(frames.backends, t.BACKEND_COLUMNS),
        "engines": format_frame(frames.engines, t.ENGINE_COLUMNS),
        "lm_eval": format_frame(frames.lm_eval, t.LM_EVAL_COLUMNS),
        "mfu": format_frame(frames.mfu, t.MFU_COLUMNS),
        "headline": t.headline(frames),
        "main_load": run_contention_text(frames.main.provenance),
        "main_flags": t.mfu_flags(frames.main.peak_flops_source, frames.peak,
                                  main_flags + t.run_over_peak_flags(frames.main)),
        "peak_load": run_contention_text(frames.peak or {}),
        "peak_flag": peak_flag(frames.peak),
        "claims": check_claims(frames),
        "provenance": {"main": t.provenance([frames.main]),
                       "bench": t.provenance(frames.bench) if frames.bench else None},
    }


def build_tables(summary: RunSummary, evals: list[dict], target_corpus_tokens: float, matrix: dict | None = None,
                 runs_by_cell: dict[str, list[RunSummary]] | None = None, lm_evals: list[dict] = (),
                 peak: dict | None = None, price: dict | None = None, configfiles: list[str] = ()) -> dict:
    """Every table of the report, as rows of text (`format_tables` of `report_frames`)."""
    frames = report_frames(summary, evals, target_corpus_tokens, matrix, runs_by_cell, lm_evals, peak)
    return format_tables(frames, runs_by_cell, price, configfiles)


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


def weights_origin(summary: RunSummary) -> str:
    """Where the main run's starting weights came from, for the report's first lines."""
    init = summary.init_from
    if init:
        revision = f", revision {init['revision']}" if init["revision"] else ""
        return f"continued from {init['uri']} (model.init_from{revision}; read from {init['path']})"
    return f"random initialisation (train.seed {summary.init_seed})"


def eval_during_training(summary: RunSummary) -> str | None:
    """One sentence on train.eval_every's evaluations: how many, the last result and the wall time they took."""
    held = summary.eval_during_training
    if not held:
        return None
    text = (f"train.eval_every {held['every']}: {held['evaluations']} evaluation(s) on a fixed slice of "
            f"{held['samples']} val samples ({fmt(held['tokens'])} tokens, split over the ranks)")
    if held["last"]:
        text += (f"; the last, at step {held['last']['step']}, gave held-out loss {held['last']['loss']:.4f} "
                 f"(perplexity {fmt(held['last']['perplexity'], 2)})")
    return text + (f". Evaluation took {fmt_duration(held['time_s'])} of wall time in all, kept out of the step "
                   "timings and tokens/s above.")


def peak_origin(peak: dict, path: Path | None) -> str:
    """Where the machine's peak came from: 'measured once for this machine and software by rule measure_peak
    (results/data/machine-<id>/peak.json, 2026-01-02T03:04:05+00:00, torch 2.13.0), shared by every run name on it'
    (what an older peak.json records of it, where it lacks the identity)."""
    where = ", ".join(str(part) for part in (path, peak.get("measured_at"),
                                             f"torch {peak['identity']['torch']}" if peak.get("identity") else None)
                      if part)
    scope = " for this machine and software" if peak.get("identity") else ""
    shared = ", shared by every run name on it" if peak.get("identity") else ""
    return f"measured once{scope} by rule measure_peak" + (f" ({where})" if where else "") + shared


def plain_baseline_text(matrix: dict | None, measured: set[str]) -> str | None:
    """Whether the matrix measured a plain single-device run (DDP on one rank, bench_matrix.baseline_cells) among
    the 1-rank cells the speedups divide by, and if not, why; None without a matrix that measures scaling."""
    if not matrix or not any(entry["gpus"] > 1 for entry in matrix["cells"]):
        return None
    plain = [entry for entry in matrix["cells"] if entry["engine"] == PLAIN_BASELINE and entry["gpus"] == 1]
    ran = [entry["cell"] for entry in plain if entry["cell"] in measured]
    if ran:
        return (f"The plain single-device run (DDP on one rank, whose all-reduce over one rank moves nothing: the "
                f"loop the source articles compare N cards against) is among the measured 1-rank cells: "
                f"{', '.join(ran)}.")
    if not plain:
        return ("No plain single-device run (DDP on one rank) is in the matrix: the fastest 1-rank cell is the "
                "fastest of the engines measured.")
    why = "; ".join(f"{entry['cell']}: {entry['reason'] or 'no repeat measured it'}" for entry in plain)
    return (f"The plain single-device run (DDP on one rank) was not measured ({why}): the fastest 1-rank cell is the "
            "fastest of the other setups.")


def draw_plots(frames: ReportFrames, records: list[dict], evals: list[dict], plot_dir: Path) -> dict:
    """The report's PNGs under plot_dir, each as {name, rel (the Markdown link), data (base64, for the HTML)}."""
    plot_dir.mkdir(parents=True, exist_ok=True)
    summary = frames.main
    paths = {
        "throughput": plotting.throughput_plot(records, summary.warmup_timing_steps, summary.checkpoints,
                                               plot_dir / "throughput.png"),
        "loss": plotting.loss_plot(records, evals, plot_dir / "loss.png"),
    }
    if evals:
        paths["eval"] = plotting.eval_plot(evals, plot_dir / "eval.png")
    if not frames.scaling.empty:
        paths["scaling"] = plotting.scaling_plot(frames.scaling, plot_dir / "scaling.png")
    if not frames.memory.empty:
        paths["memory"] = plotting.memory_plot(frames.memory, frames.device, plot_dir / "memory.png")
    if not frames.communication.empty:
        paths["communication"] = plotting.communication_plot(frames.communication, plot_dir / "communication.png")
    loads = load_records(records) if is_moe(summary) else []
    if loads:
        first = summary.model["first_moe_layer"]
        paths["expert_load"] = plotting.expert_load_plot(loads, first, plot_dir / "expert_load.png")
        paths["balance"] = plotting.balance_plot(loads, first, plot_dir / "balance.png")
    return {key: {"name": p.name, "rel": f"plots/{p.name}", "data": base64.b64encode(p.read_bytes()).decode()}
            for key, p in paths.items()}


def build_report(summary_path: Path, metrics_path: Path, eval_paths: list[Path], out_md: Path, out_html: Path,
                 plot_dir: Path, *, target_corpus_tokens: float, matrix_path: Path | None = None,
                 bench_paths: list[Path] = (), lm_eval_paths: list[Path] = (), peak_path: Path | None = None,
                 gpu_hour_price: dict | None = None, configfiles: list[str] = ()) -> dict:
    """Render the report from the run's JSON files; configfiles: the --configfile arguments the run was made with
    (for the command the report gives to measure the benchmark again)."""
    summary = RunSummary.read(summary_path)
    records = read_jsonl(metrics_path)
    evals = [json.loads(Path(p).read_text()) for p in eval_paths]
    matrix = json.loads(Path(matrix_path).read_text()) if matrix_path else None
    runs_by_cell = load_bench(bench_paths)
    lm_evals = [json.loads(Path(p).read_text()) for p in lm_eval_paths]
    peak = json.loads(Path(peak_path).read_text()) if peak_path else None
    frames = report_frames(summary, evals, target_corpus_tokens, matrix, runs_by_cell, lm_evals, peak)
    tables = format_tables(frames, runs_by_cell, gpu_hour_price, configfiles)
    plots = draw_plots(frames, records, evals, Path(plot_dir))

    bench = frames.bench
    context = {
        "summary": summary, "tables": tables, "fmt": fmt, "plots": plots, "matrix": matrix,
        "peak": frames.peak, "claims_source": CLAIMS, "setup": SETUP, "GIB": GIB,
        "formulas": formula_texts(), "bench_count": len(bench), "cells_run": len(runs_by_cell),
        "bench_oversubscribed": sum(s.oversubscribed for s in bench),
        "comm_method": next((s.comm_method for s in bench if s.comm_fraction is not None), summary.comm_method),
        "peak_mem_kind": (bench[0] if bench else summary).peak_mem_kind,
        "weights_origin": weights_origin(summary), "eval_during": eval_during_training(summary),
        "flops_formula": (bench[0] if bench else summary).flops_formula,
        "main_engine": engine_label(vars(summary)),
        "plain_baseline": plain_baseline_text(matrix, set(runs_by_cell)), "labelled": labelled,
        "other_cpu_method": OTHER_CPU_METHOD, "other_cpu_limit": OTHER_CPU_LIMIT_PCT,
        "moe": moe_section(summary, records, t.records(frames.memory), runs_by_cell),
        "peak_origin": peak_origin(frames.peak, Path(peak_path) if peak_path else None) if frames.peak else None,
    }
    out_md, out_html = Path(out_md), Path(out_html)
    out_md.parent.mkdir(parents=True, exist_ok=True)
    # one template, two formats: captions and notes are written once (templates/report.j2)
    markdown = _template(html=False).render(**context, html=False)
    atomic_write_text(out_md, re.sub(r"\n{3,}", "\n\n", markdown).lstrip("\n"))  # blocks apart by one blank line
    atomic_write_text(out_html, _template(html=True).render(**context, html=True))
    return tables
