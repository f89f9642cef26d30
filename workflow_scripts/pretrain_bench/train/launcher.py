"""Start one training run on N local ranks with torchrun: device choice, device slots, threads, rendezvous.

Used by every multi-rank rule (`pretrain`, benchmark cells) through workflow_scripts/launch.py.
- Ranks per node: `train.gpus`, which the caller's `--ranks` repeats (the job's reservation).
- Single node: `torchrun --standalone`, whose c10d rendezvous binds port 0, so two jobs started at once can never
  pick the same port.
- Multi-node (`train.nodes` > 1): one torchrun agent per node, all meeting at a c10d rendezvous (`--rdzv-endpoint`,
  else `train.rdzv_endpoint`) that node rank 0 hosts. By hand: start launch.py on every node with `--node-rank`.
  Inside a SLURM allocation: the launcher starts itself once per node with `srun` and, when no endpoint is set,
  puts the rendezvous on the allocation's first node (`scontrol show hostnames`).
- CUDA: disjoint device ids per concurrent job through `devices.gpu_slots`, taken from the visible devices
  (CUDA_VISIBLE_DEVICES when set), unless a scheduler assigned them. CPU: DS_ACCELERATOR=cpu, gloo,
  max(1, cores // ranks) threads per rank, each rank pinned to its own block of that many cores (run_context.pin_rank;
  with more ranks than cores, every rank one thread on all of them: oversubscribed).
- The ranks get the launcher's decisions (device, threads, oversubscription, pinning) as `pretrain.py --context`, a
  LaunchContext (run_context.py).
- One run per state folder: the launcher takes `<state_dir>/run.lock` (state_lock.py) before anything else, so a
  second run on the same name is refused before any rank starts and before any log is opened.
- With `--log`: every attempt writes its own file in `<log>.attempts/` (a header names the attempt), and the rule's
  declared log is a second name (hard link) for the newest one. Snakemake deletes a job's declared log before the job
  starts, so a log shared by attempts would lose a running attempt's record to the next one.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from pretrain_bench.core.devices import die_with_parent, gpu_slots, probe_peer_access, resolve_device
from pretrain_bench.data.products import DamagedProductError
from pretrain_bench.data.shards import verify_index
from pretrain_bench.train import state_lock
from pretrain_bench.train.plan import Plan, shards_verify_mode
from pretrain_bench.train.run_context import LaunchContext, usable_cpus
from pretrain_bench.train.settings import TrainSettings, check_settings

logger = logging.getLogger(__name__)


# Pinned host blocks above this size are allocated at their exact size instead of the next power of two (torch's
# caching host allocator, option pinned_max_round_threshold_mb), so a 9.3 GB offloaded partition takes 9.3 GB, not
# 16 GiB; the memory model counts exact sizes. Where torch lacks the option, DeepSpeed's pin_memory is turned off.
PINNED_EXACT_OPTION = "pinned_max_round_threshold_mb:64"
_PINNED_PROBE = """
import sys
import torch
torch.empty(1, device="cuda")
torch.empty(1024).pin_memory()
from torch._C import _accelerator_getAllocatorSettings
if "pinned_max_round_threshold_mb" not in _accelerator_getAllocatorSettings():
    sys.exit("this torch cannot stop rounding pinned blocks up to powers of two")
