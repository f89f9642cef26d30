"""How long `snakemake -n` takes to build the DAG of a 48-cell benchmark matrix (target: under 2 s).

    python bench/bench_dag.py bench-results/dag.json

The matrix is 3 rank counts × ZeRO 0-3 × fp16/bf16 × nccl/gloo on the tiny model with train.device cuda, so every
cell is runnable (a dry run needs no GPU) and fits the 24 GiB fallback: 48 cells × 3 repeats = 144 launches plus
144 plans. Each figure is the wall time of a whole `snakemake -n` process (interpreter start, parsing, DAG, job
listing), median of several runs, beside the same command with a 1-cell matrix, so the matrix's own cost shows, and
beside `snakemake -n` on a one-rule Snakefile (Snakemake's own start-up: interpreter, plugin registry, parsing).
"""
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
MATRIX_48 = {"gpus": [1, 2, 3], "zero_stage": [0, 1, 2, 3], "precision": ["fp16", "bf16"],
             "comm_backend": ["nccl", "gloo"], "offload_optimizer": ["none"]}
MATRIX_1 = {"gpus": [1], "zero_stage": [2], "precision": ["bf16"], "comm_backend": ["nccl"],
            "offload_optimizer": ["none"]}


def dry_run(matrix: dict, runs: int) -> dict:
    overlay = {"name": f"dagbench-{os.getpid()}", "train": {"device": "cuda"},
               "benchmark": {"matrix": matrix, "repeats": 3}}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
        yaml.safe_dump(overlay, handle)
    cmd = [sys.executable, "-m", "snakemake", "-n", "--cores", "32", "--resources", "gpu=3",
           "--configfile", "config/tiny-cpu.yaml", handle.name]
    walls, cpus, jobs = [], [], None
    try:
        for _ in range(runs):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            started = time.perf_counter()
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
            walls.append(time.perf_counter() - started)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
            if proc.returncode:
                raise SystemExit(f"snakemake -n failed:\n{proc.stderr[-3000:]}")
            counts = [line.split() for line in proc.stdout.splitlines() if line.startswith(("bench_cell ", "total "))]
            jobs = {row[0]: int(row[1]) for row in counts}
    finally:
        os.unlink(handle.name)
    return {"wall_s": {"median": statistics.median(walls), "min": min(walls), "max": max(walls), "runs": walls},
            "cpu_s_median": statistics.median(cpus), "jobs": jobs}


def snakemake_alone(runs: int) -> dict:
    """`snakemake -n` on a one-rule Snakefile, with the same interpreter and installed plugins: Snakemake's own
    start-up, which no workflow can go below."""
    walls = []
    with tempfile.TemporaryDirectory() as workdir:
        snakefile = Path(workdir) / "Snakefile"
        snakefile.write_text('rule all:\n    output: "x"\n    shell: "touch {output}"\n')
        cmd = [sys.executable, "-m", "snakemake", "-n", "--cores", "32", "--snakefile", str(snakefile),
               "--directory", workdir]
        for _ in range(runs):
            started = time.perf_counter()
            subprocess.run(cmd, capture_output=True, check=True, timeout=120)
            walls.append(time.perf_counter() - started)
    return {"median": statistics.median(walls), "min": min(walls), "max": max(walls), "runs": walls}


def main(out: Path, runs: int = 5) -> dict:
    from pretrain_bench.bench.matrix import BenchSettings, plan_matrix
    from pretrain_bench.workflow.experiment import load_config, plan_config

    config = load_config(ROOT / "config.yaml", ROOT / "config" / "tiny-cpu.yaml")
    config["train"]["device"] = "cuda"
    config["benchmark"]["matrix"] = MATRIX_48
    started = time.perf_counter()
    planned = plan_matrix(plan_config(config), BenchSettings.from_config(config), available_ranks=3)
    planning_s = time.perf_counter() - started

    big, small, alone = dry_run(MATRIX_48, runs), dry_run(MATRIX_1, runs), snakemake_alone(runs)
    result = {
        "what": "wall time of `snakemake -n --cores 32 --resources gpu=3` (tiny model, train.device cuda)",
        "cells": len(planned["cells"]), "runnable_cells": sum(e["status"] == "run" for e in planned["cells"]),
        "matrix_48": big, "matrix_1": small,
        "matrix_cost_s": big["wall_s"]["median"] - small["wall_s"]["median"],
        "snakemake_alone_wall_s": alone,
        "this_workflow_over_snakemake_alone_s": big["wall_s"]["median"] - alone["median"],
        "plan_matrix_s": planning_s,
        "target_s": 2.0, "under_target": big["wall_s"]["median"] < 2.0,
        "load_average": os.getloadavg(), "cpu_count": os.cpu_count(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k not in ("matrix_48", "matrix_1")}, indent=2))
    print(f"48 cells: {big['wall_s']['median']:.2f} s median wall ({big['cpu_s_median']:.2f} s CPU), "
          f"1 cell: {small['wall_s']['median']:.2f} s, a one-rule Snakefile: {alone['median']:.2f} s; "
          f"jobs {big['jobs']}")
    return result


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "bench-results" / "dag.json")
