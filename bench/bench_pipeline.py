"""The tiny pipeline end to end against its own `pretrain` job (the speed goal: at most 2.5x).

    python bench/bench_pipeline.py [out.json]        (default bench-results/pipeline.json)

Runs what `make demo` runs (`snakemake --cores 2 --resources gpu=3 --configfile config/tiny-cpu.yaml`) from scratch
in a temporary working directory (`--directory`), so nothing of the checkout's own results/ is read or touched and
nothing is left behind. Figures:
- wall_s: the whole snakemake process; pretrain_s: the `pretrain` job's wall time from its benchmark file; the ratio.
- jobs: every job's wall time from Snakemake's benchmark files, summed by rule (bench cells, evaluations, ...).
- startup: what starting a process costs on this machine, measured here (median of 3 fresh interpreters): torch
  alone (a torchrun agent), and torch + deepspeed + transformers' LLaMA (a training rank; an evaluation or export
  imports all but deepspeed). `startup.processes` counts those processes in this run and `startup.cpu_s` multiplies
  out: CPU seconds of imports alone, before any work, which the machine's cores share with everything else.
- process_startup: every process of the run, from its launch (the kernel's creation time) to its first useful work,
  read from the start-up records the processes log (pretrain_bench.core.logs.log_startup): a training rank to its first
  step, an evaluation to its first evaluated token (and to its export, its first work), every other job to the start
  of its work; a training launch's torchrun agent until its first rank is launched, and its launcher (launch.py)
  until the agent is. One row per process (`processes`), and per kind of process the count, the sum and the median.

    --checkout DIR      run another checkout's Snakefile and library (PYTHONPATH=DIR/workflow_scripts, ahead of the
                        installed one): the same bench on older code, for alternating before/after runs
    --no-import-probe   leave out the `startup` interpreter probes (half a minute), for alternating runs
"""
import argparse
import csv
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from pretrain_bench.core.logs import read_startups

ROOT = Path(__file__).resolve().parents[1]
TARGET_RATIO = 2.5
NAME = "tiny-cpu"
TORCH_ONLY = "import torch"
DATA_ID = re.compile(r"[a-z]+-[0-9a-f]{10}")  # a data product's folder under logs/data/ (corpus-…, tokenizer-…)
RANK_IMPORTS = "import torch, deepspeed; from transformers import LlamaForCausalLM"


def import_seconds(code: str, runs: int = 3) -> float:
    """Median wall time of a fresh interpreter that runs `code` (and nothing else)."""
    walls = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                       env=dict(os.environ, DS_ACCELERATOR="cpu"))
        walls.append(time.perf_counter() - started)
    return statistics.median(walls)


def job_seconds(benchmarks: Path) -> dict[str, float]:
    """Wall seconds of each job, keyed by its benchmark file relative to benchmarks/<name>/."""
    seconds = {}
    for tsv in sorted(benchmarks.rglob("*.tsv")):
        with tsv.open() as handle:
            seconds[str(tsv.relative_to(benchmarks))] = float(next(csv.DictReader(handle, delimiter="\t"))["s"])
    return seconds


def rule_family(job: str) -> str:
    if job.startswith("bench/measure_peak"):
        return "measure_peak"
    if job.startswith("bench/"):
        return "bench_cell"
    return job.split("/", 1)[0].removesuffix(".tsv")


def job_logs(logs: Path):
    """(job, log file) for every job log under `logs` (a launch's attempt files are left out: its declared log is a
    second name for the newest one)."""
    for path in sorted(logs.rglob("*.log")):
        if not any(part.endswith(".attempts") for part in path.relative_to(logs).parts):
            yield str(path.relative_to(logs).with_suffix("")), path


def process_rows(logs: Path, started_at: float) -> list[dict]:
    """One row per process of the run from the start-up records in its job logs (pretrain_bench.core.logs.log_startup):
    the job, the process, when it was launched (seconds after the pipeline started), its start-up in seconds and the
    heavy libraries it had imported by then. A training launch's rows: its launcher, its torchrun agent (each one's
    start-up ends where its child was launched, read from the ranks' records of their parents) and each rank."""
    rows = []
    for job, path in job_logs(logs):
        records = read_startups(path.read_text(errors="replace"))
        by_process = defaultdict(list)
        for record in records:
            by_process[record["pid"]].append(record)
        ranks = [marks[0] for marks in by_process.values() if "rank" in marks[0]]
        if ranks:
            first_rank = min(record["launched"] for record in ranks)
            launcher, agent = sorted({tuple(record["parents_launched"][::-1]) for record in ranks})[0]
            rows.append(_row(job, "launcher", launcher, agent, started_at, []))
            rows.append(_row(job, "torchrun agent", agent, first_rank, started_at, ["torch"]))
        for marks in by_process.values():
            first = min(marks, key=lambda record: record["reached"])
            process = f"rank {first['rank']}" if "rank" in first else "job"
            row = _row(job, process, first["launched"], first["reached"], started_at, first["imported"])
            row.update({f"to_{record['what'].replace(' ', '_')}_s": record["startup_s"] for record in marks})
            rows.append(row)
    return sorted(rows, key=lambda row: row["launched_s"])


