"""Snakemake adapter for rule download_corpus: the corpus: block -> pretrain_bench.data.corpus.build_corpus, or, when
the cleaning ran as part jobs, pretrain_bench.data.corpus_parts.merge_parts.

The pretrain_bench library is installed into the environment (make install).
"""
import json
from pathlib import Path

from pretrain_bench.config.schema import CorpusSettings
from pretrain_bench.core.logs import log_startup
from pretrain_bench.data.corpus import build_corpus
from pretrain_bench.data.corpus_parts import merge_parts
from pretrain_bench.data.products import CORPUS_EXECUTION_KEYS
from pretrain_bench.train.state_lock import stage_job_log


def main(log_path: str, out_dir: str, corpus: dict, cache_dir: str, parts: int = 1, part_folder: str | None = None
         ) -> dict:
    """Build the corpus the corpus: block describes into out_dir (from `parts` part jobs' files in part_folder when
    more than one), logging (stderr included) to log_path; returns the manifest. While another pipeline builds the
    same corpus this waits for it and then uses its corpus (state_lock.stage_job_log)."""
    settings = CorpusSettings.from_config(corpus).as_dict()
    cleaning = {key: value for key, value in settings.items() if key not in CORPUS_EXECUTION_KEYS}
    outputs = [f"{out_dir}/{name}" for name in ("train.jsonl", "val.jsonl", "manifest.json")]
    with stage_job_log(log_path, "download_corpus", outputs) as job:
        if job.reused:
            return json.loads(Path(outputs[-1]).read_text())
        log_startup("first work")
        if parts > 1:
            return merge_parts(folder=Path(part_folder), out_dir=Path(out_dir), parts=parts, **cleaning)
        return build_corpus(out_dir=Path(out_dir), cache_dir=Path(cache_dir), **cleaning)


if "snakemake" in globals():
    main(snakemake.log[0], str(Path(snakemake.output.manifest).parent), snakemake.params.corpus,
         snakemake.params.cache_dir, snakemake.params.parts,
         str(Path(snakemake.input.parts[0]).parent) if snakemake.input.parts else None)
