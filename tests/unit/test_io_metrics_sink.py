"""The one atomic writer, read_jsonl, and MetricsSink closing rank 0's outputs on every exit path."""
import json

import pytest

from pretrain_bench.core.io import atomic_write_json, atomic_write_text, read_jsonl
from pretrain_bench.train.metrics import MetricsSink, truncate_jsonl


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
        with MetricsSink(metrics, tmp_path, start_step=0) as sink:
            sink.write(record(1))
            raise RuntimeError("aborted")
    assert sink.file is None and sink.trackers == []
    assert read_jsonl(metrics) == [record(1)] and list((tmp_path / "tensorboard").iterdir())


def test_metrics_sink_does_nothing_when_disabled(tmp_path):
    with MetricsSink(tmp_path / "metrics.jsonl", tmp_path, start_step=0, enabled=False) as sink:
        sink.write(record(1))
    assert not list(tmp_path.iterdir())


def test_a_last_line_cut_short_is_dropped_with_a_warning_and_any_other_bad_line_names_the_file(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    whole = '{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.4}\n'
    path.write_text(whole + '{"step": 3, "lo')  # a crash while the third record was appended
    assert read_jsonl(path) == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.4}]
    assert f"{path}: dropped its last line (15 bytes)" in caplog.text
    path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(ValueError, match=f"{path} line 2 is not JSON"):
        read_jsonl(path)


def test_the_sink_drops_records_past_its_start_and_a_cut_line_so_each_step_is_written_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    # an attempt that died before its first checkpoint, cutting its last record short
    path.write_text("".join(json.dumps(record(s)) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo')
    with MetricsSink(path, tmp_path / "tb", start_step=0) as sink:
        for step in (1, 2, 3, 4, 5):
            sink.write(record(step))
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4, 5]
    with MetricsSink(path, tmp_path / "tb", start_step=3) as sink:  # resumed from checkpoint step 3
        sink.write(record(4))
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4]


def test_the_summary_counts_each_step_once_and_peak_memory_over_both_world_sizes():
    from pretrain_bench.train.metrics import one_record_per_step, peak_memory_per_rank, summarise_steps

    steps = [{**record(s), "forward_s": 0.01, "backward_s": 0.02, "optimizer_s": 0.03} for s in (1, 2, 3)]
    again = [{**r, "step_time_s": 0.2, "loss": 1.0} for r in steps[:2]]  # steps 1-2 recorded twice, in a file
    summary = summarise_steps(steps + again, warmup_steps=0, tokens_per_step=100)
    assert summary["steady_steps"] == 3 and summary["loss"]["last"] == 2.0
    assert [r["step"] for r in one_record_per_step(steps + again)] == [1, 2, 3]
    resized = [{**record(4), "peak_mem_bytes": [5, 6, 7]}]  # resumed at 3 ranks
    assert peak_memory_per_rank(steps + resized, 3) == [2**30, 2**31, 7]
    # resumed at 4 ranks at its last step: no record has rank 3, which is reported as unmeasured, not as 0 bytes
    assert peak_memory_per_rank(steps + resized, 4) == [2**30, 2**31, 7, None]