"""


# The allocator's settings: torch reads the first name and falls back to the second only where the first is unset
# (c10/cuda/CUDAAllocatorConfig.h), so an option set under one name alone hides a user's settings under the other.
ALLOCATOR_CONF_KEYS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def allocator_conf_with(env: dict, option: str) -> dict:
    """Both allocator settings names (ALLOCATOR_CONF_KEYS) with `option` (key:value) merged into the user's settings:
    each name keeps its own value where it is set, else takes the other's, so whichever torch reads still holds what
    the user asked. An option key the user set already is kept as the user set it."""
    key = option.split(":", 1)[0]
    merged = {}
    for name in ALLOCATOR_CONF_KEYS:
        other = next(n for n in ALLOCATOR_CONF_KEYS if n != name)
        own = env[name] if name in env else env.get(other, "")
        entries = [entry for entry in own.split(",") if entry.strip()]
        if not any(entry.split(":", 1)[0].strip() == key for entry in entries):
            entries.append(option)
        merged[name] = ",".join(entries)
    return merged


def exact_pinning(env: dict) -> tuple[dict, bool, str]:
    """Environment additions that keep pinned host buffers at their exact size, whether the ranks may pin at all
    (LaunchContext.pin_memory), and a line for the log.

    Probed in a child with `env`: the job's own GPU slot (CUDA_VISIBLE_DEVICES) and allocator settings, our option
    merged into the user's under both names (allocator_conf_with). Where the probe fails, pinning is off and the line
    names the failure (a torch without the option, or a GPU or pinned allocation that failed)."""
    additions = allocator_conf_with(env, PINNED_EXACT_OPTION)
    try:
        probe = subprocess.run([sys.executable, "-c", _PINNED_PROBE], env={**env, **additions}, capture_output=True,
                               text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as error:
        failure = f"the pinning probe did not run: {error}"
    else:
        if probe.returncode == 0:
            return additions, True, "pinned host memory at exact sizes: " + " ".join(
                f"{name}={conf}" for name, conf in additions.items())
        lines = probe.stderr.strip().splitlines()
        failure = lines[-1] if lines else f"the pinning probe exited with status {probe.returncode}"
    return {}, False, f"pinned host memory off: {failure} (offload copies are slower, RAM exact)"


P2P_KEY = "NCCL_P2P_DISABLE"


def nccl_peer_environment(nccl_env: dict, env: dict, ranks: int, probe=probe_peer_access) -> tuple[dict, str]:
    """NCCL_P2P_DISABLE=1 where the job's GPUs cannot reach each other peer to peer, and a line for the log.

    NCCL turns peer to peer off by itself where the driver says no, but some consumer-card drivers say yes and then
    hang; NVLink machines lose most of their bandwidth with it off. So each ordered pair of the job's GPUs (`env`'s
    CUDA_VISIBLE_DEVICES) is asked (torch.cuda.can_device_access_peer) and P2P is turned off only where one cannot,
    or where the probe fails. A value in train.nccl_env or the environment is kept as it is."""
    if P2P_KEY in nccl_env:
        return {}, f"{P2P_KEY}={nccl_env[P2P_KEY]} as train.nccl_env sets it"
    if P2P_KEY in env:
        return {}, f"{P2P_KEY}={env[P2P_KEY]} as the environment sets it"
    if ranks < 2:
        return {}, "GPU peer to peer not probed: one GPU per node has no peer"
    pairs, failure = probe(ranks, env)
    if pairs is None:
        return {P2P_KEY: "1"}, f"{P2P_KEY}=1: peer access between the job's GPUs could not be probed ({failure})"
    blocked = [f"{a}->{b}" for a, b, reachable in pairs if not reachable]
    if blocked:
        return {P2P_KEY: "1"}, (f"{P2P_KEY}=1: GPU pairs without peer access (torch.cuda.can_device_access_peer): "
                                + ", ".join(blocked))
    return {}, f"GPU peer to peer on: all {ranks} GPUs of the job reach each other (torch.cuda.can_device_access_peer)"


# A torch JIT-extension build holds a bare lock file (torch.utils.file_baton) that names no owner; every rank takes
# it while DeepSpeed loads its CPU op, even when the op is already built. A rank killed in that window leaves the
# file behind and every later run waits on it forever. A build takes minutes; a lock this old has no builder.
STALE_EXTENSION_LOCK_S = 15 * 60


def environment_extension_dir() -> Path | None:
    """This Python environment's own JIT-extension cache, <sys.prefix>/torch_extensions, when sys.prefix is writable
    (a venv, a conda env); None otherwise. torch's default cache (~/.cache/torch_extensions/py311_cpu) is shared by
    every environment of one Python version, and a build there records the environment's own paths: with two
    checkouts' .venvs on one machine, each rebuilds DeepSpeed's CPU ops (about 30 s on 2 cores) after the other has
    built them, inside the first multi-rank job, which may be a timed benchmark cell."""
    prefix = Path(sys.prefix)
    return prefix / "torch_extensions" if os.access(prefix, os.W_OK) else None


def extension_build_root(environ=os.environ) -> Path:
    """Where DeepSpeed's ops build and load: TORCH_EXTENSIONS_DIR in environ when set, else this environment's own cache
    (environment_extension_dir), else torch's default (cpp_extension.get_default_build_root). Found without importing
    torch, which would cost every launch about 2 s before any rank starts: torch's `_appdirs.py` (standard library
    imports only) is loaded on its own from the installed package."""
    if environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(environ["TORCH_EXTENSIONS_DIR"])
    own = environment_extension_dir()
    if own is not None:
        return own
    import importlib.util

    appdirs_path = Path(importlib.util.find_spec("torch").origin).parent / "_appdirs.py"
    spec = importlib.util.spec_from_file_location("_pretrain_bench_torch_appdirs", appdirs_path)
    appdirs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(appdirs)
    return Path(os.path.realpath(appdirs.user_cache_dir(appname="torch_extensions")))


def extension_build_environment(environ=os.environ) -> dict:
    """The variables under which DeepSpeed's ops build and load the same way in every process: the cache
    (extension_build_root) and, first on PATH, this interpreter's own bin directory, whose `ninja` (a dependency of
    deepspeed) torch runs. ninja's log format differs between versions (1.11 and 1.13 hash commands differently), so
    a system ninja and the environment's would each take the other's build for stale and recompile, whichever ran
    last; which one a process found used to depend on whether the venv was activated."""
    own_bin = str(Path(sys.executable).parent)
    path = [entry for entry in environ.get("PATH", "").split(os.pathsep) if entry and entry != own_bin]
    return {"TORCH_EXTENSIONS_DIR": str(extension_build_root(environ)), "PATH": os.pathsep.join([own_bin, *path])}


def build_cpu_ops() -> list[str]:
    """`make install`: build DeepSpeed's CPU ops (shared-memory collectives, CPU Adam) into extension_build_root(),
    as every rank the launcher starts loads them, so no training job compiles. Returns the ops' names."""
    os.environ.update(extension_build_environment())
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    names = ["ShareMemCommBuilder", "CPUAdamBuilder"]
    for name in names:
        get_accelerator().create_op_builder(name).load(verbose=False)
    return names


