"""Fixtures shared by test modules (pytest finds this file; helpers live in support.py), and how `make test`
spreads the modules over its pytest-xdist workers."""
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml

from pretrain_bench.launcher import extension_build_environment
from support import (
    PIPELINE_NAME,
    PIPELINE_OVERLAY,
    PIPELINE_STEPS,
    ROOT,
    TINY_CONFIG,
    engine_data_lock,
    run_snakemake,
    tiny_config,
    tree_digest,
)

ENGINE_NAME = "itest-engine"

# Engines that tests build in their own processes (not through the launcher) load DeepSpeed's CPU ops as every rank
# does: from where `make install` built them, with the same ninja; not from a second build in torch's shared cache.
os.environ.update(extension_build_environment())

# `make test` runs two pytest-xdist workers. A group of tests stays on one worker, so module fixtures are built once:
# each module is a group, and the three modules that share the `pipeline` run are one. On 2 cores two workers overlap
# one module's waits (process start-up, collectives, the SLURM test's scheduler) with another's compute. Groups start
# longest first (their time under `make test`, measured), so that no long one is left for the end.
SHARED_GROUPS = {"test_benchmark_report": "pipeline", "test_evaluate": "pipeline", "test_tiny_pipeline": "pipeline"}
LONGEST_FIRST = ("test_engine", "pipeline", "test_declarative", "test_faults", "test_slurm", "test_engines",
                 "test_gpu_smoke_cpu", "test_memory_measured", "test_export_zero", "test_multinode")


def module_group(nodeid: str) -> str:
    stem = nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
    return SHARED_GROUPS.get(stem, stem)


def pytest_collection_modifyitems(config, items):
    rank = {name: position for position, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(module_group(item.nodeid), len(rank)))  # stable: a module keeps its order


def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with module_group as the scope, in collection order (written here because xdist's own
    --dist loadgroup marks node ids in a way pytest 9 no longer reads)."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return module_group(nodeid)

    config.option.loadscopereorder = False  # keep the longest-first order above
    return ModuleGroups(config, log)


@pytest.fixture(scope="session")
def data():
    """Tokenizer and shards of the tiny config, built once by Snakemake."""
    results = ROOT / "results" / ENGINE_NAME
    targets = [f"results/{ENGINE_NAME}/shards/index.json", f"results/{ENGINE_NAME}/tokenizer/tokenizer.json"]
    cmd = [sys.executable, "-m", "snakemake", *targets, "--cores", "2", "--configfile", "config/tiny-cpu.yaml",
           "--config", f"name={ENGINE_NAME}"]
    with engine_data_lock():  # another worker may be building the same files, or training on them (test_engines)
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
