"""CUDA paths, taken on CPU: bf16 support without emulation and which GPU pairs may talk peer to peer (against a
monkeypatched torch.cuda), and the comms logger's records staying one step's worth (gloo)."""
import types

import pytest
import torch


@pytest.fixture
def volta(monkeypatch):
    """torch.cuda as on a V100 (compute capability 7.0): bf16 tensors can be created (emulated), not computed."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(major=7, minor=0))
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100-SXM2-16GB")


def test_bf16_evaluation_falls_back_to_fp16_where_bf16_is_only_emulated(volta):
    from pretrain_bench.evaluate.evaluation import supported_precision

    assert torch.cuda.is_bf16_supported(), "torch's default counts the emulation as support"
    precision, note = supported_precision("bf16", "cuda:0")
    assert precision == "fp16"
    assert note == "evaluate.precision bf16 is not supported by Tesla V100-SXM2-16GB: evaluated in fp16"


def test_bf16_evaluation_stays_bf16_on_ampere_and_later(volta, monkeypatch):
    from pretrain_bench.evaluate.evaluation import supported_precision

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(major=9, minor=0))
    assert supported_precision("bf16", "cuda:0") == ("bf16", None)


def test_bf16_training_on_a_gpu_that_only_emulates_it_is_flagged_by_name(volta, monkeypatch):
    from pretrain_bench.core.devices import emulated_bf16_note

    note = emulated_bf16_note("cuda", "bf16")
    assert note == ("train.precision bf16 on Tesla V100-SXM2-16GB (compute capability 7.0): GPUs before compute "
                    "capability 8.0 (Ampere) have no bf16 arithmetic, so it is emulated, many times slower; "
                    "train.precision fp16 is the choice on this GPU")
    assert emulated_bf16_note("cuda", "fp16") is None
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(major=8, minor=9))
    assert emulated_bf16_note("cuda", "bf16") is None, "Ada and later run bf16 natively"


def test_a_cuda_steps_peak_is_the_reserved_memory_with_the_allocated_beside_it(monkeypatch, tmp_path):
    """Trainer.gather_step and record as on a GPU (torch.cuda's peaks monkeypatched, gathered over gloo)."""
    import torch.distributed as dist

    from pretrain_bench.train.metrics import peak_memory_per_rank
    from support import bare_cuda_trainer

    reserved, allocated = 22 * 2**30 + 123 * 2**20, 19 * 2**30 + 5
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: reserved)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: allocated)
    trainer = bare_cuda_trainer(tmp_path, None)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        gathered = trainer.gather_step(1, torch.tensor([2.5]))
    finally:
        dist.destroy_process_group()
    record = trainer.record(1, gathered, 1.0, dict.fromkeys(("forward", "backward", "optimizer")), None, 0)
    assert record["peak_mem_bytes"] == [reserved] and record["peak_mem_allocated_bytes"] == [allocated]
    assert peak_memory_per_rank([record], 1, "peak_mem_allocated_bytes") == [allocated]


@pytest.fixture
def three_gpus_two_linked(monkeypatch):
    """torch.cuda with GPUs 0 and 1 linked peer to peer (NVLink) and GPU 2 reachable only through the host."""
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: {a, b} == {0, 1})


def test_peer_access_is_asked_for_every_ordered_pair_of_the_jobs_gpus(three_gpus_two_linked):
    from pretrain_bench.core.devices import peer_access_pairs

    assert peer_access_pairs(3) == [(0, 1, True), (0, 2, False), (1, 0, True), (1, 2, False), (2, 0, False),
                                    (2, 1, False)]
    assert peer_access_pairs(1) == []


def _in_process_probe(count, env):
    from pretrain_bench.core.devices import peer_access_pairs

    return peer_access_pairs(count), None


def test_p2p_is_disabled_only_where_a_pair_of_the_jobs_gpus_lacks_peer_access(three_gpus_two_linked):
    from pretrain_bench.train.launcher import nccl_peer_environment

    additions, note = nccl_peer_environment({}, {}, 3, probe=_in_process_probe)
    assert additions == {"NCCL_P2P_DISABLE": "1"}
    assert note.endswith("without peer access (torch.cuda.can_device_access_peer): 0->2, 1->2, 2->0, 2->1")
    additions, note = nccl_peer_environment({}, {}, 2, probe=_in_process_probe)
    assert additions == {} and note.startswith("GPU peer to peer on: all 2 GPUs of the job reach each other")