def clear_stale_extension_locks(max_age_s: float = STALE_EXTENSION_LOCK_S, root: Path | None = None) -> list[Path]:
    """Remove torch extension build locks older than max_age_s; returns what was removed. Never raises."""
    import time

    removed = []
    try:
        root = extension_build_root() if root is None else root
        for lock in Path(root).glob("**/lock"):
            if time.time() - lock.stat().st_mtime > max_age_s:
                lock.unlink()
                removed.append(lock)
    except Exception:  # a cache we cannot read is not a reason to stop a run
        pass
    return removed


def wait_out_stale_build_locks(max_age_s: float = STALE_EXTENSION_LOCK_S) -> None:
    """In a rank: make torch's build-lock wait (FileBaton.wait, which DeepSpeed's op loader calls) give up on a lock
    older than max_age_s instead of waiting forever, so a lock left by a rank killed mid-load cannot hang a run
    started before the launcher's own sweep could see it. Hand-written because torch offers no timeout there."""
    import time

    from torch.utils import file_baton

    def wait(baton) -> None:
        while os.path.exists(baton.lock_file_path):
            try:
                if time.time() - os.path.getmtime(baton.lock_file_path) > max_age_s:
                    os.remove(baton.lock_file_path)
                    logger.warning(f"removed {baton.lock_file_path}: a build lock older than {max_age_s:.0f} s, "
                                   "left by a killed process")
                    return
            except OSError:
                pass  # gone meanwhile, or removed by another rank
            time.sleep(baton.wait_seconds)

    file_baton.FileBaton.wait = wait


