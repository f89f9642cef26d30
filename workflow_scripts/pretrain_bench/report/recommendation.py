"""What to run on this hardware: the fastest measured setup, beside the run as configured.

Built from measured benchmark cells only (each cell's repeats, summary.json): a cell that ran to its end fits, by
measurement. The fastest is the one with the highest median tokens/s among the cells that passed every physical
check (pretrain_bench.report.physical_checks); its spread over the repeats, its memory per rank and its MFU are
quoted. A flagged cell never heads it: when no cell passed, it says that no trustworthy measurement exists, why, and
the command that measures the benchmark again. The same function serves the report and the dry run
(`previous_recommendation`: an earlier benchmark of the same hardware and model under results/).
"""
from __future__ import annotations

import shlex
from pathlib import Path

import pandas as pd

from pretrain_bench.core.formats import fmt
from pretrain_bench.report.physical_checks import flagged, run_busy_flag
from pretrain_bench.report.tables import (
    GIB,
    NOISY_SPREAD,
    cell_table,
    engine_label,
    mfu_figure_text,
    mfu_flags,
    records,
    scaling_frame,
    spread,
)
from pretrain_bench.train.run_summary import RunSummary, SummaryError


def setup_text(run: RunSummary) -> str:
    """'3 ranks, DeepSpeed ZeRO-2, fp32, gloo, micro batch 8 × 1 accumulation (global batch 24)'."""
    return (f"{run.world_size} rank(s), {engine_label(vars(run))}, {run.precision}, {run.comm_backend}, micro batch "
            f"{run.micro_batch_size} × {run.grad_accum_steps} accumulation (global batch {run.global_batch_size})")


def scaling_entries(runs_by_cell: dict[str, list[RunSummary]]) -> dict:
    """A matrix holding what the scaling checks read of each cell (its ranks, engine and settings), from the cell's
    first summary: the same checks for the report and for the dry run, which has no matrix.json."""
    keys = ("engine", "zero_stage", "precision", "comm_backend", "micro_batch_size", "offload_optimizer",
            "expert_parallel")
    return {"cells": [{"cell": cell, "gpus": runs[0].world_size, **{key: getattr(runs[0], key) for key in keys}}
                      for cell, runs in runs_by_cell.items() if runs]}


def efficiency_flags(matrix: dict, cells: pd.DataFrame) -> dict[str, list[str]]:
    """{cell: flags} of the scaling checks (tables.scaling_frame's `efficiency_flags`): an efficiency above 100 %
    flags the N-rank cell and the 1-rank cell it divided by."""
    return {row["cell"]: row["efficiency_flags"] for row in records(scaling_frame(matrix, cells, 1.0))}


def ranking(runs_by_cell: dict[str, list[RunSummary]], peak: dict | None = None) -> pd.DataFrame:
    """Every measured cell, fastest first (median tokens/s over its repeats), with its spreads, the flags of its
    timings (other processes on its cores, repeats that disagree, a scaling efficiency above 100 % it took part in)
    and of its MFU (those, an MFU above 100 % and a peak measured while other processes used the cores), and whether
    it passed every check (`trusted`)."""
    matrix = scaling_entries(runs_by_cell)
    cells = cell_table(matrix, runs_by_cell)
    scaling = efficiency_flags(matrix, cells)
    rows = []
    for cell, row in cells.iterrows():
        if row["tokens_per_s"] != row["tokens_per_s"]:  # NaN: no repeat measured a throughput
            continue
        values = row["tokens_per_s_values"]
        noisy = (max(values) - min(values)) / row["tokens_per_s"] if len(values) > 1 else 0.0
        timing_flags = list(row["busy_flags"])
        if noisy > NOISY_SPREAD:
            timing_flags.append(f"repeats disagree by ±{fmt(noisy * 50, 0)}% of their median")
        timing_flags = list(dict.fromkeys(timing_flags + scaling.get(cell, [])))
        flags = list(dict.fromkeys(mfu_flags(row["peak_flops_source"], peak, timing_flags + row["over_peak_flags"])))
        first = runs_by_cell[cell][0]
        rows.append({"cell": cell, "setup": setup_text(first), "ranks": first.world_size, "device": first.device,
                     "tokens_per_s": row["tokens_per_s"], "tokens_per_s_values": values,
                     "mem_bytes_values": row["mem_bytes_values"], "mfu_values": row["mfu_values"],
                     "mfu_notes": row["mfu_notes"], "repeats": int(row["repeats"]), "timing_flags": timing_flags,
                     "flags": flags, "trusted": not flags})
    table = pd.DataFrame.from_records(rows, columns=["cell", "setup", "ranks", "device", "tokens_per_s",
                                                     "tokens_per_s_values", "mem_bytes_values", "mfu_values",
                                                     "mfu_notes", "repeats", "timing_flags", "flags", "trusted"])
    return table.sort_values("tokens_per_s", ascending=False, kind="stable").reset_index(drop=True)