def _row(job: str, process: str, launched: float, reached: float, started_at: float, imported: list) -> dict:
    return {"job": job, "process": process, "launched_s": round(launched - started_at, 2),
            "startup_s": round(reached - launched, 2), "imported": imported}


def process_kind(row: dict) -> str:
    """What kind of process a row is: a rank, an agent, a launcher, or the job's rule family (evaluate, report ...)."""
    if row["process"] != "job":
        return row["process"].split(" ")[0] if row["process"].startswith("rank") else row["process"]
    parts = row["job"].split("/")[1:]  # logs/<name>/<rule>... or logs/data/<corpus id>/<tokenizer id>/.../<rule>...
    while row["job"].startswith("data/") and len(parts) > 1 and DATA_ID.fullmatch(parts[0]):
        parts = parts[1:]
    if parts[0] == "bench":  # bench/measure_peak, bench/bench_matrix, bench/<cell>/rep<r>/{plan,train}
        return {"plan": "plan_bench_cell", "train": "bench_cell"}.get(parts[-1], parts[-1])
    return rule_family("/".join(parts))


def startup_by_kind(rows: list[dict]) -> dict:
    kinds = defaultdict(list)
    for row in rows:
        kinds[process_kind(row)].append(row["startup_s"])
    return {kind: {"processes": len(values), "sum_s": round(sum(values), 2),
                   "median_s": round(statistics.median(values), 2)} for kind, values in sorted(kinds.items())}


def main(out: Path, checkout: Path = ROOT, import_probe: bool = True) -> dict:
    env = dict(os.environ)
    if checkout != ROOT:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(checkout / "workflow_scripts"),
                                                          env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as workdir:
        cmd = [sys.executable, "-m", "snakemake", "--cores", "2", "--resources", "gpu=3", "--snakefile",
               str(checkout / "Snakefile"), "--directory", workdir, "--configfile",
               str(checkout / "config" / "tiny-cpu.yaml")]
        started_at = time.time()
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - started
        if proc.returncode:
            raise SystemExit(f"the tiny pipeline failed:\n{proc.stderr[-4000:]}")
        processes = process_rows(Path(workdir) / "logs", started_at)
        jobs = job_seconds(Path(workdir) / "benchmarks" / NAME)
        # one launch per cell and repeat
        plans = [json.loads(path.read_text())
                 for path in (Path(workdir) / "results" / NAME / "bench").glob("*/rep*/plan.json")]
        main_plan = json.loads((Path(workdir) / "results" / NAME / "train" / "plan.json").read_text())
    by_rule = defaultdict(float)
    for job, seconds in jobs.items():
        by_rule[rule_family(job)] += seconds
    pretrain = jobs["pretrain.tsv"]
    launches = len(plans) + 1
    ranks = sum(plan["config"]["train"]["gpus"] for plan in [*plans, main_plan])
    model_processes = sum(rule_family(job) in ("evaluate", "export_final") for job in jobs)
    startup = {"processes": {"torchrun_agents": launches, "ranks": ranks, "evaluate_and_export": model_processes}}
    if import_probe:
        startup.update(torch_s=import_seconds(TORCH_ONLY), rank_imports_s=import_seconds(RANK_IMPORTS))
        startup["cpu_s"] = (launches * startup["torch_s"]
                            + (ranks + model_processes) * startup["rank_imports_s"])
    result = {
        "what": "`make demo`'s pipeline (config/tiny-cpu.yaml) from scratch, against its own pretrain job",
        "command": " ".join(cmd[1:]).replace(workdir, "<tmp>"),
        "checkout": str(checkout),
        "wall_s": round(wall, 2),
        "pretrain_s": pretrain,
        "wall_over_pretrain": round(wall / pretrain, 3),
        "target_wall_over_pretrain": TARGET_RATIO,
        "meets_target": wall <= TARGET_RATIO * pretrain,
        "outside_pretrain_s": round(wall - pretrain, 2),
        "job_seconds_by_rule": {rule: round(seconds, 2) for rule, seconds in sorted(by_rule.items())},
        "job_seconds": jobs,
        "startup": startup,
        "process_startup": {
            "what": ("seconds from each process's launch to its first useful work (a rank: its first training step; "
                     "an evaluation: its first evaluated token; an agent or launcher: the launch of its child)"),
            "by_kind": startup_by_kind(processes),
            "total_s": round(sum(row["startup_s"] for row in processes), 2),
            "processes": processes,
        },
        "note": ("startup.cpu_s: CPU seconds spent importing torch/deepspeed/transformers alone, summed over the "
                 "run's processes (measured per process here, times the count), on cpu_count cores"),
        "cpu_count": os.cpu_count(), "load_average": os.getloadavg(), "python": platform.python_version(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    shown = {key: value for key, value in result.items() if key not in ("job_seconds", "process_startup")}
    print(json.dumps({**shown, "process_startup_by_kind": result["process_startup"]["by_kind"]}, indent=2))
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, nargs="?", default=ROOT / "bench-results" / "pipeline.json")
    parser.add_argument("--checkout", type=Path, default=ROOT)
    parser.add_argument("--no-import-probe", dest="import_probe", action="store_false")
    args = parser.parse_args()
    main(args.out, args.checkout.resolve(), args.import_probe)
