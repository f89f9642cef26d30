"""The shipped lm-eval tasks' folder, and lm-eval's own command line for it.

Rule lm_eval_data writes results/<name>/lm_eval/data/: the shipped task files (lm_eval_tasks/: the YAML definitions
and local_data.py, which reads the data beside it) and their data built from the run's val split
(harness.build_task_data). That folder is lm-eval's --include_path, for the pipeline (harness.task_manager) and for
a user's `lm_eval` command (`lm_eval_command`: what the model card and docs/lm-eval.md print).
"""
from __future__ import annotations

import shlex
from pathlib import Path

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
# What the folder holds besides its data: the task definitions and the module their datasets come from.
TASK_FILES = tuple(sorted(path for path in TASKS_DIR.iterdir() if path.suffix in (".yaml", ".py")))
SHIPPED_TASKS = ("pretrain_bench_last_word", "pretrain_bench_doc_perplexity")


def task_folder(name: str) -> str:
    """The folder rule lm_eval_data writes for run `name`, relative to the working directory."""
    return f"results/{name}/lm_eval/data"


def lm_eval_command(export: str, include_path: str, seq_len: int, task: str = SHIPPED_TASKS[0]) -> str:
    """lm-eval's own command line for one shipped task on an export, as the pipeline runs it (the `hf` model, at the
    trained sequence length)."""
    return (f"lm_eval --model hf --model_args {shlex.quote(f'pretrained={export},max_length={seq_len}')} "
            f"--include_path {shlex.quote(include_path)} --tasks {task}")