def test_a_p2p_setting_given_by_the_user_is_kept_and_one_gpu_is_not_probed():
    from pretrain_bench.train.launcher import nccl_peer_environment

    def never(count, env):
        raise AssertionError("probed although the user decided")

    assert nccl_peer_environment({"NCCL_P2P_DISABLE": "0"}, {}, 3, probe=never) == (
        {}, "NCCL_P2P_DISABLE=0 as train.nccl_env sets it")
    assert nccl_peer_environment({}, {"NCCL_P2P_DISABLE": "1"}, 3, probe=never) == (
        {}, "NCCL_P2P_DISABLE=1 as the environment sets it")
    assert nccl_peer_environment({}, {}, 1, probe=never)[0] == {}


def test_a_failed_peer_probe_disables_p2p_and_names_the_failure():
    import os

    from pretrain_bench.train.launcher import nccl_peer_environment

    # the real probe, in a child, on this machine's torch, which sees no CUDA device
    additions, note = nccl_peer_environment({}, dict(os.environ), 2)
    assert additions == {"NCCL_P2P_DISABLE": "1"}
    assert note == ("NCCL_P2P_DISABLE=1: peer access between the job's GPUs could not be probed (the probe failed: "
                    "0 CUDA device(s) visible, the job has 2)")


COMMS_SCRIPT = """
import json, os, sys
os.environ.update(DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[1])
import torch, deepspeed
from deepspeed.comm import comm as ds_comm
from pretrain_bench.train.engines.registry import deepspeed_comm_ms as comm_ms
deepspeed.init_distributed(dist_backend="gloo")
ds_comm.configure(enabled=True, prof_all=True)  # as the comms_logger block of a measured run's ds_config
held, totals = [], []
for step in range(40):
    before = comm_ms()
    for _ in range(3):
        deepspeed.comm.all_reduce(torch.ones(1024))
    deepspeed.comm.broadcast(torch.ones(16), src=0)
    held.append([len(ds_comm.timers(name).event_timers) for name in ("all_reduce", "broadcast")]
                + [sum(len(r[1]) for r in by_size.values()) for by_size in ds_comm.comms_logger.comms_dict.values()])
    totals.append([before, comm_ms()])
print(json.dumps({"held": held, "totals": totals}))
"""


def test_the_comms_logger_holds_one_steps_records_however_many_steps_ran():
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", COMMS_SCRIPT, "29731"], capture_output=True, text=True, timeout=300,
                          cwd=root / "workflow_scripts")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # each step's 3 all-reduces and 1 broadcast, never the steps before: the timers' start/stop pairs, the logger's
    # latency lists
    assert all(held == [3, 1, 3, 1] for held in result["held"]), result["held"]
    totals = result["totals"]
    assert all(after > before for before, after in totals), "each step's collectives add their time"
    assert all(later[0] == earlier[1] for earlier, later in zip(totals, totals[1:])), "nothing is lost between steps"


class TimelineEvent:
    """torch.cuda.Event stand-in on a simulated GPU timeline: record() stamps the stream's current time."""
    now_ms = 0.0
    synchronized: list = []

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self):
        self.at = TimelineEvent.now_ms

    def synchronize(self):
        TimelineEvent.synchronized.append(self)

    def elapsed_time(self, other):
        return other.at - self.at


def test_ddp_comm_on_cuda_is_timed_by_events_that_pass_when_the_all_reduce_has_finished(monkeypatch):
    from pretrain_bench.train.engines.registry import CommIntervals, CudaEventClock

    monkeypatch.setattr(torch.cuda, "Event", TimelineEvent)
    TimelineEvent.synchronized = []
    comm = CommIntervals(CudaEventClock())
    # two buckets launched at 0 and 1 ms of GPU time; NCCL "completes" their futures at once on the host, but the
    # callbacks' events pass only after the all-reduces, at 4 and 6 ms; a third bucket is still in flight
    TimelineEvent.now_ms = 0.0
    first = comm.launched()
    TimelineEvent.now_ms = 1.0
    second = comm.launched()
    TimelineEvent.now_ms = 4.0
    comm.completed(first)
    TimelineEvent.now_ms = 6.0
    comm.completed(second)
    third = comm.launched()
    assert comm.total_ms() == 6.0, "overlapping buckets count once, from the first launch to the last completion"
    assert TimelineEvent.synchronized == [first[1], second[1]], "only finished intervals are waited for"
    TimelineEvent.now_ms = 9.0
    comm.completed(third)
    assert comm.total_ms() == 9.0 and comm.pending == []


def test_ddp_comm_on_cpu_is_the_union_of_host_clock_intervals(monkeypatch):
    import time

    from pretrain_bench.train.engines.registry import CommIntervals, HostClock

    clock = iter([0.0, 0.001, 0.004, 0.006, 0.010, 0.011])  # seconds
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    comm = CommIntervals(HostClock())
    first, second = comm.launched(), comm.launched()
    comm.completed(first)
    comm.completed(second)
    third = comm.launched()
    comm.completed(third)
    assert comm.total_ms() == pytest.approx(7.0)  # [0, 4] ∪ [1, 6] ∪ [10, 11]


