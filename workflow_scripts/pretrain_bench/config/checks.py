"""Config checks the schema cannot express that need no model code: whether the chosen attention kernel can run,
and whether the chosen trackers' packages are installed. Pure Python (no torch import), so `snakemake -n` runs them."""
from __future__ import annotations

import importlib.util

from pretrain_bench.config.schema import ConfigError

FLASH_ATTENTION = "flash_attention_2"
FLASH_INSTALL_HINT = "pip install flash-attn --no-build-isolation (needs CUDA and a CUDA toolkit)"


# The attention kernels model.implementation native runs; flash_attention_2 needs transformers' class.
NATIVE_KERNELS = ("sdpa", "eager")


def check_native_kernel(attn_implementation: str | None) -> None:
    """Refuse an attention kernel the native model class does not run, naming both keys."""
    if attn_implementation not in (None, *NATIVE_KERNELS):
        raise ConfigError(f"model.attn_implementation {attn_implementation} runs only with model.implementation "
                          f"transformers; model.implementation native runs {' or '.join(NATIVE_KERNELS)}")


def check_attention(attn_implementation: str, precision: str, implementation: str = "transformers") -> None:
    """Refuse model.attn_implementation flash_attention_2 where it cannot run: with model.implementation native
    (which runs sdpa or eager), without the flash_attn package (checked when the workflow is planned, so
    `snakemake -n` shows it) or in fp32, which its kernels do not take."""
    import importlib.util

    if attn_implementation != FLASH_ATTENTION:
        return
    if implementation == "native":
        check_native_kernel(attn_implementation)
    if importlib.util.find_spec("flash_attn") is None:
        raise ConfigError(f"model.attn_implementation {FLASH_ATTENTION} needs the flash_attn package, which is not "
                          f"installed in this environment: {FLASH_INSTALL_HINT}; or set model.attn_implementation: "
                          "sdpa")
    if precision == "fp32":
        raise ConfigError(f"model.attn_implementation {FLASH_ATTENTION} runs in bf16 or fp16, not train.precision "
                          "fp32: set train.precision: bf16, or model.attn_implementation: sdpa")



# The packages of the optional trackers and how to install them (pinned as in requirements.txt).
OPTIONAL_PACKAGES = {"wandb": ("wandb", "wandb==0.31.0"), "mlflow": ("mlflow", "mlflow-skinny==3.17.2")}


def missing_trackers(loggers) -> list[str]:
    """'train.loggers <name> needs ... : pip install ...' for each chosen tracker whose package is not installed."""
    missing = []
    for name in loggers:
        if name in OPTIONAL_PACKAGES and importlib.util.find_spec(OPTIONAL_PACKAGES[name][0]) is None:
            module, pin = OPTIONAL_PACKAGES[name]
            missing.append(f"train.loggers {name} needs the {module} package, which is not installed: "
                           f"pip install '{pin}' (or pip install -e '.[trackers]')")
    return missing


# The oldest torch the pipeline runs on (torch 2.11 with CUDA 13.0 ran the GPU smoke once torchrun's newer options and
# all_gather_single were detected), and the version requirements.txt pins, which the test suite runs on.
OLDEST_TORCH = (2, 11)
PINNED_TORCH = "2.13.0"


def check_torch_version(installed: str | None = None) -> None:
    """Refuse a torch older than OLDEST_TORCH in one line naming the version to install. `installed`: a version
    string (a test's), by default the installed distribution's, read without importing torch."""
    from importlib import metadata

    if installed is None:
        try:
            installed = metadata.version("torch")
        except metadata.PackageNotFoundError:
            raise ConfigError(f"torch is not installed: pip install torch=={PINNED_TORCH} (or make install)") from None
    release = tuple(int(part) for part in installed.split("+")[0].split(".")[:2] if part.isdigit())
    if release < OLDEST_TORCH:
        oldest = ".".join(map(str, OLDEST_TORCH))
        raise ConfigError(f"torch {installed} is older than {oldest}, the oldest this pipeline runs on: "
                          f"pip install torch=={PINNED_TORCH} (the version requirements.txt pins)")


def main() -> int:
    """`python -m pretrain_bench.config.checks`: the torch check alone, as `make install` runs it after installing
    (a venv that kept an older torch, or a pip that resolved another): one line and exit 1, no traceback."""
    import sys

    try:
        check_torch_version()
    except ConfigError as error:
        print(f"pretrain-bench: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
