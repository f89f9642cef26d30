"""Snakemake adapter: the shipped lm-eval tasks' data files from the val split (rule lm_eval_data)."""
import json
import logging
from pathlib import Path

log = logging.getLogger("pretrain_bench.lm_eval_data")


def main(val_path, out_dir):
    from pretrain_bench.core.logs import log_startup
    from pretrain_bench.evaluate.harness import build_task_data

    log_startup("first work")
    counts = build_task_data(Path(val_path), Path(out_dir))
    log.info("%s", json.dumps(counts, indent=2))


if "snakemake" in globals():
    from pretrain_bench.core.logs import job_log

    with job_log(snakemake.log[0], "lm_eval_data"):
        main(snakemake.input.val, snakemake.output[0])
