"""Read back what each tracker of train.loggers wrote, as {series: {step: value}}, for the tracker tests."""
from __future__ import annotations

import csv
import json
import struct
from pathlib import Path


def tensorboard_series(folder: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def csv_series(path: Path) -> dict:
    series: dict = {}
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            for key, value in row.items():
                if key != "step" and value != "":
                    series.setdefault(key, {})[int(row["step"])] = float(value)
    return series


def _wandb_records(path: Path):
    """The records of a W&B offline run file (run-<id>.wandb): LevelDB's log format, 32 KiB blocks of chunks with a
    7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) after a 7-byte file header. Hand-written
    because wandb no longer ships a Python reader for it (its Go core reads it)."""
    data, block, header = Path(path).read_bytes(), 32768, 7
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    position, chunks = header, b""
    while position + header <= len(data):
        left = block - position % block
        if left < header:
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position:position + header])
        if length == 0 and kind == 0:  # the rest of a block, zero-filled
            position += left
            continue
        chunks += data[position + header:position + header + length]
        position += header + length
        if kind in (1, 4):
            yield chunks
            chunks = b""


def wandb_series(root: Path) -> dict:
    """The history of every offline W&B run under root/wandb/."""
    from wandb.proto import wandb_internal_pb2

    series: dict = {}
    for path in sorted(Path(root, "wandb").glob("offline-run-*/run-*.wandb")):
        for data in _wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") != "history":
                continue
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for key, value in items.items():
                if not key.startswith("_"):
                    series.setdefault(key, {})[items["_step"]] = float(value)
    return series


def mlflow_series(store: Path) -> dict:
    """Every metric of every run in an MLflow file store (<store>/<experiment>/<run>/metrics/<name>: 'time value
    step' lines)."""
    series: dict = {}
    for metrics in Path(store).glob("*/*/metrics"):
        for path in metrics.rglob("*"):
            if path.is_file():
                for line in path.read_text().splitlines():
                    _time, value, step = line.split()
                    series.setdefault(path.relative_to(metrics).as_posix(), {})[int(step)] = float(value)
    return series
