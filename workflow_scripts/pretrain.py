"""One training rank, started by torchrun through launch.py: `pretrain.py --plan PLAN`."""
import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> int:
    from pretrain_bench.checkpoint import CheckpointError
    from pretrain_bench.devices import hardware_description
    from pretrain_bench.train import TrainingAborted, run_training

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--plan", type=Path, required=True)
    args = parser.parse_args(argv)
    plan = json.loads(args.plan.read_text())
    plan["device"] = os.environ.get("PRETRAIN_BENCH_DEVICE", "cpu")
    if plan["device"] == "cuda":
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    plan["hardware"] = hardware_description(plan["device"])
    try:
        run_training(plan)
    except (TrainingAborted, CheckpointError) as error:
        print(f"error (rank {os.environ.get('RANK')}): {error}", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