def figures_text(row: dict) -> str:
    """'2,757 (2,600–2,900) tokens/s, 0.91 (0.90–0.93) GiB per rank, MFU 12.00 (11.50–12.30) %' (the MFU's reason
    instead where a repeat did not report it)."""
    unit = "" if row["mfu_notes"] else " %"
    return (f"{spread(row['tokens_per_s_values'], 0)} tokens/s, {spread(row['mem_bytes_values'], 2, 1 / GIB)} GiB "
            f"per rank, MFU {mfu_figure_text(row['mfu_values'], row['mfu_notes'])}{unit}")


def rerun_benchmark_command(name: str, gpus: int, configfiles: list[str] = ()) -> str:
    """The command that measures every benchmark cell of run `name` again and rebuilds its report, nothing else (rule
    bench_cell forced; training, evaluation and the data are kept as they are): `configfiles`, the --configfile
    arguments the run was made with; `gpus`, the most ranks a cell or the main run takes."""
    files = "".join(f" --configfile {shlex.quote(working_relative(path))}" for path in configfiles)
    return (f"snakemake --cores all --resources gpu={gpus}{files} --forcerun bench_cell -- "
            f"results/{name}/report/report.md")


def working_relative(path: str) -> str:
    """`path` relative to the working directory where it lies under it (Snakemake makes --configfile paths
    absolute), else as it is."""
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def reasons_text(flagged_rows: list[dict]) -> str:
    """Each flag of the untrusted cells once, with the cells that carry it: 'other processes used 30 % of the 2 cores
    (ranks1-…, ranks2-…); …'."""
    cells_by_flag: dict[str, list[str]] = {}
    for row in flagged_rows:
        for flag in row["flags"]:
            cells_by_flag.setdefault(flag, []).append(row["cell"])
    return "; ".join(f"{flag} ({', '.join(cells)})" for flag, cells in cells_by_flag.items())


def recommend(runs_by_cell: dict[str, list[RunSummary]], main: RunSummary | None = None,
              peak: dict | None = None, rerun: str | None = None) -> dict | None:
    """The fastest measured cell that passed every physical check and, given the main run, how the configured run
    compares; None when no cell measured a throughput. A flagged cell never heads it: when none passed, the sentence
    says that no trustworthy measurement exists and why. `rerun`: the command that measures the cells again
    (`rerun_benchmark_command`), kept as the result's `rerun` where a cell was passed over."""
    table = ranking(runs_by_cell, peak)
    if table.empty:
        return None
    rows = records(table)
    trusted = [row for row in rows if row["trusted"]]
    passed_over = [row for row in rows if not row["trusted"]]
    result = {"ranking": table, "trusted": bool(trusted), "rerun": rerun if passed_over else None,
              "main_pct": None, "main": None}
    if not trusted:
        result.update(cell=None, setup=None, tokens_per_s=None, sentence=(
            f"No trustworthy measurement exists: every one of the {len(rows)} measured benchmark cell(s) failed a "
            f"physical check, so none is recommended. Why: {reasons_text(passed_over)}."))
    else:
        best = trusted[0]
        among = (f" (of the {len(trusted)} cell(s) whose measurements passed every physical check)"
                 if passed_over else "")
        sentence = (f"On this hardware the fastest setup that fits{among} is {best['cell']} ({best['setup']}): "
                    f"{figures_text(best)}, median (min–max) over {best['repeats']} repeat(s).")
        if passed_over:
            sentence += (f" Passed over, as not trustworthy: {', '.join(row['cell'] for row in passed_over)} "
                         "(their flags are in the physical checks column).")
        result.update(cell=best["cell"], setup=best["setup"], tokens_per_s=best["tokens_per_s"], sentence=sentence)
    if main is not None and main.tokens_per_s:
        measured = (f"Your configured run uses {setup_text(main)}: {fmt(main.tokens_per_s, 0)} tokens/s (the main "
                    "run, measured)")
        if trusted:
            pct = main.tokens_per_s / trusted[0]["tokens_per_s"] * 100
            result.update(main_pct=pct, main=flagged(f"{measured}, at {fmt(pct, 0)} % of that.",
                                                     [run_busy_flag(main.provenance)]))
        else:
            result["main"] = flagged(f"{measured}.", [run_busy_flag(main.provenance)])
    return result


