"""Snakemake adapter: write the benchmark matrix decided at DAG time, with time estimates (rule bench_matrix)."""
import json
import logging
from pathlib import Path

log = logging.getLogger("pretrain_bench.write_bench_matrix")


def main(matrix, model, vocab_size, grad_accum_steps, peak_path, out_path):
    from pretrain_bench.bench.matrix import time_estimate
    from pretrain_bench.config.schema import ModelSettings
    from pretrain_bench.core.logs import log_startup

    log_startup("first work")
    model = ModelSettings.from_config(model)
    peak = json.loads(Path(peak_path).read_text())
    matrix = {**matrix, "peak": peak, "cells": [
        {**entry, "time_estimate": time_estimate(entry, model, vocab_size, grad_accum_steps, peak, matrix["steps"])}
        for entry in matrix["cells"]
    ]}
    Path(out_path).write_text(json.dumps(matrix, indent=2))
    for entry in matrix["cells"]:
        log.info("%s: %s%s", entry["cell"], entry["status"], f" ({entry['reason']})" if entry["reason"] else "")


if "snakemake" in globals():
    from pretrain_bench.core.logs import job_log

    with job_log(snakemake.log[0], "write_bench_matrix"):
        main(snakemake.params.matrix, snakemake.params.model, snakemake.params.vocab_size,
             snakemake.params.grad_accum_steps, snakemake.input.peak, snakemake.output.matrix)
