"""The tiny pipeline end to end against its own `pretrain` job (#1 of the pipeline's speed goals: at most 2x).

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
"""
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_RATIO = 2.0
NAME = "tiny-cpu"
TORCH_ONLY = "import torch"
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


def main(out: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as workdir:
        cmd = [sys.executable, "-m", "snakemake", "--cores", "2", "--resources", "gpu=3", "--snakefile",
               str(ROOT / "Snakefile"), "--directory", workdir, "--configfile", str(ROOT / "config" / "tiny-cpu.yaml")]
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if proc.returncode:
            raise SystemExit(f"the tiny pipeline failed:\n{proc.stderr[-4000:]}")
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
    startup = {"torch_s": import_seconds(TORCH_ONLY), "rank_imports_s": import_seconds(RANK_IMPORTS),
               "processes": {"torchrun_agents": launches, "ranks": ranks, "evaluate_and_export": model_processes}}
    startup["cpu_s"] = (launches * startup["torch_s"]
                        + (ranks + model_processes) * startup["rank_imports_s"])
    result = {
        "what": "`make demo`'s pipeline (config/tiny-cpu.yaml) from scratch, against its own pretrain job",
        "command": " ".join(cmd[1:]).replace(workdir, "<tmp>"),
        "wall_s": round(wall, 2),
        "pretrain_s": pretrain,
        "wall_over_pretrain": round(wall / pretrain, 3),
        "target_wall_over_pretrain": TARGET_RATIO,
        "meets_target": wall <= TARGET_RATIO * pretrain,
        "outside_pretrain_s": round(wall - pretrain, 2),
        "job_seconds_by_rule": {rule: round(seconds, 2) for rule, seconds in sorted(by_rule.items())},
        "job_seconds": jobs,
        "startup": startup,
        "note": ("startup.cpu_s: CPU seconds spent importing torch/deepspeed/transformers alone, summed over the "
                 "run's processes (measured per process here, times the count), on cpu_count cores"),
        "cpu_count": os.cpu_count(), "load_average": os.getloadavg(), "python": platform.python_version(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "job_seconds"}, indent=2))
    return result


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "bench-results" / "pipeline.json")
