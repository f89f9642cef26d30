# Helpers, config validation and wildcard constraints; no rules here.
import gc
import re
import sys
from pathlib import Path

# What Snakemake has loaded by now (its plugins with pandas and SQLAlchemy, the parsed workflow) lives until the
# process ends, yet every full pass of the cyclic garbage collector, and the one at exit, walks all of it again: a
# large part of a dry run's time. Frozen, it is left out of those passes (reference counting still frees it).
gc.freeze()

from snakemake.exceptions import WorkflowError

from pretrain_bench.config.checks import check_torch_version
from pretrain_bench.config.experiment import Config
from pretrain_bench.config.schema import AXES as bench_axes, coerce_command_line_types, fill_defaults_and_validate, load_schema
from pretrain_bench.core.devices import GPU_LOCK_DIR as DEVICE_LOCK_DIR
from pretrain_bench.config.settings import ConfigError


# The schema parsed once, for the command-line types and for validation (Snakemake's validate() would parse it a
# second time, with a slower YAML loader); skipped like validate() when this workflow is a module told to skip it.
CONFIG_SCHEMA = load_schema(Path(workflow.basedir) / "schemas" / "config.schema.yaml")
coerce_command_line_types(config, CONFIG_SCHEMA)
if not workflow.modifier.skip_validation:
    from jsonschema import ValidationError

    try:
        fill_defaults_and_validate(config, CONFIG_SCHEMA)
    except ValidationError as error:
        raise WorkflowError("Error validating config file.", error)

# The validated config as typed, frozen settings, built (and its combinations checked) once: rules and helpers read
# these, never config[...]. A rule hands its script a value, or a whole block as <BLOCK>.as_dict() when the script
# reads the block (Snakemake compares params as plain values); the script rebuilds the block's settings from it.
try:
    SETTINGS = Config.from_config(config)
except ConfigError as error:
    raise WorkflowError(f"invalid configuration: {error}")
try:
    check_torch_version()
except ConfigError as error:
    raise WorkflowError(str(error))
NAME, CORPUS, TOKENIZER, SHARDS = SETTINGS.name, SETTINGS.corpus, SETTINGS.tokenizer, SETTINGS.shards
MODEL, TRAIN, EVALUATE, BENCH, REPORT = SETTINGS.model, SETTINGS.train, SETTINGS.evaluate, SETTINGS.benchmark, \
    SETTINGS.report


def check_other_run_input(key, path, name, marker):
    """`key` (model.init_from, tokenizer.path) naming a path under results/<other name>/ names another run's output,
    read as it is: this config never builds it (see wildcard_constraints). Missing (`marker` inside it missing, or
    the path itself when marker is None), the error says how that run builds it, before any job runs."""
    if not path or path.startswith("hf://"):
        return
    folder = Path(path.removeprefix("file://"))
    try:
        parts = folder.resolve().relative_to(Path("results").resolve()).parts
    except ValueError:
        return  # a path outside results/: nothing of a run's
    if not parts:
        return
    if parts[0] == name:
        raise WorkflowError(f"{key} {path} is inside this run's own results/{name}/, which this run writes: a run "
                            "cannot start from itself; give the continued run a new name (name: ...)")
    needed = folder / marker if marker else folder
    if not needed.exists():
        target = Path("results", *parts).as_posix()
        raise WorkflowError(
            f"{key} {path}: run {parts[0]!r} has not written it yet (no {needed}), and this run ({name!r}) never "
            f"builds another run's results. Build it first with the config files of run {parts[0]!r}:\n  snakemake "
            f"--cores all --resources gpu=<N> --configfile <its config files> --config name={parts[0]} -- {target}\n"
            "then run this again.")


check_other_run_input("model.init_from", MODEL.init_from, NAME, "config.json")
# A tokenizer.path where tokenizers are data products (results/data/..., or results/<run>/tokenizer, where runs kept
# theirs before) that is not there yet: the error names the target that builds it.
from pretrain_bench.data.products import DataProducts, missing_tokenizer_problem

if TOKENIZER_PROBLEM := missing_tokenizer_problem(TOKENIZER.path,
                                                  DataProducts.from_settings(CORPUS, TOKENIZER, SHARDS, None)):
    raise WorkflowError(TOKENIZER_PROBLEM)
check_other_run_input("tokenizer.path", TOKENIZER.path, NAME, None)
# The local files of corpus.sources (file://, globs expanded here, at DAG time): inputs of the corpus.
from pretrain_bench.data.sources import CorpusError, local_source_files

