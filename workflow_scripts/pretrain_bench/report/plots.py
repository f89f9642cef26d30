"""The report's plots (PNG, matplotlib Agg), drawn from the numbers the tables print: the report's frames and the
run's records."""
from __future__ import annotations

import math
import statistics
from pathlib import Path

import pandas as pd

from pretrain_bench.report.experts import coefficient_of_variation
from pretrain_bench.report.tables import GIB, records

DPI = 110


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    _pyplot().close(fig)
    return path


def loss_plot(records: list[dict], evals: list[dict], path: Path) -> Path:
    """Main run: train loss per step with the held-out loss measured while training (train.eval_every) and at
    checkpoints; perplexity on a log axis."""
    plt = _pyplot()
    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_ppl) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(steps, [r["loss"] for r in records], label="train loss (mean over ranks)", lw=1)
    during = [r for r in records if "val_loss" in r]
    if during:
        ax_loss.plot([r["step"] for r in during], [r["val_loss"] for r in during], "s--", color="C2", ms=4,
                     label="validation loss while training")
        ax_ppl.plot([r["step"] for r in during], [r["val_perplexity"] for r in during], "s--", color="C2", ms=4,
                    label="validation while training")
    ev = sorted(evals, key=lambda e: e["step"])
    if ev:
        ax_loss.plot([e["step"] for e in ev], [e["loss"] for e in ev], "o-", label="held-out loss")
        ax_ppl.plot([e["step"] for e in ev], [e["perplexity"] for e in ev], "o-", color="C1", label="held-out")
    ax_ppl.plot(steps, [math.exp(min(r["loss"], 50)) for r in records], lw=1, color="C0", alpha=0.6, label="train")
    ax_loss.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="Loss")
    ax_ppl.set(xlabel="step", ylabel="perplexity", title="Perplexity", yscale="log")
    ax_loss.legend()
    ax_ppl.legend()
    return _save(fig, path)


