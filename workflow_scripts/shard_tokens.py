"""Snakemake adapter for rule shard_tokens: see pretrain_bench.data.shards.encode_shard."""

import os
from pathlib import Path

from pretrain_bench.core.logs import log_startup
from pretrain_bench.data.shards import encode_shard


def main(corpus_jsonl: str, tokenizer_json: str, out_bin: str, out_json: str, *, split: str, shard: str,
         count: int, threads: int) -> None:
    # The tokenizer's Rust thread pool sizes itself from this on first use: stay within the job's cores.
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    log_startup("first work")
    encode_shard(Path(corpus_jsonl), Path(tokenizer_json).parent, Path(out_bin), Path(out_json), split=split,
                 index=int(shard), count=count)


if "snakemake" in globals():  # run by Snakemake's script: directive; pytest imports this file without it
    from pretrain_bench.train.state_lock import stage_job_log

    with stage_job_log(snakemake.log[0], "shard_tokens", list(snakemake.output)) as job:
        if not job.reused:  # else another pipeline built it while this job waited
            main(snakemake.input.corpus, snakemake.input.tokenizer, snakemake.output.bin, snakemake.output.meta,
                 split=snakemake.wildcards.split, shard=snakemake.wildcards.shard,
                 count=snakemake.params.shard_count, threads=snakemake.threads)
