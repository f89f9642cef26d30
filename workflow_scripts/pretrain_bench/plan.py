"""A run plan: everything one training run needs, resolved from the config into one JSON file.

The plan is the pretrain rule's input (so Snakemake reruns training when a setting that matters changes) and the
only thing the launcher and the ranks read: no rank parses config.yaml.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .memory_model import check_fits
from .settings import TrainSettings, check_settings


def make_plan(config: dict, *, index: Path, tokenizer: Path, out_dir: Path, state_dir: Path,
              role: str = "pretrain", train_overrides: dict | None = None, resume: bool = True,
              save_checkpoints: bool = True, export_hf: bool = True) -> dict:
    """Resolve config (+ per-run overrides, e.g. a benchmark cell's) into a plan dict; raises ConfigError."""
    train = {**config["train"], **(train_overrides or {})}
    if train_overrides and "global_batch_size" not in train_overrides:
        train["global_batch_size"] = None  # a cell with other ranks derives its own global batch
    settings = TrainSettings.from_config(train)
    check_settings(settings, seq_len=config["model"].get("seq_len", 128))
    # Pre-flight: stop before anything is allocated when the run is predicted not to fit (benchmark.force skips).
    index_vocab = json.loads(Path(index).read_text()).get("vocab_size")
    preflight = check_fits(config, settings, index_vocab, what=f"the {role} run")
    return {
        "name": config["name"],
        "role": role,
        "config": config,
        "device_request": settings.device,
        "train": settings.as_dict(),
        "model": {"preset": config["model"]["preset"], "seq_len": config["model"].get("seq_len", 128),
                  "overrides": config["model"].get("overrides") or {}},
        "data_sha256": hashlib.sha256(Path(index).read_bytes()).hexdigest(),
        "paths": {"index": str(index), "tokenizer": str(tokenizer), "out_dir": str(out_dir),
                  "state_dir": str(state_dir)},
        "resume": resume,
        "save_checkpoints": save_checkpoints,
        "export_hf": export_hf,
        "peak_tflops": (config.get("report") or {}).get("peak_tflops"),
        "preflight": preflight,
    }


def write_plan(plan: dict, path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(plan, indent=2, sort_keys=True))
    os.replace(tmp, path)