try:
    CORPUS_FILES = local_source_files(CORPUS.sources)
except CorpusError as error:
    raise WorkflowError(f"corpus.sources: {error}")
# A local model.init_from folder is an input of planning: a newer export there replans (and so continues again).
INIT_FROM_INPUT = [] if (MODEL.init_from or "hf://").startswith("hf://") else [MODEL.init_from.removeprefix("file://")]

# Multi-rank rules start torchrun through this script (it needs its sibling pretrain_bench/ beside it, so it is
# run from the workflow folder rather than from Snakemake's source cache).
LAUNCHER = Path(workflow.basedir) / "workflow_scripts" / "launch.py"
# SIGINT to Snakemake (Ctrl-C, kill -INT) stops a running training with a checkpoint; Snakemake alone would wait.
from pretrain_bench.train.launcher import interrupts_stop_training

interrupts_stop_training(LAUNCHER)
# Shell rules start the launcher with the interpreter Snakemake runs with (a venv's, activated or not); under
# --sdm conda with the rule's environment's own python, which conda puts first on PATH. A Path, not a str: Snakemake
# tracks only plain values as params, and the same venv reached by another path must not count as a changed param
# (it would retrain).
from snakemake.settings.types import DeploymentMethod

PYTHON = Path("python" if DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method else sys.executable)


# `name` matches this config's name only: another run's results/<name>/ (say the export model.init_from continues
# from) is never a job's output here, so it is read as a plain input and never rebuilt or deleted with this config.
wildcard_constraints:
    name=re.escape(NAME),
    step=r"\d+",


def checkpoint_steps():
    """Steps at which the main run leaves a complete checkpoint that is still kept at the end."""
    return TRAIN.checkpoint_steps(MODEL.seq_len)


def eval_outputs(name):
    return expand("results/{name}/eval/step{step}.json", name=name, step=checkpoint_steps())


# --- evaluation ---
# Evaluation runs where evaluate.device says (null: where train.device says). Each job on a GPU holds one device slot
# (gpu=1, plus a lock-file slot in the launcher's lock folder); on CPU it asks for none, leaving `gpu` to training.
EVAL_DEVICE = EVALUATE.device or TRAIN.device
GPU_LOCK_DIR = str(DEVICE_LOCK_DIR)  # the launcher's too: training ranks and evaluations never share
LM_EVAL_TASKS = EVALUATE.lm_eval["tasks"]


def eval_gpus():
    """GPUs one evaluation job holds: 1 on CUDA (device auto: when this machine has a GPU, decided as for the
    benchmark matrix, from nvidia-smi rather than by importing torch), else 0."""
    from pretrain_bench.core.devices import resolve_device_cheaply

    return 1 if resolve_device_cheaply(EVAL_DEVICE) == "cuda" else 0


EVAL_GPUS = eval_gpus()


def lm_eval_outputs(name):
    """lm_eval/step<N>.json per kept checkpoint when evaluate.lm_eval.tasks names any task, else none."""
    if not LM_EVAL_TASKS:
        return []
    return expand("results/{name}/lm_eval/step{step}.json", name=name, step=checkpoint_steps())


def evaluation_outputs(name):
    """Per kept checkpoint: the HF export, eval/step<N>.json and, when evaluate.lm_eval.tasks names any, lm-eval's."""
    return (expand("results/{name}/export/step{step}", name=name, step=checkpoint_steps()) + eval_outputs(name)
            + lm_eval_outputs(name))


# --- benchmark matrix ---
# Decided once here, at DAG time: which matrix cells this machine runs, and for the others the reason they are left
# out (unsupported on this device, or predicted not to fit). bench/matrix.json records the same decisions.
from snakemake.logging import logger

from pretrain_bench.bench.matrix import Cell, cells_text, cost_preview, plan_matrix, planning_peak, preview_text
from pretrain_bench.train.memory.fit import fit_run, summary_line
from pretrain_bench.train.memory.model import config_vocab_size
from pretrain_bench.train.plan import cell_train, plan_config
from pretrain_bench.data.tokenizer import adopted_tokenizer_path


def available_ranks():
    """`--resources gpu=N` when given: a cell needing more ranks could never be scheduled."""
    gpu = workflow.global_resources.get("gpu")
    value = getattr(gpu, "value", gpu)
    return int(value) if isinstance(value, (int, float)) else None


