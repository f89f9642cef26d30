"""The one atomic writer, read_jsonl, and MetricsSink closing rank 0's outputs on every exit path."""
import json

import pytest

from pretrain_bench.io import atomic_write_json, atomic_write_text, read_jsonl
from pretrain_bench.metrics import MetricsSink, truncate_jsonl


def test_atomic_write_replaces_whole_and_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "summary.json"
    target.write_text("old")
    atomic_write_json(target, {"b": 1, "a": [1, 2]}, sort_keys=True)
    assert target.read_text() == json.dumps({"b": 1, "a": [1, 2]}, indent=2, sort_keys=True)
    atomic_write_text(target, "→ text\n")
    assert target.read_text(encoding="utf-8") == "→ text\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_atomic_write_failure_keeps_the_old_file_and_removes_the_temporary_one(tmp_path):
    target = tmp_path / "plan.json"
    target.write_text("old")
    with pytest.raises(TypeError):
        atomic_write_json(target, {"not json": object()})
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_read_jsonl_and_truncate(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert read_jsonl(path) == []
    path.write_text('{"step": 1}\n\n{"step": 2}\n{"step": 3}\n')
    truncate_jsonl(path, 2)
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]


def record(step):
    return {"step": step, "loss": 2.0, "lr": 1e-3, "grad_norm": None, "tokens_per_s": 10.0, "step_time_s": 0.1,
            "comm_s": None, "peak_mem_bytes": [2**30, 2**31]}


def test_metrics_sink_closes_on_an_exception(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    with pytest.raises(RuntimeError):
        with MetricsSink(metrics, tmp_path / "tensorboard", start_step=0) as sink:
            sink.write(record(1))
            raise RuntimeError("aborted")
    assert sink.file is None and sink.board is None
    assert read_jsonl(metrics) == [record(1)] and list((tmp_path / "tensorboard").iterdir())


def test_metrics_sink_does_nothing_when_disabled(tmp_path):
    with MetricsSink(tmp_path / "metrics.jsonl", tmp_path / "tensorboard", start_step=0, enabled=False) as sink:
        sink.write(record(1))
    assert not list(tmp_path.iterdir())
