"""Datasets of the shipped lm-eval tasks, read from the JSON-lines files rule lm_eval_data wrote.

lm-eval calls these with the task metadata as keyword arguments; `data_dir` is passed in through
`TaskManager(metadata=...)` by pretrain_bench.evaluate.harness, so the YAML files name no path.
"""
import json
from pathlib import Path


def _read(data_dir, name):
    import datasets

    if data_dir is None:
        raise ValueError(f"{name}: no data_dir in the task metadata (run the task through "
                         "pretrain_bench.evaluate.harness)")
    path = Path(data_dir) / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (built by rule lm_eval_data)")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def last_word(data_dir=None, **metadata):
    return _read(data_dir, "last_word.jsonl")


def documents(data_dir=None, **metadata):
    return _read(data_dir, "documents.jsonl")
