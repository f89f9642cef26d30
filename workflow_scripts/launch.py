"""Launcher for multi-rank rules: `python workflow_scripts/launch.py --ranks {resources.gpu} --plan PLAN`.

Thin: parses arguments and hands over to pretrain_bench.launcher (see there for devices, slots and ports).
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pretrain_bench.launcher import launch  # noqa: E402
from pretrain_bench.settings import ConfigError  # noqa: E402
from pretrain_bench.devices import SlotError  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, required=True, help="ranks on this node (the job's resources.gpu)")
    parser.add_argument("--plan", type=Path, required=True, help="plan.json written by the plan rule")
    parser.add_argument("--lock-dir", type=Path, default=Path(".pretrain-bench/gpu-slots"))
    args = parser.parse_args(argv)
    plan = json.loads(args.plan.read_text())
    try:
        return launch(plan, args.plan, args.ranks, Path(__file__).resolve().parent / "pretrain.py", args.lock_dir)
    except (ConfigError, SlotError, ValueError) as error:
        print(f"error: {args.plan}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
