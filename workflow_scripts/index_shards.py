"""Snakemake adapter for rule index_shards: see pretrain_bench.shards.build_index."""

from pathlib import Path

from pretrain_bench.logs import log_startup
from pretrain_bench.shards import build_index


def main(sidecars: list[str], index_json: str) -> None:
    log_startup("first work")
    build_index([Path(path) for path in sidecars], Path(index_json))


if "snakemake" in globals():  # run by Snakemake's script: directive; pytest imports this file without it
    from pretrain_bench.state_lock import stage_job_log

    with stage_job_log(snakemake.log[0], "index_shards"):  # noqa: F821
        main(snakemake.input.meta, snakemake.output.index)  # noqa: F821