try:
    VOCAB_SIZE = config_vocab_size(config)
    BENCH_MATRIX = plan_matrix(config, available_ranks=available_ranks(), vocab_size=VOCAB_SIZE)
    # tokenizer.path, or model.init_from's own tokenizer: the tokenizer stage adopts it instead of training one
    ADOPTED_TOKENIZER = adopted_tokenizer_path(config)
except ConfigError as error:
    raise WorkflowError(f"invalid configuration: {error}")
# The corpus, tokenizer and shards this config reads, under results/data/ by the digest of the settings that shape
# each (pretrain_bench/data/products.py): every run with equal data settings shares them.
from pretrain_bench.data.products import DataProducts

DATA = DataProducts.from_settings(CORPUS, TOKENIZER, SHARDS, ADOPTED_TOKENIZER)
BENCH_CELLS = {entry["cell"]: entry for entry in BENCH_MATRIX["cells"] if entry["status"] == "run"}
BENCH_ENABLED = bool(BENCH_MATRIX["cells"])
# A timed cell takes every core, so nothing else (no other cell, no training, no evaluation) shares the machine.
BENCH_THREADS = 1 if BENCH.allow_concurrent else workflow.cores


def main_plan_config():
    """What plan_pretrain hands its script: the part of the config a training run reads."""
    return plan_config(config)


def cell_plan_config(cell):
    """What plan_bench_cell hands its script for one cell: the main run's with the cell's train block."""
    return plan_config(config, train=cell_train(config, Cell(**bench_overrides(cell)).train_overrides(BENCH)))


# --- what an evaluation reruns for ---
# An evaluation's result is decided by its checkpoint's bytes (the digest of its commit marker) and the evaluate
# settings: both are params of rule evaluate, and eval/step<N>.json records them (pretrain_bench/evaluate/inputs.py).
# When this config only trains the existing run further (train.max_steps or max_tokens raised), the run resumes and
# keeps its checkpoints as they are: for an evaluation that still matches its checkpoint and settings, the run's
# plan and summary are then `ancient` inputs, so training on evaluates only the new checkpoints. After any other
# edit of the plan config they are plain inputs: a run that may start afresh writes every checkpoint anew, and every
# one is evaluated again.
from pretrain_bench.evaluate.inputs import evaluation_is_current, marker_digest
from pretrain_bench.train.plan import only_trains_further

TRAINS_FURTHER = only_trains_further(Path(f"results/{NAME}/train/plan.json"), main_plan_config())
EVALUATE_SETTINGS = {
    "dtype": EVALUATE.export_dtype,
    "max_tokens": EVALUATE.max_tokens,
    "batch_size": EVALUATE.batch_size,
    "device": EVAL_DEVICE,
    "precision": EVALUATE.precision,
    "prompts": list(EVALUATE.prompts),
    "generation": EVALUATE.generation,
    "lm_eval": EVALUATE.lm_eval if LM_EVAL_TASKS else None,
}


def training_input(path):
    """`path` (the run's plan or summary) as an input of the evaluate rule, ancient when this config only trains further
    and the checkpoint's evaluation outputs all exist, made from that checkpoint as it is and with these settings.
    Not merely when they exist: Snakemake 9 skips the checks of every job downstream of one it will rerun (here,
    training) and schedules none linked to it by ancient inputs alone, so their own missing outputs or changed
    params would go unnoticed."""

    def evaluate_input(wildcards):
        name, step = wildcards.name, int(wildcards.step)
        current = (all(Path(output).exists() for output in step_evaluation_outputs(name, step))
                   and evaluation_is_current(f"results/{name}/eval/step{step}.json", f"results/{name}/state", step,
                                             EVALUATE_SETTINGS))
        concrete = path.format(name=name)
        return ancient(concrete) if TRAINS_FURTHER and current else concrete

    return evaluate_input


def step_evaluation_outputs(name, step):
    """Rule evaluate's outputs for checkpoint `step`."""
    return [f"results/{name}/export/step{step}", f"results/{name}/eval/step{step}.json",
            *([f"results/{name}/lm_eval/step{step}.json"] if LM_EVAL_TASKS else [])]


def checkpoint_digest(wildcards):
    """The digest of checkpoint step<N>'s commit marker, None before training wrote it. Snakemake computes params
    again just before a job runs: an evaluation records the marker it read, and one written anew reruns it."""
    return marker_digest(f"results/{wildcards.name}/state", wildcards.step)


