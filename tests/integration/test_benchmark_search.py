"""benchmark.search end to end: the setups the memory pre-flight finds feasible join the matrix, run through Snakemake,
and the report recommends the fastest measured cell; a later dry run names that recommendation.

It continues from a copy of the shared pipeline run (tests/conftest.py `pipeline`), whose main run, evaluations and
1-rank cells (DeepSpeed ZeRO-2 and DDP) are reused as they are: the search overlay keeps the benchmark's steps, so
those cells' plans do not change, and asks for one repeat of 1-rank cells only. What it adds are the searched cells:
DeepSpeed ZeRO 0-3, DDP and FSDP at the main run's micro-batch and at the largest power of two up to 4 × it.
"""
import json
import re
import shutil
import statistics
import time
from types import SimpleNamespace

import pytest

from support import PIPELINE_MICRO_BATCH as MAIN_MICRO_BATCH  # the shared run's train.micro_batch_size
from support import PIPELINE_NAME as NAME
from support import run_snakemake, write_yaml

pytestmark = pytest.mark.pipeline

SEARCH = {"benchmark": {"search": True, "repeats": 1,
                        "matrix": {"gpus": [1], "micro_batch_size": [MAIN_MICRO_BATCH], "comm_backend": ["gloo"]}}}


@pytest.fixture(scope="module")
def searched(pipeline, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("search") / "workflow"
    shutil.copytree(pipeline.workdir, workdir, symlinks=True)
    configfiles = (*pipeline.configfiles, write_yaml(workdir.parent / "search.yaml", SEARCH))
    results = workdir / "results" / NAME
    trained = (results / "train" / "summary.json").stat().st_mtime
    started = time.time()
    proc = run_snakemake(workdir, configfiles=configfiles)
    return SimpleNamespace(workdir=workdir, results=results, configfiles=configfiles, started=started,
                           trained=trained, log=proc.stdout + proc.stderr)


def summaries(results, cells):
    """{cell: [summary.json of each repeat, in repeat order]} for the cells named."""
    return {cell: [json.loads(path.read_text())
                   for path in sorted((results / "bench" / cell).glob("rep*/summary.json"))] for cell in cells}


def test_the_searched_cells_ran_and_nothing_else_did(searched):
    matrix = json.loads((searched.results / "bench" / "matrix.json").read_text())
    found = [e for e in matrix["cells"] if e["origin"] == "search"]
    declared = [e for e in matrix["cells"] if e["origin"] == "declared"]
    assert found and all(e["status"] == "run" and e["gpus"] == 1 for e in found)
    # every layout the search tries on CPU fits the tiny model, at the main run's micro-batch and at 4 × it
    layouts = {(e["engine"], e["zero_stage"]) for e in found + declared if e["status"] == "run"}
    assert layouts == {("deepspeed", 0), ("deepspeed", 1), ("deepspeed", 2), ("deepspeed", 3), ("ddp", 0),
                       ("fsdp", 3)}
    assert {e["micro_batch_size"] for e in found} == {MAIN_MICRO_BATCH, 4 * MAIN_MICRO_BATCH}
    for entry in found:
        (summary,) = summaries(searched.results, [entry["cell"]])[entry["cell"]]
        assert (summary["engine"], summary["zero_stage"], summary["world_size"]) == (
            entry["engine"], entry["zero_stage"], 1)
        assert summary["micro_batch_size"] == entry["micro_batch_size"] and summary["tokens_per_s"] > 0
        summary_path = searched.results / "bench" / entry["cell"] / "rep1" / "summary.json"
        assert summary_path.stat().st_mtime > searched.started, f"{entry['cell']} ran in this run"
    # the declared 1-rank cells and the main run were reused, not run again
    for entry in declared:
        if entry["status"] == "run":
            assert (searched.results / "bench" / entry["cell"] / "rep1" / "summary.json").stat().st_mtime \
                < searched.started
    assert (searched.results / "train" / "summary.json").stat().st_mtime == searched.trained
    assert "rule pretrain:" not in searched.log


def test_the_recommendation_equals_a_recomputation_from_the_cells_summaries(searched):
    from pretrain_bench.core.formats import fmt, fmt_spread

    matrix = json.loads((searched.results / "bench" / "matrix.json").read_text())
    runnable = [e["cell"] for e in matrix["cells"] if e["status"] == "run"]
    runs = summaries(searched.results, runnable)
    runs = {cell: reps[:1] for cell, reps in runs.items()}  # the report reads benchmark.repeats (1) of each cell
    medians = {cell: statistics.median(s["tokens_per_s"] for s in reps) for cell, reps in runs.items()}
    md = (searched.results / "report" / "report.md").read_text()
    section = md[md.index("What to run on this hardware"):md.index("### Cost")]
    # every measured cell ranked, fastest first, with the physical checks it failed ("—": none)
    rows = [[cell.strip(" `") for cell in line.strip("|").split(" | ")] for line in section.splitlines()
            if line.startswith("| ") and line.split(" | ")[0].strip("| `") in medians]
    assert [row[0] for row in rows] == sorted(medians, key=medians.get, reverse=True)
    clean = [row[0] for row in rows if row[-1] == "—"]
    main = json.loads((searched.results / "train" / "summary.json").read_text())
    if not clean:  # this machine was busy throughout: nothing is recommended, and the report says how to measure again
        assert "No trustworthy measurement exists" in section and "fastest setup" not in section
        assert "--forcerun bench_cell" in section
        return
    best = max(clean, key=medians.get)  # a flagged cell never heads the recommendation
    tokens = [s["tokens_per_s"] for s in runs[best]]
    memory = [max(s["peak_mem_bytes"]) / 1024**3 for s in runs[best]]
    assert re.search(rf"On this hardware the fastest setup that fits( \(of the {len(clean)} cell\(s\) whose "
                     rf"measurements passed every physical check\))? is {re.escape(best)} \(1 rank\(s\), ",
                     section), section[:2000]
    assert f": {fmt_spread(tokens, 0)} tokens/s, {fmt_spread(memory, 2)} GiB per rank, MFU " in section
    assert (f"{fmt(main['tokens_per_s'], 0)} tokens/s (the main run, measured), at "
            f"{fmt(main['tokens_per_s'] / medians[best] * 100, 0)} % of that.") in section
    # and each is priced, beside the main run and the source articles' claimed setups
    cost = md[md.index("### Cost"):md.index("## The benchmark matrix")]
    assert all(f"| {cell} | measured (benchmark median) |" in cost for cell in medians)
    assert "| the main run | measured |" in cost and cost.count("| claimed by the source articles") == 3


def test_a_later_dry_run_names_the_recommended_setup(searched):
    """Another run name on the same machine and model: `snakemake -n` prints the earlier benchmark's recommendation,
    the fastest median over every summary under results/ (this run's, and the pipeline's second repeats and 2-rank
    cells beside them)."""
    from pretrain_bench.report.recommendation import ranking
    from pretrain_bench.train.run_summary import RunSummary

    runs: dict[str, list[RunSummary]] = {}
    for path in sorted((searched.workdir / "results").glob("*/bench/*/rep*/summary.json")):
        runs.setdefault(f"{path.parents[3].name}/{path.parents[1].name}", []).append(RunSummary.read(path))
    # the fastest median among the cells that passed the physical checks (a flagged one never heads it)
    clean = {cell: statistics.median(s.tokens_per_s for s in runs[cell])
             for cell in ranking(runs).query("trusted")["cell"]}
    proc = run_snakemake(searched.workdir, "-n", "--config", "name=itest-later", configfiles=searched.configfiles)
    out = proc.stdout + proc.stderr
    line = next(line for line in out.splitlines() if "recommended from the earlier benchmark" in line)
    if not clean:
        assert f"({NAME} under results/): No trustworthy measurement exists" in line, line
        return
    best = max(clean, key=clean.get)
    assert re.search(rf"\({NAME} under results/\): On this hardware the fastest setup that fits( \(of the "
                     rf"{len(clean)} cell\(s\) whose measurements passed every physical check\))? is "
                     rf"{re.escape(best)} \(", line), line
