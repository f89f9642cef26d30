"""Snakemake adapter: evaluate one checkpoint's HF export on the val shards (rule evaluate)."""
import json
import logging
from pathlib import Path

log = logging.getLogger("pretrain_bench.evaluate_checkpoint")


def main(export_dir, index_path, out_path, *, max_tokens, batch_size, device, precision, prompts, generation,
         lock_dir, threads):
    import torch

    from pretrain_bench.evaluation import EvalSettings, GenerationSettings, evaluate_export

    torch.set_num_threads(max(1, threads))
    settings = EvalSettings(max_tokens=max_tokens, batch_size=batch_size, device=device, precision=precision,
                            prompts=tuple(prompts), generation=GenerationSettings(**generation))
    result = evaluate_export(Path(export_dir), Path(index_path), Path(out_path), settings, lock_dir=Path(lock_dir))
    log.info("%s", json.dumps(result, indent=2))


if "snakemake" in globals():
    from pretrain_bench.logs import job_log

    with job_log(snakemake.log[0], "evaluate_checkpoint"):  # noqa: F821
        params = snakemake.params  # noqa: F821
        main(snakemake.input.export, snakemake.input.index, snakemake.output[0],  # noqa: F821
             max_tokens=params.max_tokens, batch_size=params.batch_size, device=params.device,
             precision=params.precision, prompts=params.prompts, generation=params.generation,
             lock_dir=params.lock_dir, threads=snakemake.threads)  # noqa: F821
