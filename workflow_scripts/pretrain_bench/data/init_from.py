"""model.init_from: the local folder of the model a run continues from (a path, or an hf:// model fetched into the HF
cache). The data stage adopts its tokenizer from there, and planning and training read its shape and weights."""
from __future__ import annotations

import functools
import os
from pathlib import Path

from pretrain_bench.config.schema import ConfigError

# Files of an HF model folder the planning needs (shape and tokenizer); the weights come only when training starts.
INIT_FROM_PLANNING_FILES = ["config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                            "generation_config.json"]
INIT_FROM_WEIGHT_FILES = ["*.safetensors", "model.safetensors.index.json"]

class InitFromError(ConfigError):
    """model.init_from cannot be used; the message names the folder, file or hf:// URI."""


def parse_hf_uri(uri: str) -> tuple[str, str | None]:
    """'hf://org/name@revision' -> ('org/name', 'revision'); the revision is None when not given."""
    repo, _, revision = uri[len("hf://"):].partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise InitFromError(f"model.init_from {uri!r}: expected hf://<org>/<name> or hf://<org>/<name>@<revision>")
    return repo, revision or None


def local_path(uri: str) -> Path:
    """A local model.init_from or tokenizer.path (a path, or file://path) with `..` resolved lexically, as the user
    means it: `results/p34/../p29b/train/hf` is results/p29b/train/hf, even while results/p34 does not exist (the
    file system resolves `..` only through a folder that exists)."""
    return Path(os.path.normpath(uri.removeprefix("file://")))


def init_from_folder(uri: str, *, weights: bool = True) -> Path:
    """The local folder of model.init_from: a path as given, or an hf:// model's snapshot in the HF cache.

    hf:// goes through huggingface_hub's cache (HF_HOME), so a model fetched once is reused offline; with
    `weights=False` only the small files planning reads are fetched. Offline (HF_HUB_OFFLINE=1) or without network,
    a model not in the cache fails at once with the command that pre-downloads it.
    """
    if not uri.startswith("hf://"):
        folder = local_path(uri)
        if not (folder / "config.json").is_file():
            raise InitFromError(f"model.init_from {uri}: no config.json there (expected an HF model folder, e.g. "
                                "results/<name>/train/hf)")
        return folder
    return _hf_snapshot(uri, weights)


@functools.cache
def _hf_snapshot(uri: str, weights: bool) -> Path:
    """The HF cache folder of an hf:// model.init_from, fetched once per process: planning reads the model's shape
    once per benchmark cell, and each snapshot_download asks the hub again (a network round trip) unless offline.
    A failure is not kept: the next call tries again."""
    repo, revision = parse_hf_uri(uri)
    from huggingface_hub import snapshot_download

    patterns = INIT_FROM_PLANNING_FILES + (INIT_FROM_WEIGHT_FILES if weights else [])
    try:
        # etag_timeout: an unreachable hub fails in seconds rather than after the default waits
        return Path(snapshot_download(repo, revision=revision, allow_patterns=patterns, etag_timeout=5))
    except Exception as error:  # huggingface_hub raises many types (offline, 404, gated repo, connection errors)
        offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
        why = "offline mode is on (HF_HUB_OFFLINE) and it is not in the HF cache" if offline else "could not fetch it"
        command = f"hf download {repo}" + (f" --revision {revision}" if revision else "")
        raise InitFromError(f"model.init_from {uri}: {why}: {type(error).__name__}: {error}. Pre-download it on a "
                            f"machine with network access into the same HF cache (HF_HOME): {command}") from error
