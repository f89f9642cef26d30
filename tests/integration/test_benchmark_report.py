"""The tiny benchmark matrix end to end through Snakemake, and the report built from it.

The shared pipeline run (tests/conftest.py `pipeline`; its matrix: support.PIPELINE_OVERLAY, 1 and 2 gloo ranks ×
DeepSpeed ZeRO-2 and DDP, 2 repeats each); nccl cells and cells with a micro batch of 100,000 are declared too, and
must be reported, not run. The report's tables are recomputed here from the summaries, every PNG is opened, the HTML
is rendered by headless Chromium.
"""
import json
import os
import re
import shutil
import statistics
import subprocess
import zipfile
from pathlib import Path

import pytest
import yaml

from support import PIPELINE_BENCH_STEPS, PIPELINE_MICRO_BATCH, PIPELINE_OVERLAY, ROOT, TINY_CONFIG, run_snakemake
from support import PIPELINE_NAME as NAME

pytestmark = pytest.mark.pipeline
RANKS = tuple(PIPELINE_OVERLAY["benchmark"]["matrix"]["gpus"])  # (1, 2)
ZEROS = tuple(PIPELINE_OVERLAY["benchmark"]["matrix"]["zero_stage"])  # DeepSpeed's stages; DDP is one more series
SERIES = len(ZEROS) + 1
WARMUP_STEPS = yaml.safe_load((ROOT / TINY_CONFIG).read_text())["benchmark"]["warmup_steps"]  # untimed, per launch
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--enable-logging=stderr", "--v=0", "--window-size=1280,2400"]


@pytest.fixture(scope="module")
def run(pipeline):
    return pipeline.results


def matrix_of(run):
    return json.loads((run / "bench" / "matrix.json").read_text())


def runs_of(run):
    from pretrain_bench.report.render import load_bench

    summaries = load_bench(sorted((run / "bench").glob("*/rep*/summary.json")))  # RunSummary: the files validated
    return {cell: [s.to_dict() for s in reps] for cell, reps in summaries.items()}


def test_runnable_cells_ran_twice_and_the_others_were_reported_not_run(run, pipeline):
    matrix = matrix_of(run)
    by_status = {}
    for entry in matrix["cells"]:
        by_status.setdefault(entry["status"], []).append(entry)
    # DeepSpeed: ranks × ZeRO × backend × micro batch; DDP: ranks × backend × micro batch
    assert len(matrix["cells"]) == len(RANKS) * len(ZEROS) * 2 * 2 + len(RANKS) * 2 * 2
    assert sorted(e["cell"] for e in by_status["run"]) == sorted(
        [f"ranks{g}-zero{z}-fp32-gloo" for g in RANKS for z in ZEROS] + [f"ddp-ranks{g}-fp32-gloo" for g in RANKS])
    assert all(e["zero_stage"] == 0 for e in matrix["cells"] if e["engine"] == "ddp")
    assert len(by_status["unsupported"]) == len(RANKS) * SERIES * 2 and all("nccl needs CUDA" in e["reason"]
                                                                   for e in by_status["unsupported"])
    assert len(by_status["predicted_oom"]) == len(RANKS) * SERIES
    for entry in by_status["predicted_oom"] + by_status["unsupported"]:
        assert not (run / "bench" / entry["cell"]).exists(), "a left-out cell must not run"
        assert not (pipeline.workdir / "logs" / NAME / "bench" / entry["cell"]).exists()
    runs = runs_of(run)
    assert set(runs) == {e["cell"] for e in by_status["run"]}
    for entry in by_status["run"]:
        reps = runs[entry["cell"]]
        assert len(reps) == 2
        for summary in reps:
            assert summary["role"] == "bench" and summary["world_size"] == entry["gpus"]
            assert summary["zero_stage"] == entry["zero_stage"] and summary["steps"] == PIPELINE_BENCH_STEPS
            assert summary["engine"] == entry["engine"]
            assert summary["warmup_timing_steps"] == WARMUP_STEPS
            assert summary["steady_steps"] == PIPELINE_BENCH_STEPS - WARMUP_STEPS > 0
            assert summary["global_batch_size"] == PIPELINE_MICRO_BATCH * entry["gpus"] and summary["checkpoints"] == []
            assert summary["tokens_per_s"] > 0 and len(summary["peak_mem_bytes"]) == entry["gpus"]
    assert not list((run / "bench-state").rglob("COMMITTED.json")), "bench cells keep no checkpoints"


def test_timed_cells_never_overlapped(run, pipeline):
    """Each cell took every core: their [start, end] intervals (end = summary mtime, start = end - runtime)."""
    intervals = []
    for tsv in (pipeline.workdir / "benchmarks" / NAME / "bench").rglob("rep*.tsv"):
        seconds = float(tsv.read_text().splitlines()[1].split("\t")[0])
        cell, rep = tsv.parent.name, tsv.stem
        end = (run / "bench" / cell / rep / "summary.json").stat().st_mtime
        intervals.append((end - seconds, end, f"{cell}/{rep}"))
    assert len(intervals) == len(RANKS) * SERIES * 2
    intervals.sort()
    for (_, end_a, a), (start_b, _, b) in zip(intervals, intervals[1:]):
        assert start_b >= end_a - 1.0, f"{a} and {b} ran at the same time"