def throughput_plot(records: list[dict], warmup_steps: int, checkpoints: list[int], path: Path) -> Path:
    """Main run: tokens/s per step, warm-up shaded, checkpoint steps marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 3.5))
    steps = [r["step"] for r in records]
    ax.plot(steps, [r["tokens_per_s"] for r in records], lw=1, label="tokens/s (global)")
    ax.axvspan(0.5, warmup_steps + 0.5, color="grey", alpha=0.2, label="warm-up (excluded)")
    resumed = [r["step"] for r in records if r.get("after_resume")]
    for number, step in enumerate(checkpoints):
        ax.axvline(step, color="C2", ls="--", lw=0.8, label="checkpoint saved after this step" if number == 0 else None)
    for number, step in enumerate(resumed):
        ax.axvline(step, color="C3", ls=":", lw=1, label="first step after a resume" if number == 0 else None)
    ax.set(xlabel="step", ylabel="tokens/s (global)", title="Throughput over time (main run)", ylim=(0, None))
    ax.legend(loc="lower right", fontsize=8)
    return _save(fig, path)


def eval_plot(evals: list[dict], path: Path) -> Path:
    """Held-out loss, perplexity and bits per byte against steps (top) and training tokens (bottom)."""
    plt = _pyplot()
    from matplotlib.ticker import EngFormatter, MaxNLocator

    ev = sorted(evals, key=lambda e: e["step"])
    fig, axes = plt.subplots(2, 3, figsize=(11, 6))
    metrics = [("loss", "loss (nats/token)"), ("perplexity", "perplexity"), ("bits_per_byte", "bits per byte")]
    for column, (key, label) in enumerate(metrics):
        for row, (x_key, x_label) in enumerate((("step", "step"), ("train_tokens", "training tokens"))):
            ax = axes[row][column]
            ax.plot([e.get(x_key) or 0 for e in ev], [e[key] for e in ev], "o-", color=f"C{column}")
            ax.set(xlabel=x_label, ylabel=label)
            ax.xaxis.set_major_formatter(EngFormatter(sep=""))
            ax.xaxis.set_major_locator(MaxNLocator(5, integer=True))
            if key == "perplexity":
                ax.set_yscale("log")
    fig.suptitle("Held-out evaluation of each kept checkpoint")
    return _save(fig, path)


def scaling_plot(scaling: pd.DataFrame, path: Path) -> Path:
    """tokens/s (median, min–max bars) and scaling efficiency against ranks, per series; ideal lines dashed."""
    plt = _pyplot()
    rows = records(scaling)
    fig, (ax_tps, ax_eff) = plt.subplots(1, 2, figsize=(11, 4))
    series = {}
    for row in rows:
        series.setdefault(row["series"], []).append(row)
    for number, (label, points) in enumerate(series.items()):
        color = f"C{number % 10}"
        ranks = [p["ranks"] for p in points]
        values = [p["tokens_per_s_values"] for p in points]
        med = [statistics.median(v) for v in values]
        low = [m - min(v) for m, v in zip(med, values)]
        high = [max(v) - m for m, v in zip(med, values)]
        ax_tps.errorbar(ranks, med, yerr=[low, high], fmt="o-", color=color, capsize=3, label=label)
        base = next((m for r, m in zip(ranks, med) if r == 1), None)
        if base:
            top = max(ranks)
            ax_tps.plot([1, top], [base, base * top], ls="--", color=color, alpha=0.5,
                        label="ideal with one device per rank (1-rank × ranks)" if number == 0 else None)
            eff = [(p["speedup"] or 0) / p["ranks"] * 100 for p in points]
            ax_eff.plot(ranks, eff, "o-", color=color, label=label)
    ax_eff.axhline(100, ls="--", color="grey", label="ideal")
    ax_tps.set(xlabel="ranks", ylabel="tokens/s (global, steady state)", title="Throughput vs ranks",
               ylim=(0, None))
    ax_eff.set(xlabel="ranks", ylabel="scaling efficiency %", title="Efficiency = speedup ÷ ranks",
               ylim=(0, max(110, ax_eff.get_ylim()[1])))
    for ax in (ax_tps, ax_eff):
        all_ranks = sorted({r["ranks"] for r in rows})
        ax.set_xticks(all_ranks or [1])
        ax.legend(fontsize=8)
    return _save(fig, path)


def memory_plot(memory: pd.DataFrame, device: str, path: Path) -> Path:
    """Measured peak per rank against the memory model's prediction, by cell (ZeRO stage and ranks)."""
    plt = _pyplot()
    rows = records(memory)
    fig, ax = plt.subplots(figsize=(11, 4))
    x = list(range(len(rows)))
    states = [r["states_bytes"] / GIB for r in rows]
    activations = [r["activations_bytes"] / GIB for r in rows]
    other = [r["other_bytes"] / GIB for r in rows]
    ax.bar([i - 0.2 for i in x], [r["measured_bytes"] / GIB for r in rows], width=0.4, color="C0",
           label="measured (worst rank, median)")
    right = [i + 0.2 for i in x]
    ax.bar(right, states, width=0.4, color="C1", hatch="//", edgecolor="white", label="predicted: model states")
    ax.bar(right, activations, width=0.4, bottom=states, color="C2", label="predicted: activations")
    ax.bar(right, other, width=0.4, bottom=[a + b for a, b in zip(states, activations)], color="C7",
           label="predicted: buffers + runtime")
    top = max([r["measured_bytes"] for r in rows] + [r["predicted_bytes"] for r in rows]) / GIB
    ax.set_ylim(0, top * 1.35)
    ax.set_xticks(x)
    labels = [r["engine"].replace("DeepSpeed ", "").replace(" + optimizer offload", " + offload") for r in rows]
    ax.set_xticklabels([f"{label}\n{r['ranks']} rank(s)\n{r['precision']}" for label, r in zip(labels, rows)],
                       fontsize=8)
    kind = "allocator peak" if device == "cuda" else "peak RSS"
    ax.set(ylabel=f"GiB per rank ({kind})", title="Memory per rank by engine and ZeRO stage: measured vs predicted")
    ax.legend(fontsize=8, ncol=4, loc="upper center")
    return _save(fig, path)


def communication_plot(communication: pd.DataFrame, path: Path) -> Path:
    plt = _pyplot()
    rows = records(communication)
    fig, ax = plt.subplots(figsize=(11, 3))
    values = [(r["comm_fraction"] or 0) * 100 for r in rows]
    ax.bar(range(len(rows)), values, color="C4")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["cell"] for r in rows], fontsize=7, rotation=20, ha="right")
    ax.set(ylabel="% of step time", title="Time in collectives (median over repeats)")
    return _save(fig, path)


MAX_LOAD_PANELS = 6  # MoE layers drawn in the expert-load heatmap: all up to this many, else evenly spaced ones


