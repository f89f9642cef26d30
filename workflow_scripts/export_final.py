"""Snakemake adapter: export the main run's final checkpoint as an HF model folder, train/hf (rule export_final;
the kept checkpoints are exported by rule evaluate)."""
import json
import logging
from pathlib import Path

log = logging.getLogger("pretrain_bench.export_final")


def main(plan_path, step, out_dir, dtype, threads):
    import torch

    from pretrain_bench.evaluate.export import export_checkpoint
    from pretrain_bench.train.plan import Plan

    torch.set_num_threads(max(1, threads))
    plan = Plan.from_json(Path(plan_path))
    info = export_checkpoint(plan, int(step), Path(out_dir), dtype=dtype)
    log.info("%s", json.dumps(info, indent=2))


if "snakemake" in globals():
    from pretrain_bench.core.logs import exit_without_teardown, job_log
    from pretrain_bench.train.launcher import skip_unchosen_trackers

    skip_unchosen_trackers(())  # this job logs to no tracker; DeepSpeed's checkpoint reader would import mlflow

    with job_log(snakemake.log[0], "export_final"):
        main(snakemake.input.plan, snakemake.params.step, snakemake.output[0],
             snakemake.params.dtype, snakemake.threads)
    exit_without_teardown(0)  # the export is written (atomically): skip the seconds of teardown
