"""Snakemake adapter: lm-evaluation-harness on one checkpoint's HF export, offline (rule lm_eval)."""
import json
import logging
import os
from pathlib import Path

log = logging.getLogger("pretrain_bench.run_lm_eval")

# Before anything imports huggingface_hub or datasets: they read these once, at import.
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def main(export_dir, data_dir, out_path, tasks, limit, batch_size, device, precision, lock_dir, threads):
    import torch

    from pretrain_bench.harness import run_harness

    torch.set_num_threads(max(1, threads))
    summary = run_harness(Path(export_dir), Path(data_dir), list(tasks), Path(out_path), limit=limit,
                          batch_size=batch_size, device=device, precision=precision, lock_dir=Path(lock_dir))
    log.info("%s", json.dumps(summary["tasks"], indent=2))


if "snakemake" in globals():
    from pretrain_bench.logs import job_log

    with job_log(snakemake.log[0], "run_lm_eval"):  # noqa: F821
        main(snakemake.input.export, snakemake.input.data, snakemake.output[0],  # noqa: F821
             snakemake.params.tasks, snakemake.params.limit, snakemake.params.batch_size,  # noqa: F821
             snakemake.params.device, snakemake.params.precision, snakemake.params.lock_dir,  # noqa: F821
             snakemake.threads)  # noqa: F821
