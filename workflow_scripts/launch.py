"""Launcher for multi-rank rules: `python workflow_scripts/launch.py --ranks RANKS_PER_NODE --plan PLAN`.

Multi-node by hand (train.nodes > 1, no scheduler): run the same command on every node, adding `--node-rank K`
(0 on the node that hosts the rendezvous) and `--rdzv-endpoint HOST:PORT` unless train.rdzv_endpoint is set.
Inside a SLURM allocation the launcher starts itself on every node with srun; no extra argument is needed.

`--log FILE` (what the rules pass): every attempt writes its own file beside FILE and FILE names the newest; a run
refused because another one holds its state folder says so on the terminal and leaves the other's log alone.

Thin: parses arguments and hands over to pretrain_bench.train.launcher (see there for devices, slots and rendezvous).
"""
import argparse
import sys
from pathlib import Path

from pretrain_bench.core.devices import GPU_LOCK_DIR, SlotError
from pretrain_bench.core.logs import console_log
from pretrain_bench.data.products import DamagedProductError
from pretrain_bench.train.launcher import launch
from pretrain_bench.train.plan import Plan
from pretrain_bench.train.settings import ConfigError
from pretrain_bench.train.state_lock import StateInUse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, required=True, help="ranks on this node (train.gpus)")
    parser.add_argument("--plan", type=Path, required=True, help="plan.json written by the plan rule")
    parser.add_argument("--lock-dir", type=Path, default=GPU_LOCK_DIR)
    parser.add_argument("--node-rank", type=int, default=None,
                        help="this node's rank in a multi-node run started by hand (0 hosts the rendezvous)")
    parser.add_argument("--rdzv-endpoint", default=None,
                        help="host:port of the rendezvous on node rank 0 (default: train.rdzv_endpoint)")
    parser.add_argument("--log", type=Path, default=None,
                        help="the job's log: each attempt gets its own file in <log stem>.attempts/, "
                             "this names the newest")
    args = parser.parse_args(argv)
    console_log()
    # How srun starts this launcher again on every node of a SLURM allocation.
    relaunch = [sys.executable, str(Path(__file__).resolve()), "--ranks", str(args.ranks),
                "--plan", str(args.plan.resolve()), "--lock-dir", str(args.lock_dir.resolve())]
    try:
        plan = Plan.from_json(args.plan)
        return launch(plan, args.plan, args.ranks, Path(__file__).resolve().parent / "pretrain.py", args.lock_dir,
                      node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint, relaunch=relaunch, log=args.log)
    except (ConfigError, SlotError, ValueError, StateInUse, DamagedProductError) as error:
        print(f"error: {args.plan}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
