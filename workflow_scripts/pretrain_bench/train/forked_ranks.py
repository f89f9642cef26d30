"""torchrun whose ranks are forked from a copy of it made after it imported what they import (train.rank_start fork).

`python -m pretrain_bench.train.forked_ranks <torchrun's options> pretrain.py --plan PLAN --context JSON` is torchrun
(`torch.distributed.run`: its options, rendezvous, restarts, the signals it passes on and its shutdown timeout are
torch's own, parsed and run by torch's code) with one difference: a rank is not a fresh interpreter running the script
but a fork running the script's `main`, so torch, DeepSpeed and this package are imported once per launch instead of
once per rank. That import is most of a CPU rank's start-up (README, "Process start-up"). torchrun itself has no such
option: it starts a Python function through Python's multiprocessing, which the script's `main` is made into here
(torch's `elastic_launch` with `start_method="forkserver"`).

The ranks are not forked from torchrun's agent itself: by the time it starts them, the agent runs threads of its own
(its rendezvous stores' servers, the rendezvous keep-alive), and a fork copies any lock one of them holds at that
moment, held for good. It happened: a rank hung for good in glibc's name resolver (its lock taken by another thread of
the agent as the rank was forked), when the rank looked up the rendezvous host. So the agent forks once, after its
imports and before it starts any thread of its own, a fork server: Python's multiprocessing fork server, whose process
here is that fork of the agent instead of a fresh interpreter (`start_fork_server`). The ranks are forked from it, one
thread that holds no lock. Its process is named `fork-server`, each rank's `rank<local rank>` (ps, top).

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

from pretrain_bench.core.devices import set_process_name
from pretrain_bench.core.logs import exit_without_teardown, finish_process

# The script's `main` of each rank script preloaded in this process (preload), which the forked ranks inherit
_MAINS: dict[str, object] = {}
# The fork server's process name (ps, top); each rank's is rank<local rank>
FORK_SERVER_NAME = "fork-server"


def _open_fds() -> set[int]:
    """This process's open file descriptors (Linux: /proc/self/fd, less the one that lists it)."""
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            os.fstat(int(name))
            fds.add(int(name))
        except OSError:  # the directory's own descriptor, closed by now
            pass
    return fds


def start_fork_server() -> int:
    """Start Python's multiprocessing fork server (start method `forkserver`) as a fork of this process, which has
    imported what a rank imports and has not started torchrun's threads yet (the only others are libraries' idle
    pools, such as OpenBLAS's, which a fork does not copy and whose locks their own fork handlers reset); returns its
    pid. Python starts it as a fresh interpreter (`util.spawnv_passfds` of `python -c <its main>`), which would import
    all of it once more: here the same command runs in a fork of this process instead. Hand-written because
    multiprocessing has no way to make the fork server from the running process."""
    from multiprocessing import forkserver, resource_tracker, util

    resource_tracker.ensure_running()  # a fresh interpreter, as multiprocessing starts it (it imports nothing heavy)
    open_before = _open_fds()

    def fork_in_place(path, args, passfds) -> int:
        if args[-2] != "-c":
            raise RuntimeError(f"multiprocessing's fork server command is not `python -c <code>`: {args}")
        pid = os.fork()
        if pid == 0:  # the fork server: multiprocessing's own main loop, which forks a rank on each request
            code = 1
            try:
                # what ensure_running opened for it but not passed to it, as the fresh interpreter would not have it:
                # the write end of its "alive" pipe, whose closing (the agent's end) ends the server
                for fd in _open_fds() - open_before - set(passfds):
                    os.close(fd)
                set_process_name(FORK_SERVER_NAME)
                exec(args[-1], {"__name__": "__fork_server__"})
                code = 0
            except SystemExit:  # how multiprocessing's fork server ends when the agent has closed its end
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        return pid

    spawnv_passfds = util.spawnv_passfds
    util.spawnv_passfds = fork_in_place
    try:
        forkserver.ensure_running()
    finally:
        util.spawnv_passfds = spawnv_passfds
    return forkserver._forkserver._forkserver_pid


def stop_fork_server() -> None:
    """End the fork server and wait for it (its exit status, CPU time and ranks' CPU time become this process's
    children's), as the agent ends: it would otherwise outlive the agent by a moment, a child no one waits for."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if server._forkserver_pid is not None:
        server._stop()


def script_main(script: str):
    """The `main` of the rank script at `script` (run as a module named pretrain_bench_rank: it defines main and runs
    nothing)."""
    return runpy.run_path(script, run_name="pretrain_bench_rank")["main"]


def preload(script: Path, rank_argv: list[str]) -> None:
    """Import what a rank of this plan imports (as the script would, the unchosen trackers made unimportable first:
    launcher.skip_unchosen_trackers; then the trainer, its engine's libraries (Engine.preload) and its model class's,
    with the compiler's under train.compile: model.model_libraries) and keep the script's `main` for the ranks."""
    import importlib

    from pretrain_bench.train.launcher import skip_unchosen_trackers
    from pretrain_bench.train.models.registry import model_libraries
    from pretrain_bench.train.plan import Plan

    plan = Plan.from_json(Path(rank_argv[rank_argv.index("--plan") + 1]))
    skip_unchosen_trackers(plan.train.loggers)
    _MAINS[str(script)] = script_main(str(script))
    from pretrain_bench.train.engines.registry import engine_class

    engine_class(plan.train.engine).preload(plan.train)
    import pretrain_bench.train.trainer  # noqa: F401 -- what the rank imports next

    for name in model_libraries(plan.model, plan.train.compile):
        importlib.import_module(name)


def rank(script: str, argv: list[str], agent_signals: list[str]) -> None:
    """One rank, in the forked process: the script's main(argv), then this process's end with its exit status.
    `agent_signals`: those torchrun's agent handles (--signals-to-handle), whose handlers the fork inherited."""
    os.setsid()  # as torchrun's subprocess start does: not in the agent's process group, so not in its terminal's
    set_process_name(f"rank{os.environ.get('LOCAL_RANK', '')}")
    # preloaded by the agent; a fork server that multiprocessing had to start again as a fresh interpreter has not
    main = _MAINS[script] if script in _MAINS else script_main(script)
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
        config.start_method = "forkserver"
        rank_argv = list(args.training_script_args)
        preload(Path(args.training_script), rank_argv)
        start_fork_server()  # before elastic_launch starts the agent's threads
        try:
            elastic_launch(config, rank)(str(Path(args.training_script)), rank_argv,
                                         args.signals_to_handle.split(","))
        finally:
            stop_fork_server()

    launch()


if __name__ == "__main__":
    main()