def skip_unchosen_trackers(loggers) -> list[str]:
    """In a rank, before DeepSpeed is imported: make the optional tracker packages (trackers.OPTIONAL_PACKAGES) the
    run does not log to unimportable (None in sys.modules), so that a library's `try: import mlflow` fails at once.
    Every `import deepspeed` loads its autotuner, which tries mlflow that way only to log autotuning, which the
    pipeline never runs: where mlflow-skinny is installed (the trackers extra) that import was most of DeepSpeed's
    and about 2 s of every rank's start on 2 cores. Hand-written because DeepSpeed has no switch for it. A package
    already imported, or chosen in train.loggers, is left alone. Returns the packages so marked."""
    from pretrain_bench.config.checks import OPTIONAL_PACKAGES

    skipped = [module for name, (module, _) in OPTIONAL_PACKAGES.items()
               if name not in loggers and module not in sys.modules]
    sys.modules.update(dict.fromkeys(skipped))
    return skipped


def rank_environment(context: LaunchContext, base: dict) -> dict:
    """Environment for the ranks of one job: what the libraries they load read (OpenMP, tokenizers, DeepSpeed). The
    launcher's own decisions reach the ranks as their --context (LaunchContext), not through the environment."""
    env = dict(base)
    env.update(OMP_NUM_THREADS=str(context.threads_per_rank), TOKENIZERS_PARALLELISM="false")
    env.update(extension_build_environment(base))  # DeepSpeed's CPU ops: where and how `make install` built them
    if context.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    return env


