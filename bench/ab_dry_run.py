"""A/B: alternate `snakemake -n` runs of two workflow trees (say a `git archive` of main and this tree) on the
48-cell matrix; the median wall time of each. docs/benchmarks/2026-12-04-dry-run.md has its figures.

    python bench/ab_dry_run.py TREE_A TREE_B [RUNS] [tiny,config]
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

MATRIX_48 = {"gpus": [1, 2, 3], "zero_stage": [0, 1, 2, 3], "precision": ["fp16", "bf16"],
             "comm_backend": ["nccl", "gloo"]}
VARIANTS = {
    # bench/bench_dag.py's: the tiny model on cuda, every cell runnable
    "tiny": (["config/tiny-cpu.yaml"], {"name": "dagbench", "train": {"device": "cuda"}, "benchmark": {
        "matrix": {**MATRIX_48, "offload_optimizer": ["none"]}, "repeats": 3}}),
    # config.yaml as shipped, with the 48-cell matrix
    "config": ([], {"benchmark": {"matrix": MATRIX_48}}),
}


def workdir(tree: str, variant: str) -> tuple[Path, list[str]]:
    """A working directory for `tree`'s workflow with the variant's overlay, and the --configfile list."""
    folder = Path(tempfile.mkdtemp(prefix=f"ab-{Path(tree).name}-{variant}-"))
    for name in ("config.yaml", "config", "profiles"):
        (folder / name).symlink_to(Path(tree) / name)
    files, overlay = VARIANTS[variant]
    (folder / "overlay.yaml").write_text(yaml.safe_dump(overlay))
    return folder, [*files, "overlay.yaml"]


def run(tree: str, folder: Path, files: list[str]) -> tuple[float, dict]:
    """Wall seconds of one `snakemake -n` of `tree`, and its job counts (bench_cell, total)."""
    env = dict(os.environ, PYTHONPATH=f"{tree}/workflow_scripts")
    command = [sys.executable, "-m", "snakemake", "-n", "--cores", "32", "--resources", "gpu=3",
               "--snakefile", f"{tree}/Snakefile", "--configfile", *files]
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=folder, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    if proc.returncode:
        sys.exit(f"{tree} failed:\n{proc.stderr[-3000:]}")
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(("bench_cell ", "total "))]
    return wall, {row[0]: int(row[1]) for row in rows}


def main(trees: dict[str, str], runs: int, variants: list[str]) -> dict:
    result = {}
    for variant in variants:
        folders = {key: workdir(tree, variant) for key, tree in trees.items()}
        for key, tree in trees.items():
            run(tree, *folders[key])  # the file cache warmed for both
        walls, jobs = {key: [] for key in trees}, {}
        for _ in range(runs):  # alternating, so a slow spell of the machine falls on both
            for key, tree in trees.items():
                wall, jobs[key] = run(tree, *folders[key])
                walls[key].append(wall)
        result[variant] = {key: {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
                                 "max": round(max(values), 3), "runs": [round(v, 3) for v in values],
                                 "jobs": jobs[key]} for key, values in walls.items()}
        print(variant, json.dumps(result[variant]), flush=True)
    print("load average", os.getloadavg())
    return result


if __name__ == "__main__":
    main({"A": sys.argv[1], "B": sys.argv[2]}, int(sys.argv[3]) if len(sys.argv) > 3 else 5,
         sys.argv[4].split(",") if len(sys.argv) > 4 else list(VARIANTS))
