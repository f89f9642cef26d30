"""The fork server that forked CPU ranks come from (pretrain_bench.train.forked_ranks): a fork of the process that
starts it, with one thread, named in ps, which ends when that process stops it; and what torchrun's agent loads before
it forks the ranks."""
import json
import os
import subprocess
import sys

CODE = """
import os, threading, time
import psutil
from pretrain_bench.train import forked_ranks
# a thread of the starting process, as torchrun's agent runs its own: not copied into the fork server
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
pid = forked_ranks.start_fork_server()
server = psutil.Process(pid)
deadline = time.monotonic() + 30
while server.name() != forked_ranks.FORK_SERVER_NAME and time.monotonic() < deadline:  # named just after the fork
    time.sleep(0.01)
print(server.ppid() == os.getpid(), server.name(), server.num_threads(), psutil.Process().num_threads() > 1)
print(server.cmdline() == psutil.Process().cmdline())  # a fork of this process, not a fresh interpreter
forked_ranks.stop_fork_server()
print(psutil.pid_exists(pid))
"""


def test_the_fork_server_is_a_one_thread_fork_of_its_starter_and_ends_when_stopped():
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:3] == ["True fork-server 1 True", "True", "False"], proc.stdout


PRELOAD_CODE = """
import json, os, subprocess, sys
asked = []  # the py-cpuinfo interpreters started (`cpuinfo.py --json`), in this process and its fork
popen = subprocess.Popen.__init__
def counted(self, args, *a, **k):
    if "cpuinfo" in str(args):
        asked.append(os.getpid())
    return popen(self, args, *a, **k)
subprocess.Popen.__init__ = counted
import torch
from deepspeed.ops.op_builder.builder import OpBuilder
from pretrain_bench.train.engines.deepspeed_engine import DeepSpeedEngine
from pretrain_bench.train.settings import TrainSettings
DeepSpeedEngine.preload(TrainSettings(zero_stage=2, offload_optimizer=sys.argv[1], device="cpu"))
agent = {"asked": len(asked), "loaded": sorted(OpBuilder._loaded_ops)}
read, write = os.pipe()
if os.fork() == 0:  # a rank, forked after the preload
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    import cpuinfo
    optimizer = DeepSpeedCPUAdam([torch.nn.Parameter(torch.ones(4))])
    info = cpuinfo.get_cpu_info()
    info["vendor_id_raw"] = "changed by its reader"
    again = cpuinfo.get_cpu_info()["vendor_id_raw"] != "changed by its reader"
    os.write(write, json.dumps({"asked": len([p for p in asked if p == os.getpid()]), "again": again,
                                "vendor": optimizer.cpu_vendor}).encode())
    os._exit(0)
os.close(write)
os.wait()
print(json.dumps({"agent": agent, "rank": json.loads(os.read(read, 65536))}))
"""


def test_an_offloaded_launch_loads_cpu_adam_and_asks_the_cpu_once_before_the_ranks_fork():
    """Under train.offload_optimizer cpu, torchrun's agent (DeepSpeedEngine.preload) loads DeepSpeed's CPU Adam op
    and asks py-cpuinfo once (its one `cpuinfo.py --json` interpreter counted here shows the count works); a rank
    forked from it builds DeepSpeedCPUAdam without starting another (each about 1 CPU-s; DeepSpeed 0.19 started 3 a
    rank), and each reader gets its own copy of the answer."""
    proc = subprocess.run([sys.executable, "-c", PRELOAD_CODE, "cpu"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["agent"]["asked"] == 1 and "cpu_adam" in result["agent"]["loaded"], result["agent"]
    assert result["rank"]["asked"] == 0 and result["rank"]["again"], result["rank"]
    assert result["rank"]["vendor"] not in ("", "unknown", "changed by its reader")


def test_the_cpu_is_described_once_and_left_to_deepspeeds_fallback_where_py_cpuinfo_fails(monkeypatch):
    import cpuinfo

    from pretrain_bench.train.engines.deepspeed_engine import describe_cpu_once

    def failing():
        raise OSError("no /proc/cpuinfo")

    monkeypatch.setattr(cpuinfo, "get_cpu_info", failing)
    assert describe_cpu_once() is None and cpuinfo.get_cpu_info is failing  # DeepSpeed's lscpu fallback still runs
    asked = []

    def answering():
        asked.append(1)
        return {"vendor_id_raw": "GenuineIntel", "flags": ["avx2"]}

    monkeypatch.setattr(cpuinfo, "get_cpu_info", answering)
    first = describe_cpu_once()
    first["flags"].append("changed by its reader")
    assert describe_cpu_once() == cpuinfo.get_cpu_info() == answering() and len(asked) == 2  # the last: the test's own
    assert cpuinfo.get_cpu_info()["vendor_id_raw"] == "GenuineIntel" and cpuinfo.get_cpu_info() is not first