# Set on the per-node tasks the launcher starts with srun: "this process is one node of a multi-node run".
SLURM_NODE_TASK = "PRETRAIN_BENCH_SLURM_NODE_TASK"
# torchrun's default c10d port, for a rendezvous on another machine, where no free port can be looked up.
DEFAULT_RDZV_PORT = 29400


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """'host:port' → (host, port); raises ValueError naming the endpoint."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"rendezvous endpoint {endpoint!r} is not host:port")
    return host, int(port)


# How long torchrun waits, after passing a stop on, for the ranks to finish their step, save it and exit before it
# kills them (torchrun's own default, 30 s, is shorter than one save of a large model).
GRACEFUL_STOP_S = 600
# torchrun turns these into a stop of its ranks; SIGINT is left out (and ignored): the launcher passes every stop on
# as one SIGTERM, so a Ctrl-C that reaches the launcher and torchrun together is not a second, harder stop.
TORCHRUN_SIGNALS = "SIGTERM,SIGHUP,SIGQUIT"


def forks_ranks(rank_start: str, device: str) -> bool:
    """Whether torchrun forks the ranks from an agent that has imported what they import
    (pretrain_bench.train.forked_ranks) rather than starting each as a fresh interpreter: train.rank_start, where auto
    means on CPU (check_settings refuses fork on CUDA)."""
    return rank_start == "fork" or (rank_start == "auto" and device == "cpu")


def torchrun_options(source: str | None = None) -> frozenset[str]:
    """The option strings torchrun's argument parser (torch.distributed.run.get_args_parser) accepts, read from its
    source (`source`, by default the installed torch's torch/distributed/run.py) without importing torch, which would
    cost every launch about 2 s. Newer options are passed only where they are accepted: torch 2.11's torchrun exits 2
    on --shutdown-timeout ("unrecognized arguments")."""
    import ast

    if source is None:
        source = _installed_torchrun_source()
    options = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            options.update(arg.value for arg in node.args
                           if isinstance(arg, ast.Constant) and str(arg.value).startswith("--"))
    return frozenset(options)


@functools.lru_cache(maxsize=1)
def _installed_torchrun_source() -> str:
    import importlib.util

    return (Path(importlib.util.find_spec("torch").origin).parent / "distributed" / "run.py").read_text()


def torchrun_command(script: Path, script_args: list[str], *, ranks: int, nodes: int, max_restarts: int,
                     rdzv_endpoint: str | None = None, node_rank: int | None = None,
                     rdzv_id: str = "pretrain-bench", forked: bool = False,
                     options: frozenset[str] | None = None) -> list[str]:
    """torchrun's command for this launch (`forked`: the same torchrun, run by pretrain_bench.train.forked_ranks).
    `options`: what this torch's torchrun accepts (torchrun_options()); a stop option it lacks is left out, and its
    own default holds (torch 2.11: ranks get 30 s to save after a stop, and SIGINT is passed on too)."""
    options = torchrun_options() if options is None else options
    agent = "pretrain_bench.train.forked_ranks" if forked else "torch.distributed.run"
    cmd = [sys.executable, "-m", agent, f"--nproc-per-node={ranks}", f"--max-restarts={max_restarts}"]
    cmd += [f"{flag}={value}" for flag, value in (("--shutdown-timeout", GRACEFUL_STOP_S),
                                                   ("--signals-to-handle", TORCHRUN_SIGNALS)) if flag in options]
    if nodes == 1:
        cmd.append("--standalone")
    else:
        if not rdzv_endpoint:
            raise ValueError("train.nodes > 1 needs train.rdzv_endpoint (host:port of the first node)")
        parse_endpoint(rdzv_endpoint)
        cmd += [f"--nnodes={nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                f"--rdzv-id={rdzv_id}"]
        if node_rank is not None:
            # c10d numbers the nodes itself (torchrun ignores --node-rank for it). Node 0 hosts the rendezvous
            # store, so agents that share a host name, or reach the host by another name, never both try to serve it.
            cmd.append(f"--rdzv-conf=is_host={'true' if node_rank == 0 else 'false'}")
    return cmd + [str(script), *script_args]


def _scontrol(*args: str) -> str:
    try:
        return subprocess.run(["scontrol", *args], check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        raise ValueError(f"scontrol {' '.join(args)} failed: {str(detail).strip()}") from error


def slurm_job(job_id: str) -> dict[str, str]:
    """`scontrol show job` as key → value. Read from slurmctld because Snakemake's SLURM job step strips most
    SLURM_* variables (the node list among them) from the environment it runs the rule in."""
    fields: dict[str, str] = {}
    for token in _scontrol("show", "job", "--oneliner", job_id).split():
        key, sep, value = token.partition("=")
        if sep:
            fields.setdefault(key, value)
    return fields


def slurm_hostnames(nodelist: str) -> list[str]:
    """A SLURM node list ('gpu[01-03]') expanded into host names, in allocation order."""
    return _scontrol("show", "hostnames", nodelist).split()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def slurm_fan_out(nodes: int, relaunch: list[str], rdzv_endpoint: str | None, job_id: str) -> list[str]:
    """The srun command that starts `relaunch` (this launcher) once on every node of SLURM job `job_id`.

    The rendezvous defaults to the allocation's first node: a free port when that is this node (the batch step
    runs on the first node), else torchrun's default port.
    """
    job = slurm_job(job_id)
    hosts = slurm_hostnames(job["NodeList"])
    if len(hosts) != nodes:
        raise ValueError(f"train.nodes={nodes} but SLURM job {job_id} holds {len(hosts)} node(s) "
                         f"({job['NodeList']}): submit it with resources.nodes = train.nodes")
    if not rdzv_endpoint:
        port = free_port() if job.get("BatchHost") == hosts[0] else DEFAULT_RDZV_PORT
        rdzv_endpoint = f"{hosts[0]}:{port}"
    cmd = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
           "--label"]
    if job.get("CPUs/Task", "").isdigit():
        cmd.append(f"--cpus-per-task={job['CPUs/Task']}")  # srun ≥ 22.05 no longer inherits the job's value
    return cmd + [*relaunch, "--rdzv-endpoint", rdzv_endpoint]


def _attempt_log(log: Path, header: str) -> int:
    """A new file for this attempt in `<log stem>.attempts/`, starting with `header`, and `log` made a second name for
    it (a hard link; a symbolic link where the file system has none). Returns its open descriptor."""
    log = Path(log)
    path = state_lock.attempt_path(log)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(fd, header.encode())
    # Replacing the name never writes into a file another attempt still has open.
    state_lock.point_log_at(log, path)
    return fd


def _attempt_header(plan_path: Path, what: str) -> str:
    return (f"=== pretrain-bench launcher: {what} at {time.strftime('%Y-%m-%d %H:%M:%S %z')}, pid {os.getpid()} "
            f"on {socket.gethostname()}, plan {plan_path} ===\n")


def redirect_to_attempt_log(log: Path, plan_path: Path) -> None:
    """From here on this process's stdout and stderr (and so torchrun's and the ranks') go to a new attempt log."""
    fd = _attempt_log(log, _attempt_header(plan_path, "attempt started"))
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def record_refusal(log: Path, plan_path: Path, message: str) -> None:
    """A refused attempt's record: its own attempt file (the refusal) under the declared log's name."""
    fd = _attempt_log(log, _attempt_header(plan_path, "attempt refused") + f"error: {message}\n")
    os.close(fd)


