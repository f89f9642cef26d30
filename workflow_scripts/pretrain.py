"""One training rank, started by torchrun through launch.py: `pretrain.py --plan PLAN --context JSON`, the context
being the launcher's decisions for the job's ranks (pretrain_bench.train.run_context.LaunchContext). On CPU torchrun
forks the rank from its agent and calls `main` there (pretrain_bench.train.forked_ranks); otherwise it runs this
script."""
import argparse
import os
import sys
from pathlib import Path

from pretrain_bench.core.devices import die_with_parent, hardware_description
from pretrain_bench.core.logs import console_log, exit_without_teardown
from pretrain_bench.train.run_context import LaunchContext, pin_rank, usable_cpus


def main(argv=None) -> int:
    # SIGKILL this rank when its torchrun agent dies: torchrun starts ranks in sessions of their own, so a hard kill
    # of the job would otherwise leave them training (and writing checkpoints) as orphans.
    die_with_parent()
    console_log()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--plan", type=Path, required=True)
    parser.add_argument("--context", type=LaunchContext.from_json, default=None,
                        help="the launcher's LaunchContext, as JSON (started by torchrun without the launcher: CPU, "
                             "this node's usable cores shared by its LOCAL_WORLD_SIZE ranks)")
    args = parser.parse_args(argv)
    cpus = usable_cpus()
    launch = args.context or LaunchContext.for_job("cpu", int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                                                   len(cpus), cpus)
    # Pinned before torch starts any thread (a rank forked from torchrun's agent has torch imported, but no thread of
    # it running: pretrain_bench.train.forked_ranks): threads started later (OpenMP's, gloo's) inherit this rank's
    # cores.
    pin_rank(launch, int(os.environ.get("LOCAL_RANK", 0)))

    from pretrain_bench.train.launcher import skip_unchosen_trackers, wait_out_stale_build_locks
    from pretrain_bench.train.plan import Plan, RunContext

    plan = Plan.from_json(args.plan)
    skip_unchosen_trackers(plan.train.loggers)  # before anything imports DeepSpeed

    from pretrain_bench.train.checkpoints.files import CheckpointError
    from pretrain_bench.train.rank import TrainingAborted
    from pretrain_bench.train.trainer import run_training

    wait_out_stale_build_locks()  # DeepSpeed loads its CPU op behind torch's build lock in every rank
    device = launch.device  # what the launcher resolved device_request to
    if device == "cuda":
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    try:
        run_training(plan, RunContext(device=device, hardware=hardware_description(device)), launch)
    except (TrainingAborted, CheckpointError) as error:
        print(f"error (rank {os.environ.get('RANK')}): {error}", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())  # the run's files are written and closed: skip the seconds of teardown
