"""Snakemake adapter for rule shard_tokens: see pretrain_bench.shards.encode_shard."""

import os
from pathlib import Path

from pretrain_bench.logs import log_startup
from pretrain_bench.shards import encode_shard


def main(corpus_jsonl: str, tokenizer_json: str, out_bin: str, out_json: str, *, split: str, shard: str,
         count: int, threads: int) -> None:
    # The tokenizer's Rust thread pool sizes itself from this on first use: stay within the job's cores.
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    log_startup("first work")
    encode_shard(Path(corpus_jsonl), Path(tokenizer_json).parent, Path(out_bin), Path(out_json), split=split,
                 index=int(shard), count=count)


if "snakemake" in globals():  # run by Snakemake's script: directive; pytest imports this file without it
    from pretrain_bench.state_lock import stage_job_log

    with stage_job_log(snakemake.log[0], "shard_tokens"):  # noqa: F821
        main(snakemake.input.corpus, snakemake.input.tokenizer, snakemake.output.bin, snakemake.output.meta,  # noqa: F821
             split=snakemake.wildcards.split, shard=snakemake.wildcards.shard,  # noqa: F821
             count=snakemake.params.shard_count, threads=snakemake.threads)  # noqa: F821