def launch(plan: Plan, plan_path: Path, ranks: int, script: Path, lock_dir: Path, *, node_rank: int | None = None,
           rdzv_endpoint: str | None = None, relaunch: list[str] | None = None, log: Path | None = None) -> int:
    """Run torchrun for this plan (or, for a multi-node run in a SLURM allocation, srun one launcher per node);
    returns its exit code. SIGTERM is passed on so ranks can checkpoint.

    `relaunch` is the command that starts this launcher again (launch.py with --ranks/--plan), for srun. `log`: see
    the module docstring; without it output stays on this process's stdout/stderr.
    Raises state_lock.StateInUse, before starting anything or opening the log, when another run holds the state.
    """
    settings = plan.train
    if ranks != settings.gpus:
        raise ValueError(f"--ranks {ranks} (ranks per node) but train.gpus={settings.gpus}: they must agree")
    check_settings(settings)
    # The launcher that starts the job takes the state lock: on one node that is this one; in a multi-node run the
    # one with node rank 0 (by hand) or the one that fans out with srun (SLURM), never the per-node copies.
    lock = None
    if SLURM_NODE_TASK not in os.environ and not (node_rank or 0):
        try:
            lock = state_lock.acquire(Path(plan.paths.state_dir))
        except state_lock.StateInUse as error:
            if log:
                record_refusal(log, plan_path, str(error))
            raise
    if lock:  # rank 0 writes the trackers' folders: a folder it cannot write is named now, not by a rank's traceback
        from pretrain_bench.train.trackers import TrackerFolderError, check_tracker_folders

        try:
            check_tracker_folders(settings.loggers, Path(plan.paths.state_dir))
        except TrackerFolderError as error:
            if log:
                record_refusal(log, plan_path, str(error))
            raise
    if lock and plan.resume and plan.save_checkpoints:
        from pretrain_bench.train.checkpoints.run_state import already_finished

        # on the terminal, before the job's output goes to its log: the job rewrites outputs, it trains nothing
        if note := already_finished(Path(plan.paths.state_dir), plan):
            logger.info(note)
    # The shards, before any rank starts: a damaged shared product is named here (and on the terminal), never
    # trained on (shards.verify)
    try:
        verify_index(Path(plan.paths.index), shards_verify_mode(plan))
    except DamagedProductError as error:
        if log:
            record_refusal(log, plan_path, str(error))
        raise
    if log:
        redirect_to_attempt_log(log, plan_path)
    code = _launch_locked(plan, plan_path, ranks, script, lock_dir, settings, node_rank=node_rank,
                          rdzv_endpoint=rdzv_endpoint, relaunch=relaunch,
                          pass_fds=(lock.fileno(),) if lock else ())
    logger.info(f"=== attempt ended at {time.strftime('%Y-%m-%d %H:%M:%S %z')}: exit status {code} ===")
    return code


