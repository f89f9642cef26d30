"""Snakemake adapter for rule download_corpus: the corpus: block -> pretrain_bench.corpus.build_corpus.

The pretrain_bench library is installed into the environment (make install).
"""
from pathlib import Path

from pretrain_bench.config_types import CorpusSettings
from pretrain_bench.corpus import build_corpus
from pretrain_bench.state_lock import stage_job_log


def main(log_path: str, out_dir: str, corpus: dict, cache_dir: str) -> dict:
    """Build the corpus the corpus: block describes into out_dir, logging (stderr included) to log_path; returns the
    manifest. Refused, naming the holder, while another pipeline builds the same corpus (state_lock.stage_job_log)."""
    settings = CorpusSettings.from_config(corpus)
    with stage_job_log(log_path, "download_corpus"):
        return build_corpus(out_dir=Path(out_dir), cache_dir=Path(cache_dir), **settings.as_dict())


if "snakemake" in globals():
    main(snakemake.log[0], str(Path(snakemake.output.manifest).parent), snakemake.params.corpus,  # noqa: F821
         snakemake.params.cache_dir)  # noqa: F821
