"""Snakemake adapter: resolve the config into a run plan (rule plan_pretrain)."""
import json
import sys
from pathlib import Path


def main(config, index, tokenizer, peak, out_dir, state_dir, plan_path, manifest=None):
    from pretrain_bench.memory_fit import summary_line
    from pretrain_bench.plan import make_plan

    plan = make_plan(config, index=Path(index), tokenizer=Path(tokenizer).parent, out_dir=Path(out_dir),
                     state_dir=Path(state_dir), peak=json.loads(Path(peak).read_text()),
                     manifest=Path(manifest) if manifest else None)
    print(summary_line(plan.memory_fit), file=sys.stderr)
    plan.to_json(Path(plan_path))


if "snakemake" in globals():
    sys.stderr = open(snakemake.log[0], "w")  # noqa: F821
    main(snakemake.params.config, snakemake.input.index, snakemake.input.tokenizer,  # noqa: F821
         snakemake.input.peak, snakemake.params.out_dir, snakemake.params.state_dir,  # noqa: F821
         snakemake.output.plan, manifest=snakemake.input.manifest)  # noqa: F821