def _launch_locked(plan: Plan, plan_path: Path, ranks: int, script: Path, lock_dir: Path, settings: TrainSettings, *,
                   node_rank: int | None, rdzv_endpoint: str | None, relaunch: list[str] | None,
                   pass_fds: tuple[int, ...]) -> int:
    rdzv_endpoint = rdzv_endpoint or settings.rdzv_endpoint
    job_id = os.environ.get("SLURM_JOB_ID")
    if job_id:
        logger.info(f"SLURM_JOB_ID={job_id} node={os.environ.get('SLURMD_NODENAME', '?')} host={socket.gethostname()}")
    if settings.nodes > 1:
        if job_id and SLURM_NODE_TASK not in os.environ and node_rank is None:
            if not relaunch:
                raise ValueError("a multi-node run in a SLURM allocation needs the launcher's own command (relaunch)")
            cmd = slurm_fan_out(settings.nodes, relaunch, rdzv_endpoint, job_id)
            return _run(cmd, dict(os.environ, **{SLURM_NODE_TASK: "1"}), pass_fds)
        if node_rank is None:
            node_rank = int(os.environ["SLURM_NODEID"]) if SLURM_NODE_TASK in os.environ else 0
        if not 0 <= node_rank < settings.nodes:
            raise ValueError(f"node rank {node_rank} is outside 0..{settings.nodes - 1} (train.nodes={settings.nodes})")
        if not rdzv_endpoint:
            raise ValueError(f"train.nodes={settings.nodes} outside SLURM needs train.rdzv_endpoint or "
                             "--rdzv-endpoint: host:port on the node started with --node-rank 0")
        logger.info(f"node rank {node_rank} of {settings.nodes}, rendezvous {rdzv_endpoint}")
    device = resolve_device(plan.device_request)
    check_settings(settings, device)
    cpus = usable_cpus()
    context = LaunchContext.for_job(device, ranks, len(cpus), cpus)
    env = rank_environment(context, os.environ)
    for stale in clear_stale_extension_locks():
        logger.warning(f"removed {stale}: a torch extension build lock left by a killed process (ranks would wait "
                       "on it forever)")
    if device == "cuda" and settings.comm_backend == "nccl" and settings.nccl_env:
        env.update(settings.nccl_env)
        logger.info("nccl environment (train.nccl_env): " + " ".join(f"{k}={v}" for k, v in settings.nccl_env.items()))
    env[state_lock.HELD_ENV] = "1"  # by this launcher, or by node rank 0's in a multi-node run
    if context.oversubscribed:
        logger.info(f"note: {ranks} ranks on {len(cpus)} cores: oversubscribed, 1 thread per rank; timings are "
                    "contended")
    if context.cpus:
        logger.info("ranks pinned to cores: " + "; ".join(
            f"local rank {rank}: {list(context.rank_cores(rank))}" for rank in range(ranks))
            + f" ({context.threads_per_rank} thread(s) each)")
    slots = gpu_slots(ranks, lock_dir) if device == "cuda" else nullcontext(None)
    with slots as device_ids:
        if device_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, device_ids))
            logger.info(f"device slots: CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}")
        if device == "cuda" and "cpu" in (settings.offload_optimizer, settings.offload_param):
            additions, pin_memory, note = exact_pinning(env)  # probed on the job's own GPUs, as are the peers below
            env.update(additions)
            context = dataclasses.replace(context, pin_memory=pin_memory)
            logger.info(note)
        if device == "cuda" and settings.comm_backend == "nccl":
            additions, note = nccl_peer_environment(settings.nccl_env or {}, env, ranks)
            env.update(additions)
            logger.info(note)
        if "--shutdown-timeout" not in torchrun_options():
            logger.info("note: this torch's torchrun has no --shutdown-timeout: after a stop the ranks get its default "
                        f"time (30 s), not {GRACEFUL_STOP_S} s, to save the step in flight")
        cmd = torchrun_command(script, ["--plan", str(plan_path), "--context", context.to_json()], ranks=ranks,
                               nodes=settings.nodes, max_restarts=settings.max_restarts, rdzv_endpoint=rdzv_endpoint,
                               node_rank=node_rank, rdzv_id=job_id or f"{plan.name}-{plan.role}",
                               forked=forks_ranks(settings.rank_start, device))
        return _run(cmd, env, pass_fds)


