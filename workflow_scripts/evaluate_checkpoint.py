"""Snakemake adapter: evaluate one checkpoint (rule evaluate)."""
import json
import sys
from pathlib import Path


def main(plan_path, step, out_path, max_tokens, batch_size, threads):
    import torch

    from pretrain_bench.evaluation import evaluate_checkpoint

    torch.set_num_threads(max(1, threads))
    plan = json.loads(Path(plan_path).read_text())
    result = evaluate_checkpoint(plan, int(step), Path(out_path), max_tokens=max_tokens, batch_size=batch_size)
    print(json.dumps(result, indent=2), file=sys.stderr)


if "snakemake" in globals():
    sys.stderr = open(snakemake.log[0], "w")  # noqa: F821
    main(snakemake.input.plan, snakemake.wildcards.step, snakemake.output[0],  # noqa: F821
         snakemake.params.max_tokens, snakemake.params.batch_size, snakemake.threads)  # noqa: F821
