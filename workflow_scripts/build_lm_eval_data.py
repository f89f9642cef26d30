"""Snakemake adapter: the shipped lm-eval tasks' data files from the val split (rule lm_eval_data)."""
import json
import sys
from pathlib import Path


def main(val_path, out_dir):
    from pretrain_bench.harness import build_task_data

    counts = build_task_data(Path(val_path), Path(out_dir))
    print(json.dumps(counts, indent=2), file=sys.stderr)


if "snakemake" in globals():
    sys.stderr = open(snakemake.log[0], "w")  # noqa: F821
    main(snakemake.input.val, snakemake.output[0])  # noqa: F821