def expert_load_plot(loads: list[dict], first_moe_layer: int, path: Path) -> Path:
    """Per MoE layer, a heatmap of each expert's share of the layer's routed tokens per step, as a multiple of the
    balanced share (1 = every expert gets 1/E): rows experts, columns steps (`loads`: the records with an
    expert load, experts.load_records)."""
    plt = _pyplot()
    import numpy as np

    layers = len(loads[0]["expert_load"])
    shown = (list(range(layers)) if layers <= MAX_LOAD_PANELS
             else sorted({round(i * (layers - 1) / (MAX_LOAD_PANELS - 1)) for i in range(MAX_LOAD_PANELS)}))
    columns = min(3, len(shown))
    rows = math.ceil(len(shown) / columns)
    # constrained layout: room for the shared colour bar and the title (tight_layout leaves them overlapping)
    fig, axes = plt.subplots(rows, columns, figsize=(11, 3.2 * rows + 0.6), squeeze=False, layout="constrained")
    steps = [r["step"] for r in loads]
    for ax in axes.flat[len(shown):]:
        ax.set_visible(False)
    image = None
    for ax, layer in zip(axes.flat, shown):
        load = np.array([r["expert_load"][layer] for r in loads], dtype=float).T  # (E, steps)
        share = load / np.maximum(load.mean(axis=0, keepdims=True), 1e-12)
        image = ax.imshow(share, aspect="auto", cmap="coolwarm", vmin=0, vmax=2, interpolation="nearest",
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, load.shape[0] - 0.5, -0.5))
        ax.set(title=f"layer {first_moe_layer + layer}", xlabel="step", ylabel="expert")
    fig.colorbar(image, ax=axes, shrink=0.8, label="tokens ÷ balanced share (1 = balanced)")
    fig.suptitle("Expert load per MoE layer" + ("" if len(shown) == layers else f" ({len(shown)} of {layers})"))
    fig.savefig(path, dpi=DPI)
    _pyplot().close(fig)
    return path


def balance_plot(loads: list[dict], first_moe_layer: int, path: Path) -> Path:
    """MaxVio and the coefficient of variation of the expert load per MoE layer over the steps; the balance loss (as
    trained on, α included) and each layer's router-bias norm where the run had them (`loads`: the records with an
    expert load, experts.load_records)."""
    plt = _pyplot()
    steps = [r["step"] for r in loads]
    layers = len(loads[0]["expert_load"])
    fig, axes = plt.subplots(2, 2, figsize=(11, 6.5))
    (ax_vio, ax_cv), (ax_aux, ax_bias) = axes

    for layer in range(layers):
        label = f"layer {first_moe_layer + layer}"
        ax_vio.plot(steps, [r["max_violation"][layer] for r in loads], lw=1, label=label)
        ax_cv.plot(steps, [coefficient_of_variation(r["expert_load"][layer]) for r in loads], lw=1, label=label)
    ax_vio.set(xlabel="step", ylabel="MaxVio = (max − mean) ÷ mean", title="Largest expert overload", ylim=(0, None))
    ax_cv.set(xlabel="step", ylabel="std ÷ mean of tokens per expert", title="Coefficient of variation",
              ylim=(0, None))
    aux = [(r["step"], r["aux_loss"]) for r in loads if "aux_loss" in r]
    if aux:
        ax_aux.plot(*zip(*aux), lw=1, color="C3")
        ax_aux.set(xlabel="step", ylabel="α × sequence-wise balance loss", title="Balance loss (trained on)")
    else:
        ax_aux.text(0.5, 0.5, "balance loss off (aux_loss_alpha 0)", ha="center", va="center",
                    transform=ax_aux.transAxes)
        ax_aux.set_axis_off()
    biased = [r for r in loads if r.get("router_bias_norm")]
    if biased:
        for layer in range(layers):
            ax_bias.plot([r["step"] for r in biased], [r["router_bias_norm"][layer] for r in biased], lw=1,
                         label=f"layer {first_moe_layer + layer}")
        ax_bias.set(xlabel="step", ylabel="‖b‖₂", title="Router bias norm (auxiliary-loss-free balancing)")
    else:
        ax_bias.text(0.5, 0.5, "no router bias (softmax router)", ha="center", va="center",
                     transform=ax_bias.transAxes)
        ax_bias.set_axis_off()
    if layers <= 8:
        ax_vio.legend(fontsize=7)
    return _save(fig, path)