def _start_child() -> None:
    """preexec_fn of torchrun (or srun): SIGTERM when this launcher dies, SIGINT ignored (the ranks inherit that until
    they install their own handler)."""
    die_with_parent(signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run(cmd: list[str], env: dict, pass_fds: tuple[int, ...] = ()) -> int:
    """Run cmd to the end. A SIGTERM or SIGINT (Ctrl-C, or Snakemake interrupted: see interrupts_stop_training) is
    passed on once, as SIGTERM, and the launcher waits on: the ranks save the step in flight and exit. `pass_fds`
    (the state lock) stay open in the child, so the lock outlives this launcher while torchrun's ranks still write."""
    logger.info("launch: " + " ".join(cmd))
    # torchrun gets SIGTERM if this launcher dies, so it stops its ranks (which checkpoint)
    proc = subprocess.Popen(cmd, env=env, preexec_fn=_start_child, pass_fds=pass_fds)
    stopping: list[str] = []

    def stop(signum, frame) -> None:
        name = signal.Signals(signum).name
        if stopping:
            logger.info(f"{name} received: already stopping, waiting for the ranks to save their checkpoint")
            return
        stopping.append(name)
        logger.info(f"{name} received: asking the ranks to save the step in flight and stop")
        proc.send_signal(signal.SIGTERM)

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        return proc.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def interrupts_stop_training(launch_script: Path) -> None:
    """In Snakemake's own process: make SIGINT (Ctrl-C, `kill -INT`) stop the training jobs it runs, then let
    Snakemake handle it as before.

    Snakemake 9 runs a local shell job in a thread of its own process and, on SIGINT, logs "Terminating processes on
    user request" and waits for the running jobs to end without signalling them (executors/local.py: cancel() only
    shuts the thread pool down), so training would run on to train.max_steps. This passes the SIGINT to every
    launcher (`launch_script`) below this process first; each stops its ranks with a checkpoint and exits, and
    Snakemake, which waits for them, then exits too. Hand-written because Snakemake has no hook for it."""
    import threading

    import psutil

    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGINT)
    if getattr(previous, "stops_training", False):  # the Snakefile is read more than once in one process
        return
    script = Path(launch_script).resolve()

    def is_launcher(process: psutil.Process) -> bool:
        return any(arg.endswith(script.name) and Path(process.cwd(), arg).resolve() == script
                   for arg in process.cmdline()[1:3])

    def handler(signum, frame):
        for process in psutil.Process().children(recursive=True):
            try:
                if is_launcher(process):
                    process.send_signal(signal.SIGINT)
            except psutil.Error:
                pass  # ended meanwhile
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            raise KeyboardInterrupt

    handler.stops_training = True
    signal.signal(signal.SIGINT, handler)
