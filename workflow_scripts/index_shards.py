"""Snakemake adapter for rule index_shards: see pretrain_bench.data.shards.build_index."""

from pathlib import Path

from pretrain_bench.core.logs import log_startup
from pretrain_bench.data.shards import build_index


def main(sidecars: list[str], index_json: str) -> None:
    log_startup("first work")
    build_index([Path(path) for path in sidecars], Path(index_json))


if "snakemake" in globals():  # run by Snakemake's script: directive; pytest imports this file without it
    from pretrain_bench.train.state_lock import stage_job_log

    with stage_job_log(snakemake.log[0], "index_shards", list(snakemake.output)) as job:
        if not job.reused:  # else another pipeline built it while this job waited
            main(snakemake.input.meta, snakemake.output.index)
