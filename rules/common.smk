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
    check_settings(TRAIN)
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


def final_outputs():
    return [
        f"results/{NAME}/report/report.md",
        f"results/{NAME}/report/report.html",
    ]
