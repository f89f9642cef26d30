# The pipeline as the rules read it, built once (pretrain_bench/workflow/pipeline.py: validation, settings, data
# products, the benchmark matrix, the GPU count from --resources gpu), thin wrappers the rules call, the wildcard
# constraints and the handler that ends a failed run with the job's own lines; no rules here.
import atexit
import gc
import re
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.logging import logger
from snakemake.settings.types import DeploymentMethod

from pretrain_bench.core.devices import GPU_LOCK_DIR as DEVICE_LOCK_DIR
from pretrain_bench.data.shards import served_product_problem
from pretrain_bench.train.launcher import interrupts_stop_training
from pretrain_bench.train.state_lock import snakemake_lock_note
from pretrain_bench.workflow.failures import closing_lines, failure_report
from pretrain_bench.workflow.pipeline import FINAL_EXPORT_DTYPE, Pipeline, PlanError, resource_number
from pretrain_bench.workflow.preflight import preflight

# What Snakemake has loaded by now (its plugins with pandas and SQLAlchemy, the parsed workflow) lives until the
# process ends, yet every full pass of the cyclic garbage collector, and the one at exit, walks all of it again: a
# large part of a dry run's time. Frozen, it is left out of those passes (reference counting still frees it).
gc.freeze()

# Validated (unless this workflow is a module told to skip it), with train.gpus from `--resources gpu=N`. Rules and
# helpers read the typed settings, never config[...]. A rule hands its script a value, or a whole block as
# <BLOCK>.as_dict() when the script reads the block (Snakemake compares params as plain values).
try:
    PIPELINE = Pipeline(config, workflow.basedir, gpu_resource=resource_number(workflow.global_resources.get("gpu")),
                        cores=workflow.cores, validate=not workflow.modifier.skip_validation)
except PlanError as error:
    raise WorkflowError(str(error))
SETTINGS, NAME, DATA = PIPELINE.settings, PIPELINE.name, PIPELINE.data
# Before any job: where another Snakemake holds this directory's lock, say that --nolock is safe; a damaged shared data
# product is named here (pretrain_bench/data/shards.py), never trained on, and never deleted by a failed job.
if workflow.is_main_process:
    if LOCK_NOTE := snakemake_lock_note(Path(".snakemake/locks"), sys.argv):
        logger.warning(LOCK_NOTE)
    if DATA_PROBLEM := served_product_problem(DATA, sys.argv):
        raise WorkflowError(DATA_PROBLEM)
CORPUS, TOKENIZER, SHARDS, MODEL = SETTINGS.corpus, SETTINGS.tokenizer, SETTINGS.shards, SETTINGS.model
TRAIN, EVALUATE, BENCH, REPORT = SETTINGS.train, SETTINGS.evaluate, SETTINGS.benchmark, SETTINGS.report
CORPUS_FILES, INIT_FROM_INPUT = PIPELINE.corpus_files, PIPELINE.init_from_input
ADOPTED_TOKENIZER, VOCAB_SIZE = PIPELINE.adopted_tokenizer, PIPELINE.vocab_size
BENCH_MATRIX, BENCH_THREADS = PIPELINE.matrix, PIPELINE.bench_threads
EVAL_GPUS, LM_EVAL_TASKS, EVALUATE_SETTINGS = PIPELINE.eval_gpus, PIPELINE.lm_eval_tasks, PIPELINE.evaluate_settings
PEAK = PIPELINE.peak  # results/data/machine-<id>/peak.json: one per machine and software
GPU_LOCK_DIR = str(DEVICE_LOCK_DIR)  # the launcher's too: training ranks and evaluations never share a device

# Multi-rank rules start torchrun through this script (it needs its sibling pretrain_bench/ beside it, so it is
# run from the workflow folder rather than from Snakemake's source cache).
LAUNCHER = Path(workflow.basedir) / "workflow_scripts" / "launch.py"
# SIGINT to Snakemake (Ctrl-C, kill -INT) stops a running training with a checkpoint; Snakemake alone would wait.
interrupts_stop_training(LAUNCHER)
# Shell rules start the launcher with the interpreter Snakemake runs with (a venv's, activated or not); under
# --sdm conda with the rule's environment's own python, which conda puts first on PATH. A Path, not a str: Snakemake
# tracks only plain values as params, and the same venv reached by another path must not count as a changed param
# (it would retrain).
PYTHON = Path("python" if DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method else sys.executable)

# The main run's pre-flight, at once, even in a dry run; then the memory each export and evaluation job asks for.
MAIN_TRAIN = preflight(PIPELINE, logger.info, logger.warning)
EXPORT_FINAL_MEM_MB, EVALUATE_MEM_MB = PIPELINE.memory_mb(MAIN_TRAIN)


# `name` matches this config's name only: another run's results/<name>/ (say the export model.init_from continues
# from) is never a job's output here, so it is read as a plain input and never rebuilt or deleted with this config.
# A cell is one path segment: no wildcard value of this workflow can grow by matching its own outputs.
wildcard_constraints:
    name=re.escape(NAME),
    step=r"\d+",
    cell=r"[^/]+",


# When a job fails or the run is interrupted, the terminal ends with what the job itself said (its log's last lines
# of this project's own: what was saved and the command to continue, or the error's cause), not a traceback.
onerror:
    # After an interrupt (Ctrl-C) the stopped job is still among the running ones: Snakemake's scheduler returns before
    # it handles the job's error.
    STOPPED_JOBS = [*workflow.scheduler.failed, *workflow.scheduler.running]
    REPORT_TEXT = failure_report(STOPPED_JOBS)
    if REPORT_TEXT:
        logger.error(REPORT_TEXT)
    # Snakemake prints its log's path, the elapsed time and "WorkflowError: At least one job did not complete
    # successfully." after this handler: the saved step and the command to continue are printed at exit, last.
    if CLOSING_TEXT := closing_lines(STOPPED_JOBS, sys.argv):
        atexit.register(print, CLOSING_TEXT, file=sys.stderr, flush=True)


# Thin wrappers: the rules' input, param and resource functions, answered by PIPELINE.
def final_outputs():
    return PIPELINE.final_outputs()


def eval_outputs(name):
    return PIPELINE.eval_outputs(name)


def lm_eval_outputs(name):
    return PIPELINE.lm_eval_outputs(name)


def bench_matrix_outputs(name):
    return PIPELINE.bench_matrix_outputs(name)


def bench_summaries(name):
    return PIPELINE.bench_summaries(name)


def main_plan_config():
    """What plan_pretrain hands its script: the part of the config a training run reads (a mapping: Snakemake
    reruns the plan when it changes)."""
    return PIPELINE.main_plan_config.as_dict()


def training_input(path):
    """`path` (the run's plan or summary) as rule evaluate's input, ancient where Pipeline.training_input says."""
    return lambda wildcards: PIPELINE.training_input(path, wildcards.name, int(wildcards.step), ancient)


def checkpoint_digest(wildcards):
    return PIPELINE.checkpoint_digest(wildcards.name, wildcards.step)


def bench_cell(cell):
    """The matrix entry of a runnable cell; asking for a left-out cell says why it is left out."""
    try:
        return PIPELINE.bench_cell(cell)
    except PlanError as error:
        raise WorkflowError(str(error))


def cell_plan_config(cell):
    try:
        return PIPELINE.cell_plan_config(cell).as_dict()
    except PlanError as error:
        raise WorkflowError(str(error))


def bench_previous_round(wildcards):
    return PIPELINE.previous_round(wildcards.name, int(wildcards.rep), ancient)
