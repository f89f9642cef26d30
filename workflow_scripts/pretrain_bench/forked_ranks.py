"""torchrun whose ranks are forked from it after it has imported what they import (train.rank_start fork).

`python -m pretrain_bench.forked_ranks <torchrun's options> pretrain.py --plan PLAN --context JSON` is torchrun
(`torch.distributed.run`: its options, rendezvous, restarts, the signals it passes on and its shutdown timeout are
torch's own, parsed and run by torch's code) with one difference: a rank is not a fresh interpreter running the script
but a fork of this agent running the script's `main`, so torch, DeepSpeed and this package are imported once per
launch instead of once per rank. That import is most of a CPU rank's start-up (README, "Process start-up"). torchrun
itself has no such option: it forks only a Python function, which the script's `main` is made into here (torch's
`elastic_launch` with `start_method="fork"`).

Only for CPU ranks. On CUDA, DeepSpeed's accelerator probe at import initialises the CUDA driver, and CUDA cannot be
used in a process forked from one that has (the launcher starts `torch.distributed.run` there instead).

Each forked rank is what torchrun's own start makes of it: a session of its own (a terminal's Ctrl-C reaches the
launcher, which stops the ranks through torchrun, never the ranks directly), its rendezvous environment, and the
script's exit status as the process's (a traceback printed to its stderr when it raises).
"""
from __future__ import annotations

import os
import runpy
import signal
import traceback
import uuid
from pathlib import Path

from .logs import exit_without_teardown, finish_process


def preload(script: Path, rank_argv: list[str]):
    """Import what a rank of this plan imports (as the script would, the unchosen trackers made unimportable first:
    launcher.skip_unchosen_trackers; then the trainer, its engine's libraries (Engine.preload) and its model class's,
    with the compiler's under train.compile: model.model_libraries) and return the script's `main`."""
    import importlib

    from .launcher import skip_unchosen_trackers
    from .model import model_libraries
    from .plan import Plan

    plan = Plan.from_json(Path(rank_argv[rank_argv.index("--plan") + 1]))
    skip_unchosen_trackers(plan.train.loggers)
    namespace = runpy.run_path(str(script), run_name="pretrain_bench_rank")  # defines main; runs nothing
    from .engines import engine_class

    engine_class(plan.train.engine).preload(plan.train)
    import pretrain_bench.trainer  # noqa: F401 -- what the rank imports next

    for name in model_libraries(plan.model.implementation, plan.train.compile):
        importlib.import_module(name)

    return namespace["main"]


def rank(main, argv: list[str], agent_signals: list[str]) -> None:
    """One rank, in the forked process: the script's main(argv), then this process's end with its exit status.
    `agent_signals`: those torchrun's agent handles (--signals-to-handle), whose handlers the fork inherited."""
    os.setsid()  # as torchrun's subprocess start does: not in the agent's process group, so not in its terminal's
    for name in agent_signals:  # the agent's handlers (which stop the agent) are not a rank's: a fresh one has none
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    try:
        code = main(argv)
    except SystemExit as error:
        code = error.code if isinstance(error.code, int) else (0 if error.code is None else 1)
    except BaseException:  # reported as an interpreter would report it, then exit status 1
        traceback.print_exc()
        code = 1
    if code:
        # a failure: torchrun sees this exit status (torch's multiprocessing wrapper would turn an exception into
        # status 1 and keep its traceback out of the log)
        exit_without_teardown(code)
    # success: torch's wrapper reports the return value to the agent, then the process ends without teardown
    finish_process()


def main(argv: list[str] | None = None) -> None:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher.api import elastic_launch

    @record
    def launch() -> None:
        args = torchrun.parse_args(argv)
        if args.standalone:  # as torchrun's run(): a private c10d rendezvous on a free local port
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
        if args.master_port is None:  # as torchrun's run() (read by the static rendezvous only)
            args.master_port = 29500
        config, _, _ = torchrun.config_from_args(args)
        config.start_method = "fork"
        rank_argv = list(args.training_script_args)
        elastic_launch(config, rank)(preload(Path(args.training_script), rank_argv), rank_argv,
                                     args.signals_to_handle.split(","))

    launch()


if __name__ == "__main__":
    main()
