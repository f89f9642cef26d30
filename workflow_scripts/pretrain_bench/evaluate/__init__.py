"""Evaluation of checkpoints: held-out loss, perplexity and bits per byte (evaluation), the HF export (export) with
its model card (model_card), lm-evaluation-harness with the shipped tasks (harness, lm_eval_tasks/), and what decides
an evaluation's result (inputs)."""
