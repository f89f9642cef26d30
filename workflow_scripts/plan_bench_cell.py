"""Snakemake adapter: the plan of one benchmark cell × repeat (rule plan_bench_cell)."""
import json
from pathlib import Path


def main(config, cell, index, tokenizer, peak, out_dir, state_dir, plan_path, data=None):
    from pretrain_bench.core.logs import log_startup
    from pretrain_bench.train.plan import make_plan

    log_startup("first work")
    plan = make_plan(config, index=Path(index), tokenizer=Path(tokenizer).parent, out_dir=Path(out_dir),
                     state_dir=Path(state_dir), role="bench", resume=False, save_checkpoints=False,
                     peak=json.loads(Path(peak).read_text()), cell=cell, data=data)
    plan.to_json(Path(plan_path))


if "snakemake" in globals():
    from pretrain_bench.core.logs import job_log
    from pretrain_bench.train.plan import PlanConfig

    with job_log(snakemake.log[0], "plan_bench_cell"):
        main(PlanConfig.from_dict(snakemake.params.config), snakemake.wildcards.cell, snakemake.input.index,
             snakemake.input.tokenizer, snakemake.input.peak, snakemake.params.out_dir,
             snakemake.params.state_dir,
             snakemake.output.plan, data=snakemake.params.data)