# ---- before a run: an earlier benchmark of the same hardware and model --------------------------------------------

def same_hardware(hardware: dict, here: dict) -> bool:
    """Whether a run's hardware provenance describes this machine (device, architecture, CPU model and count, GPU)."""
    return all(hardware.get(key) == here.get(key) for key in ("device", "machine", "processor", "cpu_count",
                                                               "gpu_name"))


def previous_recommendation(results: Path, here: dict, model: dict, seq_len: int) -> tuple[dict, list[str]] | None:
    """The recommendation from earlier benchmark runs under `results`/<name>/bench/ on this hardware (`here`, as
    devices.hardware_description would describe it) for this model (`model`: the summary's model keys to match) at
    this sequence length, and the run names it came from; None when there is none. Unreadable summaries are passed
    over."""
    runs_by_cell: dict[str, list[RunSummary]] = {}
    names = set()
    for path in sorted(results.glob("*/bench/*/rep*/summary.json")):
        try:
            run = RunSummary.read(path)
        except (SummaryError, ValueError, OSError):
            continue  # another version of the file: the dry run names only what it can read
        if (not same_hardware(run.provenance["hardware"], here) or run.seq_len != seq_len
                or any(run.model.get(key) != value for key, value in model.items())):
            continue
        name = path.parents[3].name
        names.add(name)
        runs_by_cell.setdefault(f"{name}/{path.parents[1].name}", []).append(run)
    found = recommend(runs_by_cell)
    return (found, sorted(names)) if found else None


def this_machine(device: str) -> dict:
    """This machine as a run's hardware provenance describes it (devices.hardware_description), without importing
    torch: the GPU's name from nvidia-smi."""
    from pretrain_bench.core.devices import gpu_names, hardware_description

    here = {**hardware_description("cpu"), "device": device}
    if device == "cuda":
        names = gpu_names()
        here["gpu_name"] = names[0] if names else None
    return here


def model_identity(model, vocab_size: int) -> dict:
    """The summary.json model keys that make two runs' models the same: preset, parameters, vocabulary, layers and
    width (`model`: ModelSettings)."""
    from pretrain_bench.train.models.registry import model_family, model_shape

    shape = model_shape(model, vocab_size)
    family = model_family(shape)
    described = family.describe(shape)
    return {"preset": model.preset, "parameters": family.count_parameters(shape)["total"], "vocab_size": vocab_size,
            "layers": described["layers"], "hidden_size": described["hidden_size"]}


def previous_recommendation_text(results: Path, device: str, model, vocab_size: int) -> str | None:
    """What the dry run prints when an earlier benchmark of this hardware and model (`model`: ModelSettings) exists:
    the recommendation and the runs it came from; None when there is none."""
    found = previous_recommendation(results, this_machine(device), model_identity(model, vocab_size), model.seq_len)
    if found is None:
        return None
    recommendation, names = found
    return (f"recommended from the earlier benchmark of this hardware and model ({', '.join(names)} under "
            f"{results}/): {recommendation['sentence']}")
