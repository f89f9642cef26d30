"""Start one training run on N local ranks with torchrun: device choice, device slots, threads, rendezvous.

Used by every multi-rank rule (`pretrain`, benchmark cells) through workflow_scripts/launch.py.
- Ranks per node come from the job's `resources.gpu`.
- Single node: `torchrun --standalone`, whose c10d rendezvous binds port 0, so two jobs started at once can never
  pick the same port. Multi-node: `--rdzv-endpoint` from the plan.
- CUDA: disjoint device ids per concurrent job through `devices.allocate_slots`, unless CUDA_VISIBLE_DEVICES was
  set by a scheduler. CPU: DS_ACCELERATOR=cpu, gloo, max(1, cores // ranks) threads per rank.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

from .devices import allocate_slots, cuda_device_count, resolve_device
from .settings import TrainSettings, check_settings


def rank_environment(device: str, ranks: int, cores: int, base: dict) -> dict:
    """Environment for the ranks of one job."""
    env = dict(base)
    threads = max(1, cores // ranks)
    env.update(
        PRETRAIN_BENCH_DEVICE=device,
        PRETRAIN_BENCH_THREADS_PER_RANK=str(threads),
        PRETRAIN_BENCH_OVERSUBSCRIBED="1" if ranks > cores else "0",
        OMP_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
    )
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    return env


def torchrun_command(script: Path, script_args: list[str], *, ranks: int, nodes: int, max_restarts: int,
                     rdzv_endpoint: str | None = None, node_rank: int | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
           f"--max-restarts={max_restarts}"]
    if nodes == 1:
        cmd.append("--standalone")
    else:
        if not rdzv_endpoint:
            raise ValueError("train.nodes > 1 needs train.rdzv_endpoint (host:port of the first node)")
        cmd += [f"--nnodes={nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
        if node_rank is not None:
            cmd.append(f"--node-rank={node_rank}")
    return cmd + [str(script), *script_args]


def launch(plan: dict, plan_path: Path, ranks: int, script: Path, lock_dir: Path) -> int:
    """Run torchrun for this plan; returns its exit code. SIGTERM is passed on so ranks can checkpoint."""
    settings = TrainSettings.from_config(plan["train"])
    if ranks != settings.gpus:
        raise ValueError(f"resources.gpu={ranks} but train.gpus={settings.gpus}: they must agree")
    device = resolve_device(plan["device_request"])
    check_settings(settings, device)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    env = rank_environment(device, ranks, cores, os.environ)
    if env["PRETRAIN_BENCH_OVERSUBSCRIBED"] == "1":
        print(f"note: {ranks} ranks on {cores} cores: oversubscribed, 1 thread per rank; timings are "
              "contended", file=sys.stderr, flush=True)
    slots = nullcontext(None)
    if device == "cuda" and "CUDA_VISIBLE_DEVICES" not in os.environ:
        slots = allocate_slots(ranks, cuda_device_count(), lock_dir)
    cmd = torchrun_command(script, ["--plan", str(plan_path)], ranks=ranks, nodes=settings.nodes,
                           max_restarts=settings.max_restarts, rdzv_endpoint=plan.get("rdzv_endpoint"))
    with slots as device_ids:
        if device_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, device_ids))
            print(f"device slots: CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}", file=sys.stderr, flush=True)
        print("launch: " + " ".join(cmd), file=sys.stderr, flush=True)
        proc = subprocess.Popen(cmd, env=env)
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signal.SIGTERM))
        try:
            return proc.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
