"""Snakemake adapter for rule train_tokenizer: see pretrain_bench.data.tokenizer.train_tokenizer."""

import os
from pathlib import Path

from pretrain_bench.core.logs import log_startup
from pretrain_bench.data.tokenizer import train_tokenizer


def main(train_jsonl: str, tokenizer_json: str, *, vocab_size: int, train_bytes: int, path: str | None,
         threads: int) -> None:
    # The Rust trainer sizes its thread pool from this on first use: stay within the job's cores.
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    log_startup("first work")
    train_tokenizer(Path(train_jsonl), Path(tokenizer_json).parent, vocab_size=vocab_size, train_bytes=train_bytes,
                    path=path)


if "snakemake" in globals():  # run by Snakemake's script: directive; pytest imports this file without it
    from pretrain_bench.train.state_lock import stage_job_log

    with stage_job_log(snakemake.log[0], "train_tokenizer", list(snakemake.output)) as job:
        if not job.reused:  # else another pipeline built it while this job waited
            main(snakemake.input.train, snakemake.output.tokenizer_json, vocab_size=snakemake.params.vocab_size,
                 train_bytes=snakemake.params.train_bytes, path=snakemake.params.path, threads=snakemake.threads)
