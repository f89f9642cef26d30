"""Fixtures shared by test modules (pytest finds this file; helpers live in support.py), and how `make test`
spreads the tests over its pytest-xdist workers."""
import os

# `make test` runs two workers on a 2-core machine, each starting ranks and jobs sized for the whole machine, so the
# suite's processes share cores by design. OpenMP's default, threads that spin while they wait, then burns the time a
# sibling thread needs to run (measured: README, "Cores shared with other work"; the suite: README, Quickstart). Passive
# waiting changes no result (the same bits), only who holds the cores; every process the tests start inherits it.
# Set before anything loads torch's OpenMP runtime, which reads it once.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from pathlib import Path
from types import SimpleNamespace

import pytest

from pretrain_bench.train.launcher import extension_build_environment
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

# `make test` runs two pytest-xdist workers, each taking whole units of tests, so that a module's fixtures are built
# once. A unit is a module, and the five modules that share the `pipeline` run are one; in the modules of
# ONE_TEST_UNITS, whose tests share no fixture but the session's (which both workers share through a file lock, as
# tiny_data does), each test is a unit of its own. Units start longest first, by UNIT_SECONDS (their time under
# `make test` on 2 cores, measured on a loaded machine: what counts is their order; an integration test not listed
# counts as UNLISTED_SECONDS, a unit test as 0), so no long unit is left for the end while the other worker idles.
SHARED_GROUPS = {"test_benchmark_report": "pipeline", "test_evaluate": "pipeline", "test_tiny_pipeline": "pipeline",
                 "test_benchmark_search": "pipeline", "test_demo_learns": "pipeline"}
ONE_TEST_UNITS = {"test_engine", "test_faults", "test_multinode", "test_export_zero", "test_memory_measured",
                  "test_moe_engines"}
UNIT_SECONDS = {
    "pipeline": 1565, "test_declarative": 800, "test_evaluate_reruns": 550, "test_engines": 540, "test_slurm": 400,
    "test_gpu_smoke_cpu": 280, "test_data_products": 150, "test_pinned_ranks_run": 100, "test_workdirs": 30,
    "test_trackers_every_engine": 80, "test_native_llama_run": 75,
    "test_engine::test_zero_stages_0_to_3_train_concurrently_and_shut_down": 85,
    "test_engine::test_kill_9_then_rerun_resumes_with_identical_losses": 80,
    "test_engine::test_other_config_or_world_size_start_fresh_beside_the_old_run_or_resume_reshaped": 175,
    "test_engine::test_non_finite_loss_aborts_and_keeps_last_good_checkpoint": 40,
    "test_engine::test_continue_from_export_eval_every_and_csv_monitor": 105,
    "test_engine::test_compile_under_every_engine_trains_to_eagers_losses": 180,
    "test_engine::test_compiled_run_killed_then_rerun_resumes_with_identical_losses": 110,
    "test_faults::test_second_run_is_refused_while_the_first_trains_and_every_attempt_log_is_kept": 105,
    "test_faults::test_full_disk_during_a_save_fails_naming_it_and_keeps_the_committed_checkpoints": 60,
    "test_faults::test_damaged_checkpoints_fall_back_and_steps_never_go_backwards": 60,
    "test_faults::test_an_interrupt_stops_training_with_a_checkpoint_the_rerun_resumes_and_a_finished_run_is_never_"
    "retrained": 300,
    "test_faults::test_pruned_checkpoints_free_their_disk_while_a_resumed_run_continues": 75,
    "test_faults::test_a_world_size_edit_starts_fresh_keeping_the_old_run_or_resumes_reshaped_where_allowed": 100,
    "test_faults::test_a_crash_before_the_first_checkpoint_and_a_cut_last_line_leave_each_step_once": 70,
    "test_faults::test_same_size_overwrite_of_a_checkpoint_is_found_by_default_and_never_loaded": 50,
    "test_faults::test_non_finite_loss_right_after_a_resume_names_the_checkpoint_and_falls_back_once": 130,
    "test_memory_measured::test_offloaded_run_rss_matches_the_memory_model": 80,
    "test_multinode::test_two_nodes_on_one_machine_match_one_node_of_the_same_world_size": 60,
    "test_export_zero::test_a_bf16_export_of_a_zero_checkpoint_equals_its_fp32_weights_cast": 20,
    # each engine of the parametrized test (zero3 also resumes reshaped, fsdp's steps are the slowest): 20-50 s
    "test_moe_engines::test_moe_kill_9_then_rerun_repeats_losses_expert_load_and_router_bias_and_exports": 40,
}
UNLISTED_SECONDS = 60


def scheduling_unit(nodeid: str) -> str:
    """The unit of tests (see above) the test with this pytest node id belongs to: `<module>`, or
    `<module>::<test>[<parameters>]` in the modules of ONE_TEST_UNITS."""
    path, _, test = nodeid.partition("::")
    module = path.rsplit("/", 1)[-1].removesuffix(".py")
    if module in ONE_TEST_UNITS:
        return f"{module}::{test}"
    return SHARED_GROUPS.get(module, module)


def expected_seconds(nodeid: str) -> int:
    """UNIT_SECONDS of the test's unit (each parameter set of a parametrized test in ONE_TEST_UNITS: its test's)."""
    default = UNLISTED_SECONDS if nodeid.startswith("tests/integration/") else 0
    return UNIT_SECONDS.get(scheduling_unit(nodeid).split("[", 1)[0], default)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: -expected_seconds(item.nodeid))  # stable: a unit keeps its tests' order


@pytest.hookimpl(optionalhook=True)  # an xdist hook: pytest without xdist (-p no:xdist) does not know it
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with scheduling_unit as the scope, in collection order (written here because xdist's own
    --dist loadgroup marks node ids in a way pytest 9 no longer reads)."""
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scheduling_unit(nodeid)

    config.option.loadscopereorder = False  # keep the longest-first order above
    return Units(config, log)


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
    --standalone binds port 0). Each must exit 0. Read them, never write to them: test_engine.py's compile test takes
    z0 as its eager reference, test_pinned_ranks_run.py reads z0's rank placement."""
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
    products = data_products()  # of the config as the run starts, whatever edits it later
    run_snakemake(workdir, "--", f"results/{PIPELINE_OVERLAY['name']}/train/summary.json", configfiles=configfiles)
    checkpoints = results / "state" / "checkpoints"
    before = {step: tree_digest(checkpoints / f"step{step}") for step in PIPELINE_STEPS}
    run_snakemake(workdir, configfiles=configfiles)
    after = {step: tree_digest(checkpoints / f"step{step}") for step in PIPELINE_STEPS}
    return SimpleNamespace(workdir=workdir, results=results, products=products,
                           data=data_folders(workdir, products), overlay=overlay, configfiles=configfiles,
                           before=before, after=after)
