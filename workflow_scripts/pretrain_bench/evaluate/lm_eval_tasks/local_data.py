"""Datasets of the shipped lm-eval tasks, read from the JSON-lines files beside this module.

Rule lm_eval_data writes one folder (results/<name>/lm_eval/data/) holding the task YAML files, this module and the
data they read, so that the folder is all lm-eval needs: `lm_eval --include_path <that folder> --tasks
pretrain_bench_last_word` finds the tasks, and lm-eval imports this module from the folder it found them in
(`!function local_data.last_word`), whose files it then reads. No path is written in a YAML file, and no
`--metadata` is needed.
"""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _read(name):
    import datasets

    path = HERE / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: rule lm_eval_data writes it beside the task files "
                                "(snakemake ... -- results/<name>/lm_eval/data)")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def last_word(**metadata):
    """lm-eval passes the task's metadata (its version) as keyword arguments: nothing here needs it."""
    return _read("last_word.jsonl")


def documents(**metadata):
    return _read("documents.jsonl")
