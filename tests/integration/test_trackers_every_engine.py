"""train.loggers through the real launcher: DeepSpeed, DDP and FSDP each log the same step series (loss, learning
rate, tokens/s, MFU, memory, held-out loss ...) to TensorBoard, CSV, W&B (offline) and MLflow (a file store), and
every tracker's files hold what metrics.jsonl holds."""
import pytest

from pretrain_bench.core.io import read_jsonl
from pretrain_bench.train.trackers import step_series
from support import plan_for, run
from tracker_files import csv_series, mlflow_series, tensorboard_series, wandb_series

pytestmark = pytest.mark.engine

# zero_stage null: the layout follows the engine (the tiny config's dict holds DeepSpeed's resolved 2)
ENGINES = {"deepspeed": {}, "ddp": {"engine": "ddp", "zero_stage": None},
           "fsdp": {"engine": "fsdp", "zero_stage": None}}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_every_logger_holds_the_pipelines_series_under_every_engine(data, tmp_path, engine):
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "MLFLOW_ALLOW_FILE_STORE": "true",
           "MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri()}
    config, results = data  # a peak to divide by (report.peak_tflops), so every step has an MFU
    data = ({**config, "report": {**config["report"], "peak_tflops": 1.0}}, results)
    # 2 ranks: a multi-rank run of each engine, whose rank 0 logs
    plan = plan_for(data, tmp_path / "run", max_steps=4, checkpoint_every=4, eval_every=2, eval_tokens=2 * 256,
                    loggers=["tensorboard", "csv", "wandb", "mlflow"], tracker_project="itest-trackers",
                    gpus=2, global_batch_size=None, **ENGINES[engine])
    assert run(plan, 2, tmp_path / "run.log", env=env) == 0, (tmp_path / "run.log").read_text()[-3000:]
    want: dict = {}
    for record in read_jsonl(tmp_path / "run" / "out" / "metrics.jsonl"):
        for key, value in step_series(record).items():
            want.setdefault(key, {})[record["step"]] = value
    assert {"train/loss", "train/lr", "train/tokens_per_s", "train/mfu", "train/peak_mem_gib_max", "val/loss",
            "val/perplexity"} <= set(want), sorted(want)
    assert set(want["train/loss"]) == {1, 2, 3, 4} and set(want["val/loss"]) == {2, 4}
    state, out = tmp_path / "run" / "state", tmp_path / "run" / "out"
    found = {"tensorboard": tensorboard_series(out / "tensorboard"), "csv": csv_series(out / "csv" / "metrics.csv"),
             "wandb": wandb_series(state), "mlflow": mlflow_series(tmp_path / "mlruns")}
    for name, series in found.items():
        assert set(series) >= set(want), (engine, name, sorted(set(want) - set(series)))
        for key, values in want.items():
            assert series[key] == pytest.approx(values, rel=1e-6), (engine, name, key)


def test_two_engine_switches_keep_every_trackers_rows_with_their_run(data, tmp_path):
    """deepspeed → ddp → deepspeed on one name: each switch sets the run aside whole, every tracker's folder with
    it, so the CSV log and metrics.jsonl end on the same run's row (a step's time is measured once, by one run)."""
    import csv
    import json
    from pathlib import Path

    from pretrain_bench.train.trackers import TRACKER_FOLDERS

    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "MLFLOW_ALLOW_FILE_STORE": "true",
           "MLFLOW_TRACKING_URI": ""}  # MLflow's file store in the state folder's mlruns/
    run_dir = tmp_path / "run"
    state, out = run_dir / "state", run_dir / "out"

    def last_rows(folder: Path) -> tuple[dict, dict]:
        with open(folder / "csv" / "metrics.csv", newline="") as handle:
            rows = list(csv.DictReader(handle))
        return rows[-1], read_jsonl(folder / "metrics.jsonl")[-1]

    fingerprints = {}
    for attempt, engine in enumerate(("deepspeed", "ddp", "deepspeed")):
        plan = plan_for(data, run_dir, max_steps=4, checkpoint_every=4, gpus=2, global_batch_size=None,
                        loggers=["tensorboard", "csv", "wandb", "mlflow"], tracker_project="itest-switch",
                        **ENGINES[engine])
        log = tmp_path / f"{attempt}-{engine}.log"
        assert run(plan, 2, log, env=env) == 0, log.read_text()[-3000:]
        fingerprints[engine] = json.loads((state / "ACTIVE.json").read_text())["id"]
        for folder in (out, state):
            row, record = last_rows(folder)
            assert int(row["step"]) == record["step"] == 4, (engine, folder)
            assert float(row["train/step_time_s"]) == record["step_time_s"], (engine, folder, "another run's row")
        assert json.loads((out / "summary.json").read_text())["engine"] == engine
    log = log.read_text()
    assert "resuming the run kept in" in log and "already finished step 4" in log, log[-3000:]
    assert "step 1/4" not in log, "the DeepSpeed run came back finished: nothing is trained again"
    kept = state / "runs" / fingerprints["ddp"]
    assert fingerprints["ddp"] != fingerprints["deepspeed"]  # the engine is in the fingerprint
    for folder in TRACKER_FOLDERS:
        assert (kept / folder).is_dir(), f"{folder}/ of the DDP run stayed behind"
    row, record = last_rows(kept)
    assert float(row["train/step_time_s"]) == record["step_time_s"]