def test_repeats_of_different_cells_interleave(run):
    """Repeat 1 of every cell ended before repeat 2 of any cell was written (rule bench_cell's previous_round)."""
    ends = {rep: [(run / "bench" / cell / f"rep{rep}" / "summary.json").stat().st_mtime for cell in runs_of(run)]
            for rep in (1, 2)}
    assert max(ends[1]) < min(ends[2])


def _md_table(md: str, heading: str) -> list[list[str]]:
    """Rows (without header) of the first Markdown table after a heading."""
    lines = md.split(heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[start + 2:end]]


def test_report_tables_equal_a_recomputation_from_the_summaries(run):
    from pretrain_bench.core.formats import fmt_spread
    from pretrain_bench.report.physical_checks import run_contention_text
    from pretrain_bench.report.render import GIB, fmt
    from pretrain_bench.report.tables import fmt_duration

    md = (run / "report" / "report.md").read_text()
    html = (run / "report" / "report.html").read_text()
    runs = runs_of(run)
    target = yaml.safe_load((ROOT / TINY_CONFIG).read_text())["report"]["target_corpus_tokens"]

    def span(values, digits):  # median (min–max), at most 4 significant digits
        return fmt_spread(values, digits)

    one_rank = {cell: statistics.median(s["tokens_per_s"] for s in reps) for cell, reps in runs.items()
                if reps[0]["world_size"] == 1}
    fastest_one = max(one_rank, key=one_rank.get)

    seeds = _md_table(md, "## 1. The source articles' table")
    assert len(seeds) == len(RANKS) * SERIES
    for (series, ranks, batch, repeats, tps, speedup, efficiency, speedup_best, efficiency_best, mem, epoch, load,
         oversubscribed, _flags) in seeds:
        if series.startswith("DDP"):
            reps, base_cell = runs[f"ddp-ranks{ranks}-fp32-gloo"], "ddp-ranks1-fp32-gloo"
        else:
            zero = re.match(r"ZeRO-(\d)", series).group(1)
            reps, base_cell = runs[f"ranks{ranks}-zero{zero}-fp32-gloo"], f"ranks1-zero{zero}-fp32-gloo"
        base = statistics.median(s["tokens_per_s"] for s in runs[base_cell])
        values = [s["tokens_per_s"] for s in reps]
        med = statistics.median(values)
        assert tps == span(values, 0)
        assert speedup == f"{fmt(med / base, 2)}×"
        assert efficiency == fmt(med / base / int(ranks) * 100, 0)
        assert speedup_best == f"{fmt(med / one_rank[fastest_one], 2)}×"  # over the fastest 1-rank cell
        assert efficiency_best == fmt(med / one_rank[fastest_one] / int(ranks) * 100, 0)
        assert load == "; ".join(run_contention_text(s["provenance"]) for s in reps)
        assert all(s["provenance"]["other_cpu"]["share_pct"] is not None for s in reps)
        assert mem == span([max(s["peak_mem_bytes"]) / GIB for s in reps], 2)
        assert epoch == fmt_duration(target / med)
        assert batch == fmt(PIPELINE_MICRO_BATCH * int(ranks)) and repeats == "2"
        assert oversubscribed == ("yes" if any(s["oversubscribed"] for s in reps) else "no")
        assert (f"<td>{tps}</td><td>{speedup}</td><td>{efficiency}</td><td>{speedup_best}</td>"
                f"<td>{efficiency_best}</td><td>{mem}</td>") in html

    mfu = _md_table(md, "## 5. MFU per cell")
    assert len(mfu) == len(RANKS) * SERIES
    for cell, _ranks, mfu_pct, peak, source, flops, _flags in mfu:
        reps = runs[cell]
        # a repeat that beat the peak it was given (a peak measured on a busy machine) reports no MFU, and says why
        notes = [s["mfu_note"] for s in reps if s["mfu_note"]]
        if notes:
            assert mfu_pct == "not reported: " + notes[0] and all(s["mfu"] is None for s in reps if s["mfu_note"])
        else:
            assert mfu_pct == span([s["mfu"] * 100 for s in reps], 2)
        assert peak == span([s["peak_flops_per_rank"] / 1e12 for s in reps], 3)
        assert source == reps[0]["peak_flops_source"] and flops == fmt(reps[0]["flops_per_token"], 0)

    comm = _md_table(md, "## 4. Communication")
    assert len(comm) == (len(RANKS) - 1) * SERIES  # the multi-rank cells, DDP's timed by its communication hook
    for cell, _ranks, _backend, share in comm:
        assert share == span([s["comm_fraction"] * 100 for s in runs[cell]], 1)
    assert "DDP communication hook" in md and "DeepSpeed comms_logger" in md

    # engines side by side: at each rank count DDP and the ZeRO stages, with the same global batch
    engines = _md_table(md, "## 4b. Engines side by side")
    assert len(engines) == len(RANKS) * SERIES
    for ranks in map(str, RANKS):
        group = [row for row in engines if row[0] == ranks]
        assert sorted(row[3] for row in group) == ["DDP", *(f"DeepSpeed ZeRO-{z}" for z in ZEROS)]
        fastest = max(statistics.median(s["tokens_per_s"] for s in runs[row[4]]) for row in group)
        for row in group:
            med = statistics.median(s["tokens_per_s"] for s in runs[row[4]])
            assert row[5] == span([s["tokens_per_s"] for s in runs[row[4]]], 0)
            assert row[6] == f"{fmt(med / fastest, 2)}×"
        assert group[0][6] == "1.00×", "fastest first"
    ddp_row = next(row for row in engines if row[4] == f"ddp-ranks{RANKS[-1]}-fp32-gloo")
    assert ddp_row[12].startswith("16Ψ (4Ψ fp32 params")

    memory = {row[0]: row for row in _md_table(md, "## 3. Memory by engine and ZeRO stage")}
    matrix = {e["cell"]: e for e in matrix_of(run)["cells"]}
    for cell, row in memory.items():
        est = matrix[cell]["estimate"]
        assert row[4] == span([max(s["peak_mem_bytes"]) / GIB for s in runs[cell]], 3)
        assert row[5] == fmt((est["per_rank"] + est["host_states"]) / GIB, 3)  # CPU: RSS holds everything

    # the main run's table still equals its summary
    summary = json.loads((run / "train" / "summary.json").read_text())
    assert fmt(summary["tokens_per_s"]) in md and fmt(summary["mfu"] * 100, 2) in md


