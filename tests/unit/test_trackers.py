"""train.loggers: the same step series reach TensorBoard, CSV, W&B (offline) and MLflow (a file store), resumed runs
write each step once, and a tracker whose package is missing is refused naming the key and the pip command."""
import pytest

from pretrain_bench.train.metrics import MetricsSink
from pretrain_bench.train.settings import ConfigError, TrainSettings, check_settings
from pretrain_bench.train.trackers import step_series
from support import read_only_folder
from tracker_files import csv_series, mlflow_series, tensorboard_series, wandb_series

LOGGERS = ("tensorboard", "csv", "wandb", "mlflow")


def record(step: int) -> dict:
    """A metrics.jsonl record as the trainer writes it (every engine alike); held-out loss at steps 2 and 4."""
    values = {"step": step, "loss": 5.0 - step / 2, "lr": 1e-3 * step, "grad_norm": 1.5, "tokens_per_s": 1000.0 + step,
              "step_time_s": 0.5, "comm_s": 0.1, "peak_mem_bytes": [2**30, 2**31], "mfu": 0.01 * step,
              "forward_s": None, "backward_s": None, "optimizer_s": None, "tokens": 1024 * step, "skipped_steps": 0,
              "overflow": False, "loss_scale": None, "after_resume": False}
    if step % 2 == 0:
        values.update(val_loss=6.0 - step / 4, val_perplexity=100.0 / step, eval_time_s=0.2)
    return values


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline, MLflow's own store left to the sink's default (a file store under the tracker folder)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


def expected(steps) -> dict:
    series: dict = {}
    for step in steps:
        for key, value in step_series(record(step)).items():
            series.setdefault(key, {})[step] = value
    return series


def read_all(root) -> dict:
    return {"tensorboard": tensorboard_series(root / "tensorboard"), "csv": csv_series(root / "csv" / "metrics.csv"),
            "wandb": wandb_series(root), "mlflow": mlflow_series(root / "mlruns")}


def test_every_tracker_holds_every_series_of_the_records(offline):
    root = offline / "state"
    root.mkdir()
    run = {"name": "tiny-pretrain", "project": "tiny", "id": "run0001", "config": {"train": {"lr": 1e-3}}}
    with MetricsSink(root / "metrics.jsonl", root, start_step=0, loggers=LOGGERS, run=run) as sink:
        for step in range(1, 5):
            sink.write(record(step))
    want = expected(range(1, 5))
    assert {"train/loss", "train/lr", "train/tokens_per_s", "train/mfu", "train/peak_mem_gib_max",
            "val/loss"} <= set(want)
    assert want["train/peak_mem_gib_max"][1] == 2.0 and set(want["val/loss"]) == {2, 4}
    for name, series in read_all(root).items():
        assert set(series) == set(want), name
        for key, values in want.items():
            assert series[key] == pytest.approx(values, rel=1e-6), (name, key)


def test_a_resumed_run_writes_each_step_once_in_the_file_trackers(offline):
    root = offline / "state"
    root.mkdir()
    with MetricsSink(root / "metrics.jsonl", root, start_step=0, loggers=("tensorboard", "csv")) as sink:
        for step in range(1, 5):  # steps 3 and 4 were never covered by a checkpoint
            sink.write(record(step))
    with MetricsSink(root / "metrics.jsonl", root, start_step=2, loggers=("tensorboard", "csv")) as sink:
        for step in (3, 4, 5):
            sink.write({**record(step), "loss": 9.0})
    for loss in (tensorboard_series(root / "tensorboard")["train/loss"],
                 csv_series(root / "csv" / "metrics.csv")["train/loss"]):
        assert loss == {1: 4.5, 2: 4.0, 3: 9.0, 4: 9.0, 5: 9.0}


def test_a_tracker_that_is_not_installed_is_refused_with_the_pip_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    settings = TrainSettings.from_config({"device": "cpu", "comm_backend": "gloo", "precision": "fp32",
                                          "loggers": ["tensorboard", "wandb"]})
    with pytest.raises(ConfigError, match=r"train.loggers wandb needs the wandb package, which is not installed: "
                                          r"pip install 'wandb==0.31.0'"):
        check_settings(settings, "cpu")


def test_trackers_are_not_imported_unless_chosen(offline):
    import subprocess
    import sys

    code = ("import sys\nfrom pathlib import Path\nfrom pretrain_bench.train.metrics import MetricsSink\n"
            f"root = Path({str(offline / 's')!r})\nroot.mkdir()\n"
            "with MetricsSink(root / 'm.jsonl', root, 0, loggers=('csv',)) as sink: pass\n"
            "print(sorted(m for m in ('wandb', 'mlflow', 'tensorboardX') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("logger", ["csv", "wandb", "mlflow"])
def test_a_read_only_tracker_folder_is_named_before_any_rank_starts(tmp_path, logger):
    from pretrain_bench.train.trackers import TRACKERS, TrackerFolderError, check_tracker_folders

    folder = tmp_path / TRACKERS[logger].folder
    check_tracker_folders(["tensorboard", logger], tmp_path, environ={})  # writable: nothing said
    with read_only_folder(folder):
        with pytest.raises(TrackerFolderError) as caught:
            check_tracker_folders(["tensorboard", logger], tmp_path, environ={})
        assert f"{folder} cannot be written (" in str(caught.value) and f"chooses {logger}" in str(caught.value)
        check_tracker_folders(["tensorboard"], tmp_path, environ={})  # not chosen: not checked
        if logger == "mlflow":  # MLflow writing to a store of the user's: mlruns/ is not written
            check_tracker_folders([logger], tmp_path, environ={"MLFLOW_TRACKING_URI": "http://mlflow.example"})
