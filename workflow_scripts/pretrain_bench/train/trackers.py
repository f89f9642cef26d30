"""Experiment trackers for rank 0's step records (train.loggers): TensorBoard, CSV, Weights & Biases, MLflow.

Every engine (DeepSpeed, DDP, FSDP) hands the same metrics.jsonl records to `MetricsSink`, which hands each to the
trackers chosen as the series of `step_series`, the one list of what a tracker shows: loss, learning rate, tokens/s,
MFU, memory, gradient norm, step and communication time, and at evaluation steps the held-out loss and perplexity.
Each tracker writes under its own folder of the run's state folder: tensorboard/, csv/, wandb/ and (where
MLFLOW_TRACKING_URI names no other store) mlruns/.

W&B and MLflow are optional installs (`pip install -e '.[trackers]'`), imported only when chosen; a run that chooses
one without it installed is refused before it starts (`missing_trackers`). W&B's mode, entity and key come from its
own environment (WANDB_MODE=offline writes the run to wandb/ without a network), MLflow's store from
MLFLOW_TRACKING_URI.
"""
from __future__ import annotations

import csv
import os
from pathlib import Path

GIB = 2**30


def step_series(record: dict) -> dict[str, float]:
    """The series a tracker shows for one metrics.jsonl record (a value that is None is left out)."""
    series = {
        "train/loss": record["loss"], "train/lr": record["lr"], "train/tokens_per_s": record["tokens_per_s"],
        "train/mfu": record.get("mfu"), "train/peak_mem_gib_max": max(record["peak_mem_bytes"]) / GIB,
        "train/grad_norm": record["grad_norm"], "train/step_time_s": record["step_time_s"],
        "train/comm_s": record["comm_s"],
    }
    if "val_loss" in record:
        series.update({"val/loss": record["val_loss"], "val/perplexity": record["val_perplexity"],
                       "val/eval_time_s": record["eval_time_s"]})
    return {key: float(value) for key, value in series.items() if value is not None}


SERIES = ("train/loss", "train/lr", "train/tokens_per_s", "train/mfu", "train/peak_mem_gib_max", "train/grad_norm",
          "train/step_time_s", "train/comm_s", "val/loss", "val/perplexity", "val/eval_time_s")


class TensorBoardTracker:
    """tensorboard/: event files (tensorboardX); events past a resumed checkpoint are purged."""

    folder = "tensorboard"  # under the run's state folder; moves with the run (run_state)
    in_outputs = True  # copied to the run's output folder when it finishes

    def __init__(self, root: Path, start_step: int, run: dict):
        from tensorboardX import SummaryWriter

        # the suffix keeps a resumed attempt's file apart from one started in the same second (same file name)
        self.writer = SummaryWriter(str(Path(root) / self.folder), purge_step=start_step + 1,
                                    filename_suffix=f".from-step{start_step}")

    def log(self, series: dict, step: int) -> None:
        for key, value in series.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class CsvTracker:
    """csv/metrics.csv: one row per step, a column per series (empty where a step has none); rows past a resumed
    checkpoint are dropped, as metrics.jsonl's are."""

    folder = "csv"
    in_outputs = True

    def __init__(self, root: Path, start_step: int, run: dict):
        self.path = Path(root) / self.folder / "metrics.csv"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if self.path.is_file():
            with open(self.path, newline="") as handle:
                kept = [row for row in csv.DictReader(handle) if row.get("step", "").isdigit()
                        and int(row["step"]) <= start_step]
        self.file = open(self.path, "w", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=("step", *SERIES))
        self.writer.writeheader()
        self.writer.writerows(kept)

    def log(self, series: dict, step: int) -> None:
        self.writer.writerow({"step": step, **series})
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class WandbTracker:
    """wandb/: a W&B run named after the run, in project train.tracker_project; resumed attempts continue it (its id
    is the run's state folder's)."""

    folder = "wandb"
    in_outputs = False  # W&B keeps its own copy

    def __init__(self, root: Path, start_step: int, run: dict):
        import wandb

        folder = Path(root) / self.folder
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=run["project"], name=run["name"], id=run["id"], resume="allow",
                              dir=str(root), config=run["config"])

    def log(self, series: dict, step: int) -> None:
        self.run.log(series, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run in experiment train.tracker_project, in MLFLOW_TRACKING_URI's store or, where that is unset, a
    file store in mlruns/."""

    folder = "mlruns"  # used only where MLFLOW_TRACKING_URI names no other store
    in_outputs = False  # MLflow keeps its own copy

    def __init__(self, root: Path, start_step: int, run: dict):
        import mlflow

        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # MLflow 3 keeps its file store behind this switch; a store the user names is used as it is
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((Path(root) / self.folder).resolve().as_uri())
        mlflow.set_experiment(run["project"])
        self.mlflow = mlflow
        self.run = mlflow.start_run(run_name=run["name"], tags={"pretrain_bench.run_id": run["id"]})
        mlflow.log_params({key: str(value)[:500] for key, value in run["config"].get("train", {}).items()})

    def log(self, series: dict, step: int) -> None:
        self.mlflow.log_metrics(series, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


TRACKERS = {"tensorboard": TensorBoardTracker, "csv": CsvTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}
# Every tracker's folder under a run's state folder: what moves with the run when it is set aside (run_state), and
# those copied to the run's outputs when it finishes.
TRACKER_FOLDERS = tuple(tracker.folder for tracker in TRACKERS.values())
OUTPUT_TRACKER_FOLDERS = tuple(tracker.folder for tracker in TRACKERS.values() if tracker.in_outputs)


class TrackerFolderError(ValueError):
    """A chosen tracker's folder cannot be written; the message names the folder and the logger."""


def tracker_folder(name: str, root: Path, environ=os.environ) -> Path | None:
    """The folder under `root` that tracker `name` writes (None: MLflow writing to MLFLOW_TRACKING_URI's store)."""
    if name == "mlflow" and environ.get("MLFLOW_TRACKING_URI"):
        return None
    return Path(root) / TRACKERS[name].folder


def check_tracker_folders(loggers, root: Path, environ=os.environ) -> None:
    """Refuse, before any rank starts, a chosen tracker whose folder under `root` cannot be written (where it does
    not exist yet: the folder it will be made in): a read-only mount, a folder of another user, a file where the
    folder should be. Probed by writing a file, since permission bits alone say nothing of a read-only file system or
    of root; nothing is made (an empty tracker folder would count as a run's state, run_state)."""
    import tempfile

    for name in loggers:
        folder = tracker_folder(name, root, environ)
        if folder is None:
            continue
        probe = folder
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        try:
            if not probe.is_dir():
                raise NotADirectoryError(20, "a file where the folder should be")
            with tempfile.TemporaryFile(dir=probe, prefix=".write-probe-"):
                pass
        except OSError as error:
            raise TrackerFolderError(
                f"{folder} cannot be written ({error.strerror or error}), and train.loggers chooses {name}, which "
                f"writes there: make it writable, move it away, or leave {name} out of train.loggers") from None


def open_trackers(loggers, root: Path, start_step: int, run: dict) -> list:
    """The chosen trackers, opened under `root`. `run`: name, project, id (stable across resumes) and config."""
    opened = []
    try:
        for name in loggers:
            opened.append(TRACKERS[name](root, start_step, run))
    except BaseException:
        for tracker in opened:
            tracker.close()
        raise
    return opened
