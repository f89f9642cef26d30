"""Snakemake adapter for rule clean_corpus_part: one slice of the sources ->
pretrain_bench.data.corpus_parts.clean_part."""
import json
from pathlib import Path

from pretrain_bench.config.schema import CorpusSettings
from pretrain_bench.core.logs import log_startup
from pretrain_bench.data.corpus_parts import clean_part
from pretrain_bench.data.products import CORPUS_EXECUTION_KEYS
from pretrain_bench.train.state_lock import stage_job_log


def main(log_path: str, folder: str, corpus: dict, cache_dir: str, *, part: int, parts: int, outputs=()) -> dict:
    """Clean part `part` of `parts` of the corpus: block's sources into folder, logging to log_path; returns its
    stats. `outputs` (its stats file last): what another pipeline building the same part leaves for this job."""
    settings = CorpusSettings.from_config(corpus).as_dict()
    cleaning = {key: value for key, value in settings.items() if key not in CORPUS_EXECUTION_KEYS}
    with stage_job_log(log_path, "clean_corpus_part", outputs) as job:
        if job.reused:
            return json.loads(Path(outputs[-1]).read_text())
        log_startup("first work")
        return clean_part(folder=Path(folder), part=part, parts=parts, cache_dir=Path(cache_dir), **cleaning)


if "snakemake" in globals():
    main(snakemake.log[0], str(Path(snakemake.output.stats).parent), snakemake.params.corpus,
         snakemake.params.cache_dir, part=int(snakemake.wildcards.part), parts=snakemake.params.parts,
         outputs=[snakemake.output.train, snakemake.output.val, snakemake.output.records, snakemake.output.stats])
