"""Multi-node training without a scheduler: two launchers on this machine act as two nodes of one c10d rendezvous
(127.0.0.1, a free port), each pinned to its own core, and must train exactly like one node with the same world
size (fp32, ZeRO-2, gloo on CPU is bit-deterministic)."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain_bench.train.launcher import torchrun_command
from pretrain_bench.train.plan import make_plan
from pretrain_bench.workflow.experiment import plan_config
from support import LAUNCHER, ROOT, free_port, read_jsonl  # data: the tiny data (tests/conftest.py)

pytestmark = pytest.mark.engine

# Outside any scheduler: inside a SLURM allocation the launcher would start the nodes itself with srun.
ENV = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


def write_run_plan(data, run_dir: Path, **train) -> Path:
    config, results = data
    settings = {"max_steps": 6, "warmup_steps": 2, "warmup_timing_steps": 1, "global_batch_size": None, "zero_stage": 2,
                "precision": "fp32", "comm_backend": "gloo", "device": "cpu", **train}
    config = {**config, "train": {**config["train"], **settings}}
    plan = make_plan(plan_config(config), index=results.shards / "index.json", tokenizer=results.tokenizer,
                     out_dir=run_dir / "out", state_dir=run_dir / "state", save_checkpoints=False)
    plan.to_json(run_dir / "plan.json")
    return run_dir / "plan.json"


def start(args: list[str], log: Path, cpus: set[int]) -> subprocess.Popen:
    """One launcher ("node") on its own cores, so every rank runs with as many threads as in the reference."""
    return subprocess.Popen([sys.executable, str(LAUNCHER), *args], cwd=ROOT, env=ENV, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: os.sched_setaffinity(0, cpus))


def wait_all(procs: dict[str, subprocess.Popen], tmp_path: Path, timeout: float) -> None:
    try:
        for name, proc in procs.items():
            code = proc.wait(timeout)
            assert code == 0, f"{name} exited {code}:\n" + (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


def metrics(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "out" / "metrics.jsonl")


def test_two_nodes_on_one_machine_match_one_node_of_the_same_world_size(data, tmp_path):
    single = write_run_plan(data, tmp_path / "single", gpus=2, nodes=1)
    multi = write_run_plan(data, tmp_path / "multi", gpus=1, nodes=2)
    endpoint = f"127.0.0.1:{free_port()}"
    cpus = sorted(os.sched_getaffinity(0))
    procs = {  # the reference and both nodes at once: the run takes as long as the slowest of them
        "single": start(["--ranks", "2", "--plan", str(single)], tmp_path / "single.log", set(cpus)),
        **{f"node{k}": start(["--ranks", "1", "--plan", str(multi), "--node-rank", str(k), "--rdzv-endpoint",
                              endpoint], tmp_path / f"node{k}.log", {cpus[k % len(cpus)]}) for k in (0, 1)},
    }
    wait_all(procs, tmp_path, timeout=300)

    summary = json.loads((tmp_path / "multi" / "out" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["nodes"] == 2 and summary["steps"] == 6
    for k in (0, 1):
        log = (tmp_path / f"node{k}.log").read_text()
        assert f"node rank {k} of 2, rendezvous {endpoint}" in log
        assert f"--rdzv-endpoint={endpoint}" in log and "--nnodes=2" in log and "--nproc-per-node=1" in log
    reference, two_nodes = metrics(tmp_path / "single"), metrics(tmp_path / "multi")
    assert [r["step"] for r in two_nodes] == list(range(1, 7))
    assert [r["loss"] for r in two_nodes] == [r["loss"] for r in reference], "per-step losses equal, bit for bit"
    assert [r["grad_norm"] for r in two_nodes] == [r["grad_norm"] for r in reference]
    assert two_nodes[-1]["loss"] < two_nodes[0]["loss"]


def test_multi_node_without_endpoint_or_scheduler_is_refused(data, tmp_path):
    plan = write_run_plan(data, tmp_path / "run", gpus=1, nodes=2)
    proc = subprocess.run([sys.executable, str(LAUNCHER), "--ranks", "1", "--plan", str(plan)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "train.rdzv_endpoint" in proc.stderr
    proc = subprocess.run([sys.executable, str(LAUNCHER), "--ranks", "1", "--plan", str(plan), "--node-rank", "2",
                           "--rdzv-endpoint", "127.0.0.1:1"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "node rank 2 is outside 0..1" in proc.stderr


def test_node_zero_hosts_the_rendezvous_store():
    cmd = torchrun_command(Path("pretrain.py"), [], ranks=4, nodes=8, max_restarts=0, rdzv_endpoint="gpu01:29400",
                           node_rank=0, rdzv_id="4242")
    assert {"--nnodes=8", "--rdzv-backend=c10d", "--rdzv-endpoint=gpu01:29400", "--rdzv-id=4242",
            "--rdzv-conf=is_host=true"} <= set(cmd)
    other = torchrun_command(Path("pretrain.py"), [], ranks=4, nodes=8, max_restarts=0,
                             rdzv_endpoint="gpu01:29400", node_rank=3)
    assert "--rdzv-conf=is_host=false" in other
    with pytest.raises(ValueError, match="not host:port"):
        torchrun_command(Path("pretrain.py"), [], ranks=4, nodes=8, max_restarts=0, rdzv_endpoint="gpu01")
