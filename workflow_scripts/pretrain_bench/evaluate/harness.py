"""lm-evaluation-harness on a checkpoint's HF export: offline, with task definitions this project ships.

The shipped tasks (lm_eval_tasks/*.yaml) read JSON-lines files built from the run's own val split, so they need
no download and measure the run on text it never trained on. Rule lm_eval_data writes them into one folder with the
task files (`build_task_data`): that folder is lm-eval's --include_path, for the pipeline and for lm-eval's own
command line alike (pretrain_bench.evaluate.task_folder, docs/lm-eval.md):
- `pretrain_bench_last_word`: LAMBADA-style last-word prediction. Each val document gives one passage: its start,
  cut after the last whole word (`[A-Za-z_][A-Za-z0-9_]+` after a space) that ends within `LAST_WORD_CHARS`
  characters; the context is the passage without that word, the target " word".
- `pretrain_bench_doc_perplexity`: rolling log-likelihood of every val document (word/byte perplexity, bits per
  byte as lm-eval defines them).
Other lm-eval task names are looked up among lm-eval's own tasks; offline, their datasets must already be in the
local HF datasets cache.

lm-eval runs its `hf` model type (HFLM) on the export, the same loaded model the held-out evaluation used, with
`max_length` = the trained seq_len: the LLaMA config allows 2048 positions, but the model never saw more than
seq_len, and lm-eval would otherwise fill 2048.

lm_eval/step<N>.json: step, train_tokens, checkpoint, export; tasks {task: {metric: value, metric_stderr: value}}
(lm-eval's "acc,none" keys without the ",none" filter suffix); samples {task: examples evaluated}; limit,
max_length, batch_size, device, precision, bootstrap_iters, eval_time_s, lm_eval_version, task_versions; and
lm_eval_results, lm-eval's own results dict unchanged.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

from pretrain_bench.core.io import atomic_write_json
from pretrain_bench.data.tokenizer import iter_texts
from pretrain_bench.evaluate.task_folder import SHIPPED_TASKS, TASK_FILES

LAST_WORD_CHARS = 400  # passage length cap; about seq_len 128 tokens of code or prose
MIN_CONTEXT_CHARS = 32
_WORD = re.compile(r"(?<= )[A-Za-z_][A-Za-z0-9_]+\b")


def last_word_example(text: str, max_chars: int = LAST_WORD_CHARS, min_context: int = MIN_CONTEXT_CHARS) -> dict | None:
    """{"context", "target"} with context + target a prefix of text and target " <last whole word>", or None."""
    last = None
    for match in _WORD.finditer(text):
        if match.end() > max_chars:
            break
        if match.start() - 1 >= min_context:
            last = match
    if last is None:
        return None
    return {"context": text[:last.start() - 1], "target": " " + last.group()}


def build_task_data(val_jsonl: Path, out_dir: Path) -> dict:
    """Write last_word.jsonl and documents.jsonl (val documents in corpus order) into out_dir, beside a copy of the
    shipped task files (TASK_FILES), so that out_dir is an lm-eval --include_path of its own; returns counts."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in TASK_FILES:
        shutil.copyfile(path, out_dir / path.name)
    documents, examples = 0, 0
    with open(out_dir / "documents.jsonl", "w", encoding="utf-8") as docs, \
            open(out_dir / "last_word.jsonl", "w", encoding="utf-8") as words:
        for text in iter_texts(Path(val_jsonl)):
            docs.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            documents += 1
            example = last_word_example(text)
            if example:
                words.write(json.dumps(example, ensure_ascii=False) + "\n")
                examples += 1
    if not examples:
        raise ValueError(f"{val_jsonl}: no val document has a word after {MIN_CONTEXT_CHARS} characters within its "
                         f"first {LAST_WORD_CHARS}: pretrain_bench_last_word has no examples")
    counts = {"documents": documents, "last_word_examples": examples, "source": str(val_jsonl)}
    (out_dir / "counts.json").write_text(json.dumps(counts, indent=2))
    return counts


def task_manager(tasks: list[str], data_dir: Path):
    """An lm-eval TaskManager that knows the shipped tasks, from the folder rule lm_eval_data wrote (`data_dir`, as
    lm-eval's --include_path would), and lm-eval's own only when a task needs them."""
    from lm_eval.tasks import TaskManager

    # lm-eval's own index takes seconds to build: only when a task is not one of ours (by its prefix).
    builtin = [task for task in tasks if not task.startswith("pretrain_bench_")]
    manager = TaskManager(include_path=str(Path(data_dir).resolve()), include_defaults=bool(builtin))
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        raise ValueError(f"evaluate.lm_eval.tasks: unknown task(s) {unknown}; this project ships {list(SHIPPED_TASKS)}"
                         " and lm-eval knows its own (lm_eval ls tasks)")
    return manager


def _metrics(task_results: dict) -> dict:
    """lm-eval's {"acc,none": x, "acc_stderr,none": s, "alias": ...} → {"acc": x, "acc_stderr": s}."""
    out = {}
    for key, value in task_results.items():
        if key == "alias":
            continue
        name, _, filter_name = key.partition(",")
        out[name if filter_name in ("", "none") else key] = None if value == "N/A" else value
    return out


def run_harness(loaded, data_dir: Path, tasks: list[str], out_path: Path, *, limit: int | None,
                batch_size: int, bootstrap_iters: int = 1000) -> dict:
    """Run lm-eval's `hf` model (HFLM) on one export, offline, already loaded (evaluation.loaded_export, which holds
    its device slot); writes lm_eval/step<N>.json atomically and returns it."""
    # Offline for good: set before lm-eval imports datasets / huggingface_hub (the rule script sets them earlier).
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    from importlib.metadata import version

    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from pretrain_bench.evaluate.export import read_export_info

    if not tasks:
        raise ValueError("evaluate.lm_eval.tasks is empty: nothing to run")
    export_dir = loaded.folder
    info = read_export_info(export_dir)
    manager = task_manager(list(tasks), data_dir)
    # the model instance the held-out evaluation used: lm-eval takes its device and dtype as they are
    model = HFLM(pretrained=loaded.model, tokenizer=loaded.tokenizer, max_length=info["seq_len"],
                 batch_size=batch_size, device=loaded.device)
    start = time.perf_counter()
    results = lm_eval.simple_evaluate(model=model, tasks=list(tasks), limit=limit, task_manager=manager,
                                      log_samples=False, bootstrap_iters=bootstrap_iters)
    elapsed = time.perf_counter() - start
    summary = {
        "step": info["step"], "train_tokens": info["train_tokens"], "checkpoint": info["checkpoint"],
        "export": str(export_dir),
        "tasks": {task: _metrics(values) for task, values in results["results"].items()},
        "samples": {task: counts["effective"] for task, counts in results["n-samples"].items()},
        "limit": limit, "max_length": info["seq_len"], "batch_size": batch_size, "device": loaded.device,
        "precision": loaded.precision, "precision_note": loaded.precision_note, "bootstrap_iters": bootstrap_iters,
        "eval_time_s": elapsed,
        "lm_eval_version": version("lm_eval"), "task_versions": results["versions"],
        "lm_eval_results": results["results"],
    }
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_path, summary, default=str)
    return summary
