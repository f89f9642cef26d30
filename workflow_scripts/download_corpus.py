"""Snakemake adapter for rule download_corpus: corpus.* config -> pretrain_bench.corpus.build_corpus.

The pretrain_bench library is installed into the environment (make install).
"""
from pathlib import Path

from pretrain_bench.corpus import build_corpus
from pretrain_bench.state_lock import stage_job_log


def main(log_path: str, out_dir: str, sources: list[dict], *, max_bytes, min_chars: int, dedup: bool,
         val_fraction: float, encoding_errors: str, cache_dir: str, seed: int = 1234) -> dict:
    """Build the corpus into out_dir, logging (stderr included) to log_path; returns the manifest. Refused, naming
    the holder, while another pipeline builds the same corpus (state_lock.stage_job_log)."""
    with stage_job_log(log_path, "download_corpus"):
        return build_corpus(sources, Path(out_dir), max_bytes=max_bytes, min_chars=min_chars, dedup=dedup,
                            val_fraction=val_fraction, encoding_errors=encoding_errors, cache_dir=Path(cache_dir),
                            seed=seed)


if "snakemake" in globals():
    main(snakemake.log[0], str(Path(snakemake.output.manifest).parent), snakemake.params.sources,  # noqa: F821
         max_bytes=snakemake.params.max_bytes, min_chars=snakemake.params.min_chars,  # noqa: F821
         dedup=snakemake.params.dedup, val_fraction=snakemake.params.val_fraction,  # noqa: F821
         encoding_errors=snakemake.params.encoding_errors, cache_dir=snakemake.params.cache_dir,  # noqa: F821
         seed=snakemake.params.seed)  # noqa: F821