# The main run's pre-flight, at once, even in a dry run: what train.memory_fit chooses, or why plan_pretrain will
# stop; then what the run and the benchmark matrix are predicted to cost.
try:
    MAIN_FIT = fit_run(main_plan_config(), TRAIN, VOCAB_SIZE, what="the main run (rule pretrain)",
                       nvme_path=TRAIN.nvme_path or f"results/{NAME}/state/nvme", state_dir=f"results/{NAME}/state")
    logger.info(summary_line(MAIN_FIT[1]))
except ConfigError as error:
    logger.warning(f"{error}\n(rule plan_pretrain will stop here, before training allocates anything)")
    MAIN_FIT = (TRAIN, None)
logger.info(preview_text(cost_preview(BENCH_MATRIX, MAIN_FIT[0], MODEL, VOCAB_SIZE,
                                      *planning_peak(config, BENCH_MATRIX["device"], NAME))))
logger.info(cells_text(BENCH_MATRIX))
# An earlier benchmark of this hardware and model (any run name under results/): its fastest measured setup.
from pretrain_bench.report.recommendation import previous_recommendation_text

_EARLIER = previous_recommendation_text(Path("results"), BENCH_MATRIX["device"], MODEL, VOCAB_SIZE)
if _EARLIER:
    logger.info(_EARLIER)

# Host RAM of one export or evaluation job (memory_model.export_and_evaluation_host_bytes), as mem_mb (10^6 bytes, as
# Snakemake counts it): with `--resources mem_mb=N` Snakemake runs only as many at once as fit; SLURM gets it as --mem.
from pretrain_bench.train.memory.model import export_and_evaluation_host_bytes, run_shape

FINAL_EXPORT_DTYPE = "fp32"  # train/hf holds the master weights exactly
_MAIN_SHAPE = run_shape(main_plan_config(), MAIN_FIT[0], "cpu", VOCAB_SIZE)  # the parameters, whatever the device
EXPORT_FINAL_MEM_MB = -(-export_and_evaluation_host_bytes(_MAIN_SHAPE, FINAL_EXPORT_DTYPE) // 10**6)
EVALUATE_MEM_MB = -(-export_and_evaluation_host_bytes(_MAIN_SHAPE, EVALUATE_SETTINGS["dtype"],
                                                      EVALUATE_SETTINGS["precision"]) // 10**6)


def bench_cell(cell):
    """The matrix entry of a runnable cell; asking for a left-out cell says why it is left out."""
    if cell not in BENCH_CELLS:
        entry = next((e for e in BENCH_MATRIX["cells"] if e["cell"] == cell), None)
        reason = entry["reason"] if entry else "not in benchmark.matrix"
        raise WorkflowError(f"benchmark cell {cell} does not run: {reason}")
    return BENCH_CELLS[cell]


def bench_overrides(cell):
    entry = bench_cell(cell)
    return {axis: entry[axis] for axis in bench_axes}


def bench_summaries(name):
    """summary.json of every runnable cell × repeat."""
    return expand("results/{name}/bench/{cell}/rep{rep}/summary.json", name=name, cell=sorted(BENCH_CELLS),
                  rep=range(1, BENCH.repeats + 1))


def bench_previous_round(wildcards):
    """Repeat r of a cell waits for repeat r - 1 of every cell, so that the repeats of different cells interleave
    (round 1 of every cell, then round 2 ...) and a slow spell of the machine spreads over cells instead of
    landing on one. Ancient: an order only, never a reason to rerun a repeat that exists."""
    rep = int(wildcards.rep)
    if rep == 1:
        return []
    return [ancient(path) for path in expand("results/{name}/bench/{cell}/rep{rep}/summary.json",
                                             name=wildcards.name, cell=sorted(BENCH_CELLS), rep=rep - 1)]


def bench_matrix_outputs(name):
    """bench/matrix.json when the benchmark matrix has any cell (benchmark.enabled and non-empty axes), else none."""
    return [f"results/{name}/bench/matrix.json"] if BENCH_ENABLED else []


def final_outputs():
    return [
        f"results/{NAME}/report/report.md",
        f"results/{NAME}/report/report.html",
        f"results/{NAME}/train/hf",
        *bench_matrix_outputs(NAME),
        *evaluation_outputs(NAME),
    ]