def test_left_out_cells_are_in_the_report_with_their_reason(run):
    md = (run / "report" / "report.md").read_text()
    html = (run / "report" / "report.html").read_text()
    for entry in matrix_of(run)["cells"]:
        if entry["status"] != "run":
            row = next(line for line in md.splitlines() if line.startswith(f"| {entry['cell']} |"))
            label = "predicted OOM" if entry["status"] == "predicted_oom" else "not supported here"
            assert label in row and entry["reason"] in row
            assert entry["reason"] in html
    assert re.search(r"predicted OOM: needs [\d,.]+ GiB \(\d ranks? × [\d,.]+ GiB\), has [\d,.]+ GiB host RAM", md)
    assert "NCCL vs Gloo: not measured" in md
    assert "Claims checked" in md and "impossible as described" in md
    # the matrix declares DDP on one rank: the plain single-device run is among the 1-rank baselines, and no
    # baseline of its own was added
    assert "is among the measured 1-rank cells: ddp-ranks1-fp32-gloo." in md
    assert all(entry["origin"] == "declared" for entry in matrix_of(run)["cells"])


def test_every_plot_is_a_valid_png(run):
    from PIL import Image

    plots = sorted((run / "report" / "plots").glob("*.png"))
    assert {p.stem for p in plots} == {"throughput", "loss", "eval", "scaling", "memory", "communication"}
    for path in plots:
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size[0] > 500 and image.size[1] > 200
    html = (run / "report" / "report.html").read_text()
    assert html.count("data:image/png;base64,") == len(plots)


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    if os.environ.get("PRETRAIN_BENCH_REQUIRE_CHROMIUM"):
        pytest.fail("headless Chromium is required (apt-get install chromium) but not installed")
    pytest.skip("chromium is not installed (CI installs it: .ci/run)")


def _render(chromium: str, page: Path, screenshot: Path, profile: Path) -> list[str]:
    """Console messages of a page rendered headless (Chromium logs each as INFO:CONSOLE on stderr)."""
    proc = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={screenshot}",
                           page.resolve().as_uri()], capture_output=True, text=True, timeout=120)
    assert screenshot.is_file() and screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", proc.stderr[-2000:]
    return [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]


def test_html_renders_in_headless_chromium_without_console_errors(run, tmp_path):
    chromium = _chromium()
    control = tmp_path / "control.html"
    control.write_text('<!DOCTYPE html><html><head><link rel="icon" href="data:,"></head><body>'
                       '<img src="missing.png"><script>console.error("control-error")</script></body></html>')
    caught = _render(chromium, control, tmp_path / "control.png", tmp_path / "profile-control")
    assert any("control-error" in line for line in caught), "the console check must see a known error"
    shot = run / "report" / "screenshot.png"
    messages = _render(chromium, run / "report" / "report.html", shot, tmp_path / "profile")
    assert messages == [], messages
    from PIL import Image

    with Image.open(shot) as image:
        colours = image.convert("L").getextrema()
    assert colours[0] < 100 < colours[1], "the screenshot shows text, not a blank page"


def test_snakemake_report_archive(run, pipeline, tmp_path):
    archive = tmp_path / "report.zip"
    run_snakemake(pipeline.workdir, "--report", str(archive), configfiles=pipeline.configfiles)
    with zipfile.ZipFile(archive) as zipped:
        names = zipped.namelist()
    assert any(n.endswith("report/report.html") for n in names)
    assert any("scaling.png" in n for n in names) and any("matrix.json" in n for n in names)
    assert sum("summary.json" in n for n in names) >= len(RANKS) * SERIES * 2
