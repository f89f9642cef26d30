"""Snakemake adapter: the plan of one benchmark cell × repeat (rule plan_bench_cell)."""
import sys
from pathlib import Path


def main(config, index, tokenizer, overrides, out_dir, state_dir, plan_path):
    from pretrain_bench.bench_matrix import BenchSettings, Cell
    from pretrain_bench.plan import make_plan, write_plan

    bench = BenchSettings.from_config(config)
    cell = Cell(**overrides)
    plan = make_plan(config, index=Path(index), tokenizer=Path(tokenizer).parent, out_dir=Path(out_dir),
                     state_dir=Path(state_dir), role="bench", train_overrides=cell.train_overrides(bench),
                     resume=False, save_checkpoints=False, export_hf=False)
    plan["cell"] = cell.name(config["train"])
    write_plan(plan, Path(plan_path))


if "snakemake" in globals():
    sys.stderr = open(snakemake.log[0], "w")  # noqa: F821
    main(snakemake.config, snakemake.input.index, snakemake.input.tokenizer, snakemake.params.overrides,  # noqa: F821
         snakemake.params.out_dir, snakemake.params.state_dir, snakemake.output.plan)  # noqa: F821
