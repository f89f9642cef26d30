"""What `snakemake -n` (and every run) prints before any job starts: what train.memory_fit chooses for the main run,
or why plan_pretrain will stop; what the run and the benchmark matrix are predicted to cost; every cell's fate; and an
earlier benchmark's fastest measured setup on this hardware and model."""
from __future__ import annotations

from pathlib import Path

from pretrain_bench.bench.matrix import cells_text, cost_preview, planning_peak, preview_text
from pretrain_bench.config.schema import ConfigError
from pretrain_bench.report.recommendation import previous_recommendation_text
from pretrain_bench.train.memory.fit import fit_run, summary_line
from pretrain_bench.workflow.pipeline import Pipeline


def preflight(pipeline: Pipeline, info, warning):
    """Log the pre-flight through `info` and `warning` (Snakemake's logger); returns the main run's train settings
    after train.memory_fit (the asked ones when nothing fits: plan_pretrain then stops with the reason)."""
    s, name = pipeline.settings, pipeline.name
    try:
        main_train, record = fit_run(pipeline.main_plan_config, s.train, pipeline.vocab_size,
                                     what="the main run (rule pretrain)",
                                     nvme_path=s.train.nvme_path or f"results/{name}/state/nvme",
                                     state_dir=f"results/{name}/state")
        info(summary_line(record))
    except ConfigError as error:
        warning(f"{error}\n(rule plan_pretrain will stop here, before training allocates anything)")
        main_train = s.train
    matrix = pipeline.matrix
    info(preview_text(cost_preview(matrix, main_train, s.model, pipeline.vocab_size,
                                   *planning_peak(s.report, s.benchmark, matrix["device"], name))))
    info(cells_text(matrix))
    earlier = previous_recommendation_text(Path("results"), matrix["device"], s.model, pipeline.vocab_size)
    if earlier:
        info(earlier)
    return main_train
