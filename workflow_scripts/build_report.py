"""Snakemake adapter: render the report (rule report)."""
import sys
from pathlib import Path


def main(summary, metrics, evals, out_md, out_html, plot_dir, target_corpus_tokens):
    from pretrain_bench.report import build_report

    build_report(Path(summary), Path(metrics), [Path(p) for p in evals], Path(out_md), Path(out_html),
                 Path(plot_dir), target_corpus_tokens=target_corpus_tokens)
    print(f"report: {out_md} and {out_html}", file=sys.stderr)


if "snakemake" in globals():
    sys.stderr = open(snakemake.log[0], "w")  # noqa: F821
    main(snakemake.input.summary, snakemake.input.metrics, snakemake.input.evals,  # noqa: F821
         snakemake.output.md, snakemake.output.html, snakemake.output.plots,  # noqa: F821
         snakemake.params.target_corpus_tokens)  # noqa: F821
