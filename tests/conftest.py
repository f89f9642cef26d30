"""Fixtures shared by test modules (pytest finds this file; helpers live in support.py)."""
import subprocess
import sys

import pytest

from support import ROOT, tiny_config

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
