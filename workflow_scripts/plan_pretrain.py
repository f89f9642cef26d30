"""Snakemake adapter: resolve the config into a run plan (rule plan_pretrain)."""
import json
import logging
from pathlib import Path

log = logging.getLogger("pretrain_bench.plan_pretrain")


def main(config, index, tokenizer, peak, out_dir, state_dir, plan_path, manifest=None, data=None):
    from pretrain_bench.core.logs import log_startup
    from pretrain_bench.train.memory.fit import summary_line
    from pretrain_bench.train.plan import make_plan

    log_startup("first work")
    plan = make_plan(config, index=Path(index), tokenizer=Path(tokenizer).parent, out_dir=Path(out_dir),
                     state_dir=Path(state_dir), peak=json.loads(Path(peak).read_text()),
                     manifest=Path(manifest) if manifest else None, data=data)
    log.info("%s", summary_line(plan.memory_fit))
    plan.to_json(Path(plan_path))


if "snakemake" in globals():
    from pretrain_bench.core.logs import job_log
    from pretrain_bench.train.plan import PlanConfig

    with job_log(snakemake.log[0], "plan_pretrain"):
        main(PlanConfig.from_dict(snakemake.params.config), snakemake.input.index, snakemake.input.tokenizer,
             snakemake.input.peak, snakemake.params.out_dir, snakemake.params.state_dir,
             snakemake.output.plan, manifest=snakemake.input.manifest, data=snakemake.params.data)
