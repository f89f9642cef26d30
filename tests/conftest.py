"""Fixtures shared by test modules (pytest finds this file; helpers live in support.py)."""
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml

from support import PIPELINE_NAME, PIPELINE_OVERLAY, PIPELINE_STEPS, ROOT, TINY_CONFIG, run_snakemake, tiny_config, \
    tree_digest

ENGINE_NAME = "itest-engine"


@pytest.fixture(scope="session")
def data():
    """Tokenizer and shards of the tiny config, built once by Snakemake."""
    results = ROOT / "results" / ENGINE_NAME
    targets = [f"results/{ENGINE_NAME}/shards/index.json", f"results/{ENGINE_NAME}/tokenizer/tokenizer.json"]
    cmd = [sys.executable, "-m", "snakemake", *targets, "--cores", "2", "--configfile", "config/tiny-cpu.yaml",
           "--config", f"name={ENGINE_NAME}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = tiny_config(ENGINE_NAME)
    return config, results


@pytest.fixture(scope="session")
def pipeline(tmp_path_factory):
    """One run of the whole tiny pipeline (config/tiny-cpu.yaml + support.PIPELINE_OVERLAY), shared by the pipeline,
    evaluation and report tests. The main run goes first on its own, so that its checkpoints' digests are taken
    before any export or evaluation reads them; then every other job. PRETRAIN_BENCH_REUSE_RESULTS=1 re-checks a
    finished run without rerunning it."""
    results = ROOT / "results" / PIPELINE_NAME
    if not os.environ.get("PRETRAIN_BENCH_REUSE_RESULTS"):
        for folder in (results, ROOT / "logs" / PIPELINE_NAME, ROOT / "benchmarks" / PIPELINE_NAME):
            shutil.rmtree(folder, ignore_errors=True)
    overlay = tmp_path_factory.mktemp("pipeline") / "overlay.yaml"
    overlay.write_text(yaml.safe_dump(PIPELINE_OVERLAY))
    configfiles = (TINY_CONFIG, overlay)
    run_snakemake(PIPELINE_NAME, "--", f"results/{PIPELINE_NAME}/train/summary.json", configfiles=configfiles)
    checkpoints = results / "state" / "checkpoints"
    before = {step: tree_digest(checkpoints / f"step{step}") for step in PIPELINE_STEPS}
    run_snakemake(PIPELINE_NAME, configfiles=configfiles)
    after = {step: tree_digest(checkpoints / f"step{step}") for step in PIPELINE_STEPS}
    return SimpleNamespace(results=results, overlay=overlay, configfiles=configfiles, before=before, after=after)
