# Helpers, config validation and wildcard constraints; no rules here.
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

sys.path.insert(0, str(Path(workflow.basedir) / "workflow_scripts"))

from pretrain_bench.settings import ConfigError, TrainSettings, check_settings  # noqa: E402


validate(config, schema="../schemas/config.schema.yaml")

try:
    TRAIN = TrainSettings.from_config(config["train"])
    check_settings(TRAIN, seq_len=config["model"]["seq_len"])
except ConfigError as error:
    raise WorkflowError(f"invalid configuration: {error}")

NAME = config["name"]
# Multi-rank rules start torchrun through this script (it needs its sibling pretrain_bench/ beside it, so it is
# run from the workflow folder rather than from Snakemake's source cache).
LAUNCHER = Path(workflow.basedir) / "workflow_scripts" / "launch.py"


wildcard_constraints:
    name=r"[A-Za-z0-9][A-Za-z0-9_.-]*",
    step=r"\d+",


def checkpoint_steps():
    """Steps at which the main run leaves a complete checkpoint that is still kept at the end."""
    total = TRAIN.total_steps(config["model"]["seq_len"])
    steps = sorted(set(range(TRAIN.checkpoint_every, total + 1, TRAIN.checkpoint_every)) | {total})
    return steps[-TRAIN.keep_checkpoints :] if TRAIN.keep_checkpoints else steps


def eval_outputs(name):
    return expand("results/{name}/eval/step{step}.json", name=name, step=checkpoint_steps())


# --- evaluation ---
# Evaluation runs where evaluate.device says (null: where train.device says). Each job on a GPU holds one device slot
# (gpu=1, plus a lock-file slot in the launcher's lock folder); on CPU it asks for none, leaving `gpu` to training.
EVAL_DEVICE = config["evaluate"].get("device") or TRAIN.device
GPU_LOCK_DIR = ".pretrain-bench/gpu-slots"  # the launcher's default: training ranks and evaluations never share
LM_EVAL_TASKS = config["evaluate"]["lm_eval"]["tasks"]


def eval_gpus():
    """GPUs one evaluation job holds: 1 on CUDA (device auto: when this machine sees a GPU), else 0."""
    if EVAL_DEVICE == "auto":
        from pretrain_bench.devices import cuda_device_count

        return 1 if cuda_device_count() else 0
    return 1 if EVAL_DEVICE == "cuda" else 0


EVAL_GPUS = eval_gpus()


def evaluation_outputs(name):
    """Per kept checkpoint: the HF export, eval/step<N>.json and, when evaluate.lm_eval.tasks names any, lm-eval's."""
    outputs = expand("results/{name}/export/step{step}", name=name, step=checkpoint_steps()) + eval_outputs(name)
    if LM_EVAL_TASKS:
        outputs += expand("results/{name}/lm_eval/step{step}.json", name=name, step=checkpoint_steps())
    return outputs


# --- benchmark matrix ---
# Decided once here, at DAG time: which matrix cells this machine runs, and for the others the reason they are left
# out (unsupported on this device, or predicted not to fit). bench/matrix.json records the same decisions.
from snakemake.logging import logger  # noqa: E402

from pretrain_bench.bench_matrix import BenchSettings, plan_matrix  # noqa: E402
from pretrain_bench.memory_model import check_fits  # noqa: E402


def available_ranks():
    """`--resources gpu=N` when given: a cell needing more ranks could never be scheduled."""
    gpu = workflow.global_resources.get("gpu")
    value = getattr(gpu, "value", gpu)
    return int(value) if isinstance(value, (int, float)) else None


try:
    BENCH = BenchSettings.from_config(config)
    BENCH_MATRIX = plan_matrix(config, available_ranks=available_ranks())
except ConfigError as error:
    raise WorkflowError(f"invalid configuration: {error}")
BENCH_CELLS = {entry["cell"]: entry for entry in BENCH_MATRIX["cells"] if entry["status"] == "run"}
# A timed cell takes every core, so nothing else (no other cell, no training, no evaluation) shares the machine.
BENCH_THREADS = 1 if BENCH.allow_concurrent else workflow.cores

try:  # the main run's pre-flight: plan_pretrain stops with these figures; say so at once, even in a dry run
    check_fits(config, TRAIN, what="the main run (rule pretrain)")
except ConfigError as error:
    logger.warning(f"{error}\n(rule plan_pretrain will stop here, before training allocates anything)")


def bench_cell(cell):
    """The matrix entry of a runnable cell; asking for a left-out cell says why it is left out."""
    if cell not in BENCH_CELLS:
        entry = next((e for e in BENCH_MATRIX["cells"] if e["cell"] == cell), None)
        reason = entry["reason"] if entry else "not in benchmark.matrix"
        raise WorkflowError(f"benchmark cell {cell} does not run: {reason}")
    return BENCH_CELLS[cell]


def bench_overrides(cell):
    entry = bench_cell(cell)
    return {axis: entry[axis] for axis in ("gpus", "zero_stage", "precision", "comm_backend", "micro_batch_size",
                                           "offload_optimizer")}


def bench_summaries(name):
    """summary.json of every runnable cell × repeat."""
    return expand("results/{name}/bench/{cell}/rep{rep}/summary.json", name=name, cell=sorted(BENCH_CELLS),
                  rep=range(1, BENCH.repeats + 1))


def final_outputs():
    return [
        f"results/{NAME}/report/report.md",
        f"results/{NAME}/report/report.html",
        f"results/{NAME}/bench/matrix.json",
        *evaluation_outputs(NAME),
    ]
