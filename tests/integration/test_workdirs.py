"""The tests' own working directories: a copy of the tiny data is up to date there, and a Snakemake run there writes
nothing into the repository's results/, logs/, benchmarks/, resources/ or .snakemake/ (which tests/conftest.py
checks for the whole session with the functions tested here)."""
import os

import pytest

from support import (
    DATA_NAME,
    changed_run_outputs,
    data_products,
    run_outputs_snapshot,
    run_snakemake,
    scheduled_rules,
    seeded_workflow_dir,
)

pytestmark = pytest.mark.pipeline
DATA_TARGETS = (data_products().index, data_products().tokenizer_json)


def test_a_copy_of_the_tiny_data_is_up_to_date_and_an_edit_of_its_settings_rebuilds_it(tiny_data, tmp_path):
    before = run_outputs_snapshot()
    workdir = seeded_workflow_dir(tmp_path / "workflow", tiny_data)
    assert scheduled_rules(run_snakemake(workdir, "-n", "--config", f"name={DATA_NAME}", "--", *DATA_TARGETS)) == set()
    # the copy carries Snakemake's records of the jobs that built it: a changed setting reruns them
    edited_data = data_products({"tokenizer": {"vocab_size": 3000}})
    edited = run_snakemake(workdir, "-n", "--config", f"name={DATA_NAME}", 'tokenizer={"vocab_size": 3000}', "--",
                           edited_data.index, edited_data.tokenizer_json)
    assert scheduled_rules(edited) == {"train_tokenizer", "shard_tokens", "index_shards"}
    assert (workdir / ".snakemake").is_dir() and changed_run_outputs(before) == []


def test_the_check_sees_what_a_run_creates_or_rewrites(tmp_path):
    (tmp_path / "logs" / "run").mkdir(parents=True)
    (tmp_path / "logs" / "run" / "job.log").write_text("first")
    before = run_outputs_snapshot(tmp_path)
    assert changed_run_outputs(before, tmp_path) == []
    (tmp_path / "results" / "run").mkdir(parents=True)
    assert changed_run_outputs(before, tmp_path) == ["results", "results/run"]
    log = tmp_path / "logs" / "run" / "job.log"
    log.write_text("second")
    stat = log.stat()
    os.utime(log, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # a rewrite within the clock's resolution
    assert "logs/run/job.log" in changed_run_outputs(before, tmp_path)
