"""Fixtures shared by test modules (pytest finds this file; helpers live in support.py), and how `make test`
spreads the modules over its pytest-xdist workers."""
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from pretrain_bench.launcher import extension_build_environment
from support import (
    DATA_NAME,
    PIPELINE_OVERLAY,
    PIPELINE_STEPS,
    TINY_CONFIG,
    built_once,
    changed_run_outputs,
    data_folders,
    data_products,
    plan_for,
    run_outputs_snapshot,
    run_snakemake,
    seeded_workflow_dir,
    start,
    tiny_config,
    tree_digest,
    workflow_dir,
    write_yaml,
)

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


RUN_OUTPUTS_BEFORE = pytest.StashKey[dict]()


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist), before any test
        session.config.stash[RUN_OUTPUTS_BEFORE] = run_outputs_snapshot()


def pytest_sessionfinish(session):
    """The suite runs the workflow only in working directories of its own: it fails when anything under the
    repository's results/, logs/, benchmarks/, resources/ or .snakemake/ was created or rewritten while it ran."""
    before = session.config.stash.get(RUN_OUTPUTS_BEFORE, None)
    if before is None:
        return
    if changed := changed_run_outputs(before):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        reporter.ensure_newline()
        listing = "\n".join(f"  {path}" for path in changed[:20]) + ("\n  …" if len(changed) > 20 else "")
        reporter.write_line(f"FAILED: the tests wrote into the repository ({len(changed)} paths):\n{listing}",
                            red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED



@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """A gloo process group of one rank in this process, for the tests that build engines in-process."""
    import torch.distributed as dist

    store = tmp_path_factory.mktemp("store") / "rendezvous"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A working directory holding the tiny data (config/tiny-cpu.yaml's corpus, tokenizer and shards under
    results/data/), built by Snakemake once per session (support.built_once: under pytest-xdist by the first worker to
    ask; the other waits for it and reuses it). Read it, never write to it: runs start from a copy
    (support.seeded_workflow_dir, the `workdir` fixture)."""
    def build(folder: Path) -> None:
        products = data_products()
        targets = [products.index, products.tokenizer_json]
        run_snakemake(workflow_dir(folder), "--config", f"name={DATA_NAME}", "--", *targets, timeout=900)

    return built_once(tmp_path_factory, "tiny-data", build)


@pytest.fixture(scope="session")
def zero_stage_runs(data, tmp_path_factory) -> Path:
    """DeepSpeed runs on 2 ranks at ZeRO stages 0 to 3 (stage 2 with its optimizer offloaded: DeepSpeedCPUAdam), 3
    steps each with a checkpoint at step 3, in <folder>/z<stage> (launcher output in z<stage>.log): launched once per
    session (support.built_once), two at a time, which also proves their rendezvous ports cannot collide (torchrun
    --standalone binds port 0). Each must exit 0. Read them, never write to them."""
    def train(folder: Path) -> None:
        for pair in ((0, 1), (2, 3)):
            procs = []
            for stage in pair:
                offload = {"offload_optimizer": "cpu"} if stage == 2 else {}
                plan = plan_for(data, folder / f"z{stage}", gpus=2, global_batch_size=None, zero_stage=stage,
                                max_steps=3, checkpoint_every=3, **offload)
                procs.append((stage, start(plan, 2, folder / f"z{stage}.log")))
            for stage, proc in procs:
                assert proc.wait(600) == 0, (folder / f"z{stage}.log").read_text()[-3000:]

    return built_once(tmp_path_factory, "zero-stages", train)


@pytest.fixture(scope="session")
def data(tiny_data):
    """The tiny config (named DATA_NAME) and the folders of its data (`.corpus`, `.tokenizer`, `.shards`), for plans
    launched without Snakemake."""
    return tiny_config(DATA_NAME), data_folders(tiny_data)


@pytest.fixture
def workdir(tiny_data, tmp_path) -> Path:
    """A working directory of the test's own for the workflow, holding a copy of the tiny data (results/data/)."""
    return seeded_workflow_dir(tmp_path / "workflow", tiny_data)


@pytest.fixture(scope="session")
def pipeline(tiny_data, tmp_path_factory):
    """One run of the whole tiny pipeline (config/tiny-cpu.yaml + support.PIPELINE_OVERLAY) from a copy of the tiny
    data, shared by the pipeline, evaluation and report tests. The main run goes first on its own, so that its
    checkpoints' digests are taken before any export or evaluation reads them; then every other job.
    PRETRAIN_BENCH_REUSE_RESULTS=<folder> runs it in <folder>, kept between sessions: a second session re-checks the
    finished run there without rerunning it."""
    reuse = os.environ.get("PRETRAIN_BENCH_REUSE_RESULTS")
    workdir = Path(reuse) if reuse else tmp_path_factory.mktemp("pipeline") / "workflow"
    if not (workdir / "results").exists():
        seeded_workflow_dir(workdir, tiny_data)
    overlay = write_yaml(tmp_path_factory.mktemp("pipeline-config") / "overlay.yaml", PIPELINE_OVERLAY)
    configfiles = (TINY_CONFIG, overlay)
    results = workdir / "results" / PIPELINE_OVERLAY["name"]
    run_snakemake(workdir, "--", f"results/{PIPELINE_OVERLAY['name']}/train/summary.json", configfiles=configfiles)
    checkpoints = results / "state" / "checkpoints"
    before = {step: tree_digest(checkpoints / f"step{step}") for step in PIPELINE_STEPS}
    run_snakemake(workdir, configfiles=configfiles)
    after = {step: tree_digest(checkpoints / f"step{step}") for step in PIPELINE_STEPS}
    return SimpleNamespace(workdir=workdir, results=results, data=data_folders(workdir), overlay=overlay,
                           configfiles=configfiles, before=before, after=after)
