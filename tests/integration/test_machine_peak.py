"""The machine's peak FLOP/s is measured once per machine and software, not once per run name: rule measure_peak
writes results/data/machine-<id>/peak.json with the identity that keys it, and a run of another name finds it."""
import json

from pretrain_bench.bench.peak import MachinePeak
from support import run_snakemake, scheduled_rules, workflow_dir


def test_a_second_run_name_reads_the_peak_the_first_one_measured(tmp_path):
    workdir = workflow_dir(tmp_path / "workflow")
    peak = MachinePeak.here("cpu")  # the tiny config runs on CPU
    assert "measure_peak" in scheduled_rules(run_snakemake(workdir, "-n", "--config", "name=first-run"))
    run_snakemake(workdir, "--config", "name=first-run", "--", peak.path)
    record = json.loads((workdir / peak.path).read_text())
    assert record["identity"] == peak.identity and record["identity"]["torch"]
    assert record["peak_flops"] > 0 and record["peak_source"].startswith("measured: ") and record["measured_at"]
    assert (workdir / "logs" / peak.folder / "measure_peak.log").is_file()
    assert not list((workdir / "results").glob("*/bench/peak.json")), "nothing is kept under a run's name"
    # the whole pipeline of another run name (and of the first) plans everything but the peak
    for name in ("second-run", "first-run"):
        rules = scheduled_rules(run_snakemake(workdir, "-n", "--config", f"name={name}"))
        assert "pretrain" in rules and "bench_cell" in rules and "measure_peak" not in rules, (name, rules)
