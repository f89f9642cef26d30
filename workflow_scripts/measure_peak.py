"""Snakemake adapter: measure this machine's peak FLOP/s once per machine and software (rule measure_peak)."""
import json
import logging
from pathlib import Path

log = logging.getLogger("pretrain_bench.measure_peak")


def main(device, lock_dir, out_path, identity=None):
    from pretrain_bench.bench.peak import measure_hardware_peak
    from pretrain_bench.core.logs import log_startup

    log_startup("first work")
    result = measure_hardware_peak(device, Path(lock_dir), identity)
    Path(out_path).write_text(json.dumps(result, indent=2))
    log.info("%s", json.dumps(result, indent=2))


if "snakemake" in globals():
    from pretrain_bench.core.logs import job_log

    with job_log(snakemake.log[0], "measure_peak"):
        main(snakemake.params.device, snakemake.params.lock_dir, snakemake.output.peak,
             dict(snakemake.params.identity))
