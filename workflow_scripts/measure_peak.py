"""Snakemake adapter: measure this machine's peak FLOP/s once (rule measure_peak)."""
import json
import sys
from pathlib import Path


def main(device, precision, lock_dir, out_path):
    from pretrain_bench.peak import measure_hardware_peak

    result = measure_hardware_peak(device, precision, Path(lock_dir))
    Path(out_path).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2), file=sys.stderr)


if "snakemake" in globals():
    sys.stderr = open(snakemake.log[0], "w")  # noqa: F821
    main(snakemake.params.device, snakemake.params.precision, snakemake.params.lock_dir,  # noqa: F821
         snakemake.output.peak)  # noqa: F821
