"""Where a result came from: code version, config digest, package versions, hardware."""
from __future__ import annotations

import hashlib
import json
import subprocess
from importlib import metadata
from pathlib import Path

PACKAGES = ("torch", "deepspeed", "transformers", "tokenizers", "numpy", "snakemake")


def config_sha256(config: dict) -> str:
    """Digest of a config as canonical JSON (key order and formatting do not matter)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def git_commit(path: Path | str = ".") -> str | None:
    """HEAD commit of the checkout holding `path` (suffix '-dirty' when tracked files changed), or None."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=path,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if dirty else "")


def package_versions() -> dict[str, str | None]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def provenance(config: dict, hardware: dict, code_dir: Path | str = ".") -> dict:
    return {"git_commit": git_commit(code_dir), "config_sha256": config_sha256(config),
            "versions": package_versions(), "hardware": hardware}
