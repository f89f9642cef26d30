"""Snakemake adapter: one kept checkpoint in one process (rule evaluate) — its HF export, the export's held-out
evaluation and, when evaluate.lm_eval.tasks names any task, lm-evaluation-harness on the same loaded model."""
import json
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger("pretrain_bench.evaluate_checkpoint")

# Before anything imports huggingface_hub or datasets: they read these once, at import.
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def main(plan_path, index_path, step, export_dir, eval_path, *, settings, lock_dir, threads,
         lm_eval_data=None, lm_eval_path=None):
    """settings: rule evaluate's (export dtype, the EvalSettings fields, and evaluate.lm_eval or None)."""
    import torch

    from pretrain_bench.core.io import atomic_write_json
    from pretrain_bench.evaluate.evaluation import EvalSettings, GenerationSettings, evaluate_export, loaded_export
    from pretrain_bench.evaluate.export import export_checkpoint, staged_path
    from pretrain_bench.evaluate.inputs import STAMP, evaluation_stamp
    from pretrain_bench.train.plan import Plan

    torch.set_num_threads(max(1, threads))
    plan = Plan.from_json(Path(plan_path))
    # taken before the checkpoint is read: a checkpoint written anew meanwhile never passes for this one
    stamp = evaluation_stamp(Path(plan.paths.state_dir), int(step), settings)
    lm_eval = settings["lm_eval"]
    eval_settings = EvalSettings(**{key: settings[key] for key in ("max_tokens", "batch_size", "device", "precision")},
                                 prompts=tuple(settings["prompts"]),
                                 generation=GenerationSettings(**settings["generation"]))
    # Every output is written under its staged name and moved into place in the last moments of the job: an
    # interrupted job (Ctrl-C) leaves none of them, so Snakemake, which keeps a stopped job's outputs marked
    # incomplete, runs it again on the plain rerun instead of refusing with IncompleteFilesException.
    export_dir, eval_path = Path(export_dir), Path(eval_path)
    staged = {export_dir: staged_path(export_dir), eval_path: staged_path(eval_path)}
    if lm_eval:
        staged[Path(lm_eval_path)] = staged_path(Path(lm_eval_path))
    info = export_checkpoint(plan, int(step), export_dir, dtype=settings["dtype"], publish=False)
    log.info("exported %s: %s", export_dir, json.dumps(info))
    with loaded_export(staged[export_dir], eval_settings.device, eval_settings.precision, Path(lock_dir)) as loaded:
        result = evaluate_export(staged[export_dir], Path(index_path), staged[eval_path], eval_settings,
                                 loaded=loaded, export_name=export_dir)
        # what decided this result, for the next run to compare (pretrain_bench/evaluate/inputs.py)
        atomic_write_json(staged[eval_path], {**result, STAMP: stamp})
        log.info("held-out: loss %.4f, perplexity %.2f, bits per byte %s", result["loss"], result["perplexity"],
                 result["bits_per_byte"])
        if lm_eval:
            from pretrain_bench.evaluate.harness import run_harness

            summary = run_harness(loaded, Path(lm_eval_data), list(lm_eval["tasks"]), staged[Path(lm_eval_path)],
                                  limit=lm_eval["limit"], batch_size=lm_eval["batch_size"])
            log.info("lm-eval: %s", json.dumps(summary["tasks"], indent=2))
    shutil.rmtree(export_dir, ignore_errors=True)
    for final, path in staged.items():
        os.replace(path, final)


if "snakemake" in globals():
    from pretrain_bench.core.logs import exit_without_teardown, job_log
    from pretrain_bench.train.launcher import skip_unchosen_trackers

    skip_unchosen_trackers(())  # this job logs to no tracker; DeepSpeed's checkpoint reader would import mlflow

    with job_log(snakemake.log[0], "evaluate_checkpoint"):
        params, inputs, outputs = snakemake.params, snakemake.input, snakemake.output
        main(inputs.plan, inputs.index, params.step, outputs.export, outputs.eval, settings=params.settings,
             lock_dir=params.lock_dir, threads=snakemake.threads,
             lm_eval_data=inputs.get("lm_eval_data"), lm_eval_path=outputs.get("lm_eval"))
    exit_without_teardown(0)  # every output is written (atomically): skip the seconds of teardown