def test_the_pinning_probe_names_the_real_failure():
    import os

    from pretrain_bench.train.launcher import exact_pinning

    # the real probe, in a child, on this machine's torch: it has no CUDA, and the line says so instead of blaming
    # pinned-block rounding
    additions, pin_memory, note = exact_pinning(dict(os.environ))
    assert additions == {} and pin_memory is False
    assert note == ("pinned host memory off: AssertionError: Torch not compiled with CUDA enabled (offload copies "
                    "are slower, RAM exact)")


def test_pinning_merges_its_option_into_both_allocator_names_keeping_the_users_settings(monkeypatch):
    import subprocess

    from pretrain_bench.train import launcher

    probed = []

    def probe(cmd, env, **kwargs):  # a CUDA box whose torch has the option: the probe succeeds
        probed.append(env)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(launcher.subprocess, "run", probe)
    # the user's setting under the name torch reads second: torch 2.13 reads PYTORCH_CUDA_ALLOC_CONF first, so
    # setting only that one would drop expandable_segments silently
    user = {"PATH": "/usr/bin", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    additions, pin_memory, note = launcher.exact_pinning(user)
    merged = "expandable_segments:True,pinned_max_round_threshold_mb:64"
    assert additions == {"PYTORCH_CUDA_ALLOC_CONF": merged, "PYTORCH_ALLOC_CONF": merged} and pin_memory
    assert probed[0]["PYTORCH_CUDA_ALLOC_CONF"] == merged, "the probe tries what the ranks will get"
    assert note == f"pinned host memory at exact sizes: PYTORCH_CUDA_ALLOC_CONF={merged} PYTORCH_ALLOC_CONF={merged}"
    # each name keeps its own settings; one the user set already is not set twice; nothing set: the option alone
    both = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128", "PYTORCH_ALLOC_CONF": "pinned_max_round_threshold_mb:8"}
    assert launcher.allocator_conf_with(both, launcher.PINNED_EXACT_OPTION) == {
        "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,pinned_max_round_threshold_mb:64",
        "PYTORCH_ALLOC_CONF": "pinned_max_round_threshold_mb:8"}
    assert launcher.allocator_conf_with({}, launcher.PINNED_EXACT_OPTION) == dict.fromkeys(
        launcher.ALLOCATOR_CONF_KEYS, "pinned_max_round_threshold_mb:64")


OPS_PROBE = """
import json, os, sys
import torch, torch.utils.cpp_extension
torch.cuda.is_available = lambda: True  # torch sees a GPU ...
torch.version.cuda = "12.8"
torch.utils.cpp_extension.CUDA_HOME = None  # ... and no CUDA toolkit is installed
os.environ["DS_ACCELERATOR"] = "cuda"
from deepspeed.ops.op_builder.all_ops import ALL_OPS  # the builders DeepSpeed's setup.py asks, one by one


def answers():
    found = {}
    for name, builder in ALL_OPS.items():
        try:
            found[name] = bool(builder.is_compatible())
        except Exception as error:
            found[name] = type(error).__name__
    return found


# each environment in turn, added to this one (the builders read it when asked)
rounds = []
for added in json.loads(sys.argv[1]):
    os.environ.update(added)
    rounds.append(answers())
print(json.dumps(rounds))
"""


def test_make_install_asks_deepspeeds_op_builders_nothing_that_needs_a_cuda_toolkit():
    import json
    import os
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    recipe = subprocess.run(["make", "-n", "--always-make", ".venv/.installed"], cwd=root, capture_output=True,
                            text=True, check=True).stdout
    line = next(line for line in recipe.splitlines() if "-r requirements.txt" in line)
    words = shlex.split(line)
    install_env = dict(word.split("=", 1) for word in words[:words.index(".venv/bin/python")])
    assert install_env == {"DS_BUILD_OPS": "0", "DS_IGNORE_CUDA_DETECTION": "1"}
    bare = {k: v for k, v in os.environ.items() if k not in install_env}
    # the builders asked without the install's environment, then with it, in one interpreter started without it
    proc = subprocess.run([sys.executable, "-c", OPS_PROBE, json.dumps([{}, install_env])], env=bare,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    without, with_install_env = json.loads(proc.stdout.strip().splitlines()[-1])
    # without the install's environment the probe that setup.py runs raises on a GPU machine without a toolkit
    assert without["fp_quantizer"] == "MissingCUDAException"
    raised = {name: answer for name, answer in with_install_env.items() if isinstance(answer, str)}
    assert raised == {}
