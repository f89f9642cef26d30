"""Snakemake adapter: render the report (rule report)."""
import logging
from pathlib import Path

log = logging.getLogger("pretrain_bench.build_report")


def main(summary, metrics, evals, matrix, bench, out_md, out_html, plot_dir, target_corpus_tokens, lm_eval=(),
         peak=None, gpu_hour_price=None, configfiles=()):
    from pretrain_bench.core.logs import log_startup
    from pretrain_bench.report.render import build_report

    log_startup("first work")
    build_report(Path(summary), Path(metrics), [Path(p) for p in evals], Path(out_md), Path(out_html),
                 Path(plot_dir), target_corpus_tokens=target_corpus_tokens, matrix_path=_single(matrix),
                 bench_paths=[Path(p) for p in bench], lm_eval_paths=[Path(p) for p in lm_eval],
                 peak_path=Path(peak) if peak else None, gpu_hour_price=gpu_hour_price,
                 configfiles=list(configfiles))
    log.info("%s", f"report: {out_md} and {out_html}")


def _single(paths) -> Path | None:
    """The one path of an optional input (bench/matrix.json, absent when benchmark.enabled is false)."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    return Path(paths[0]) if paths else None


if "snakemake" in globals():
    from pretrain_bench.core.logs import job_log

    with job_log(snakemake.log[0], "build_report"):
        main(snakemake.input.summary, snakemake.input.metrics, snakemake.input.evals,
             snakemake.input.matrix, snakemake.input.bench, snakemake.output.md,
             snakemake.output.html, snakemake.output.plots, snakemake.params.target_corpus_tokens,
             snakemake.input.lm_eval, snakemake.input.peak, snakemake.params.gpu_hour_price,
             snakemake.params.configfiles)
