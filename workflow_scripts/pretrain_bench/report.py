"""The report: tables and plots computed only from a run's JSON files, rendered as Markdown and self-contained HTML.

`build_tables` is pure (JSON in, rows out) so a test can recompute every table from the same files and compare.
Figures that were not measured in this run are labelled *extrapolated* with their formula.
"""
from __future__ import annotations

import base64
import json
import os
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined

GIB = 1024**3


def fmt(value, digits: int = 1) -> str:
    """One number format for every table, so tests can reproduce the strings."""
    if value is None:
        return "n/a"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}"


def fmt_duration(seconds: float) -> str:
    if seconds < 3600:
        return f"{seconds / 60:,.1f} min"
    if seconds < 86400 * 2:
        return f"{seconds / 3600:,.1f} h"
    return f"{seconds / 86400:,.1f} days"


def build_tables(summary: dict, evals: list[dict], target_corpus_tokens: float) -> dict:
    """Rows for the report's tables, each value already formatted."""
    step = summary["step_time_s"]
    throughput = [{
        "ranks": str(summary["world_size"]),
        "device": summary["device"],
        "zero_stage": str(summary["zero_stage"]),
        "precision": summary["precision"],
        "comm_backend": summary["comm_backend"],
        "global_batch": fmt(summary["global_batch_size"]),
        "tokens_per_s": fmt(summary["tokens_per_s"]),
        "step_time": f"{fmt(step['median'], 3)} ({fmt(step['min'], 3)}–{fmt(step['max'], 3)})",
        "peak_mem_gib": " / ".join(fmt(b / GIB, 2) for b in summary["peak_mem_bytes"]),
        "mfu_pct": fmt(summary["mfu"] * 100 if summary["mfu"] is not None else None, 2),
        "comm_pct": fmt(summary["comm_fraction"] * 100 if summary["comm_fraction"] is not None else None, 1),
    }]
    epoch_s = target_corpus_tokens / summary["tokens_per_s"] if summary["tokens_per_s"] else None
    evaluation = [{
        "step": fmt(e["step"]),
        "train_tokens": fmt(e.get("train_tokens")),
        "loss": fmt(e["loss"], 4),
        "perplexity": fmt(e["perplexity"], 2),
        "bits_per_byte": fmt(e["bits_per_byte"], 4),
        "eval_tokens": fmt(e["tokens"]),
    } for e in sorted(evals, key=lambda e: e["step"])]
    return {
        "throughput": throughput,
        "evaluation": evaluation,
        "epoch": {
            "target_tokens": fmt(float(target_corpus_tokens), 0),
            "seconds": epoch_s,
            "text": fmt_duration(epoch_s) if epoch_s else "n/a",
        },
    }


def make_plots(records: list[dict], evals: list[dict], warmup_steps: int, plot_dir: Path) -> list[Path]:
    """Loss / perplexity and throughput-over-time plots as PNG files."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in records]
    paths = []

    fig, (ax_loss, ax_ppl) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(steps, [r["loss"] for r in records], label="train loss (mean over ranks)", lw=1)
    if evals:
        ev = sorted(evals, key=lambda e: e["step"])
        ax_loss.plot([e["step"] for e in ev], [e["loss"] for e in ev], "o-", label="held-out loss")
        ax_ppl.plot([e["step"] for e in ev], [e["perplexity"] for e in ev], "o-", color="C1", label="held-out")
    ax_ppl.plot(steps, [math.exp(min(r["loss"], 50)) for r in records], lw=1, color="C0", alpha=0.6,
                label="train")
    ax_loss.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="Loss")
    ax_ppl.set(xlabel="step", ylabel="perplexity", title="Perplexity", yscale="log")
    ax_loss.legend()
    ax_ppl.legend()
    fig.tight_layout()
    paths.append(plot_dir / "loss.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(11, 3.5))
    ax.plot(steps, [r["tokens_per_s"] for r in records], lw=1)
    ax.axvspan(0.5, warmup_steps + 0.5, color="grey", alpha=0.2, label="warm-up (excluded)")
    ax.set(xlabel="step", ylabel="tokens/s (global)", title="Throughput over time")
    ax.legend()
    fig.tight_layout()
    paths.append(plot_dir / "throughput.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def build_report(summary_path: Path, metrics_path: Path, eval_paths: list[Path], out_md: Path, out_html: Path,
                 plot_dir: Path, *, target_corpus_tokens: float) -> dict:
    summary = json.loads(Path(summary_path).read_text())
    records = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    evals = [json.loads(Path(p).read_text()) for p in eval_paths]
    tables = build_tables(summary, evals, target_corpus_tokens)
    plots = make_plots(records, evals, summary["warmup_timing_steps"], Path(plot_dir))
    env = Environment(loader=FileSystemLoader(Path(__file__).parent / "templates"), undefined=StrictUndefined,
                      autoescape=False, keep_trailing_newline=True)
    context = {"summary": summary, "tables": tables, "fmt": fmt,
               "plots": [{"name": p.name, "rel": f"plots/{p.name}",
                          "data": base64.b64encode(p.read_bytes()).decode()} for p in plots]}
    out_md, out_html = Path(out_md), Path(out_html)
    out_md.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(out_md, env.get_template("report.md.j2").render(**context))
    env.autoescape = True
    _atomic_write(out_html, env.get_template("report.html.j2").render(**context))
    return tables
