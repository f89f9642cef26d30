import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pretrain_bench.core.devices import SlotError, allocate_slots, gpu_slots
from pretrain_bench.train.checkpoints import files as ckpt
from pretrain_bench.train.launcher import forks_ranks, rank_environment, torchrun_command
from pretrain_bench.train.metrics import summarise_steps, truncate_jsonl
from pretrain_bench.train.run_context import LaunchContext
from pretrain_bench.train.settings import ConfigError, TrainSettings, check_settings

ROOT = Path(__file__).resolve().parents[2]


def make_ckpt(root, step, commit=True):
    folder = root / ckpt.tag_for(step)
    folder.mkdir(parents=True)
    (folder / "mp_rank_00_model_states.pt").write_bytes(b"x")
    if commit:
        ckpt.write_marker(root, step, {"world_size": 3})


def test_only_committed_checkpoints_count_and_prune_keeps_newest(tmp_path):
    for step in (10, 20, 30):
        make_ckpt(tmp_path, step)
    make_ckpt(tmp_path, 40, commit=False)  # crashed mid-save
    assert ckpt.committed_steps(tmp_path) == [10, 20, 30]
    assert ckpt.read_marker(tmp_path, 30)["world_size"] == 3
    with pytest.raises(ckpt.CheckpointError, match="step40 is missing or incomplete"):
        ckpt.read_marker(tmp_path, 40)
    assert ckpt.prune(tmp_path, keep=2) == [10]
    assert ckpt.committed_steps(tmp_path) == [20, 30]
    assert (tmp_path / "step40").is_dir(), "an incomplete checkpoint being written is never pruned"
    assert ckpt.prune(tmp_path, keep=None) == []


def _hold(count, total, lock_dir, queue, hold_s):
    with allocate_slots(count, total, lock_dir, timeout_s=30) as ids:
        queue.put((time.monotonic(), ids))
        time.sleep(hold_s)
        queue.put((time.monotonic(), ids))


def test_concurrent_jobs_get_disjoint_device_slots(tmp_path):
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_hold, args=(1, 3, tmp_path, queue, 0.6)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(20)
    events = [queue.get(timeout=5) for _ in range(6)]
    ids = sorted(tuple(e[1]) for e in events[:])
    assert sorted({i for i in ids}) == [(0,), (1,), (2,)], "three 1-GPU jobs at once hold three different GPUs"


def _hold_visible(lock_dir, queue, hold_s):
    with gpu_slots(1, lock_dir, timeout_s=30) as ids:
        queue.put(tuple(ids))
        time.sleep(hold_s)


def three_jobs_hold_a_slot(tmp_path) -> list[tuple]:
    """The visible devices three gpu=1 jobs, started together in processes of their own, each held."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_hold_visible, args=(tmp_path, queue, 0.6)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(20)
    return sorted(queue.get(timeout=5) for _ in range(3))


def test_slots_come_from_the_users_visible_devices(tmp_path, monkeypatch):
    # The user keeps the pipeline on GPUs 4, 5 and 6 of a bigger machine; three gpu=1 jobs start together.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    held = three_jobs_hold_a_slot(tmp_path)
    assert held == [("4",), ("5",), ("6",)], "three distinct devices, all inside the visible set"
    visible = r"needs 4 devices but this machine has 3 visible \(CUDA_VISIBLE_DEVICES=4,5,6\)"
    with pytest.raises(SlotError, match=visible):
        with gpu_slots(4, tmp_path):
            pass
    # inside a SLURM allocation of exactly the job's GPUs the scheduler's choice stands: no slot is taken
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    with gpu_slots(3, tmp_path) as ids:
        assert ids is None


def test_local_snakemake_inside_a_slurm_allocation_shares_its_gpus_out_as_slots(tmp_path, monkeypatch):
    # salloc --gres=gpu:3, then snakemake on the allocation's node: every job sees the allocation's three GPUs, and
    # three 1-GPU jobs (training, evaluation, peak) start together
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_GPUS", "1,2,3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    held = three_jobs_hold_a_slot(tmp_path)
    assert held == [("0",), ("1",), ("2",)], "each 1-GPU job on its own GPU, not all on cuda:0"
    # a job the size of the allocation takes it as the scheduler gave it
    with gpu_slots(3, tmp_path) as ids:
        assert ids is None
    with pytest.raises(SlotError, match="needs 4 devices but this machine has 3 visible"):
        with gpu_slots(4, tmp_path):
            pass


def test_slot_allocation_waits_then_times_out(tmp_path):
    with allocate_slots(2, 2, tmp_path) as held:
        assert held == [0, 1]
        with pytest.raises(SlotError, match="no 1 free device slots of 2"):
            with allocate_slots(1, 2, tmp_path, timeout_s=0.3):
                pass
    with pytest.raises(SlotError, match="needs 4 devices but this machine has 2"):
        with allocate_slots(4, 2, tmp_path):
            pass


def test_launch_context_threads_and_oversubscription():
    context = LaunchContext.for_job("cpu", ranks=3, cores=2)
    assert context.threads_per_rank == 1 and context.oversubscribed and context.pin_memory
    env = rank_environment(context, base={})
    assert env["DS_ACCELERATOR"] == "cpu" and env["OMP_NUM_THREADS"] == "1"
    context = LaunchContext.for_job("cpu", ranks=2, cores=16)
    assert context.threads_per_rank == 8 and not context.oversubscribed
    assert rank_environment(context, base={})["OMP_NUM_THREADS"] == "8"
    assert "DS_ACCELERATOR" not in rank_environment(LaunchContext.for_job("cuda", 3, 16), {})
    assert not any(key.startswith("PRETRAIN_BENCH_") for key in env), "the ranks get the context on their command line"


def test_the_launch_context_reaches_the_rank_as_it_was_decided():
    context = LaunchContext(device="cuda", threads_per_rank=5, oversubscribed=False, pin_memory=False)
    assert LaunchContext.from_json(context.to_json()) == context
    with pytest.raises(ValueError, match=r"missing \['pin_memory'\], unknown \['pin'\]"):
        LaunchContext.from_json('{"device": "cpu", "threads_per_rank": 1, "oversubscribed": true, "pin": true}')


def test_torchrun_single_node_uses_standalone_free_port():
    cmd = torchrun_command(Path("pretrain.py"), ["--plan", "p.json"], ranks=3, nodes=1, max_restarts=2)
    assert "--standalone" in cmd and "--nproc-per-node=3" in cmd and "--max-restarts=2" in cmd
    assert not any(c.startswith("--master-port") or c.startswith("--rdzv-endpoint") for c in cmd)
    multi = torchrun_command(Path("pretrain.py"), [], ranks=1, nodes=2, max_restarts=0, rdzv_endpoint="h:29500")
    assert "--rdzv-endpoint=h:29500" in multi and "--nnodes=2" in multi
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        torchrun_command(Path("pretrain.py"), [], ranks=1, nodes=2, max_restarts=0)


def test_cpu_ranks_are_forked_from_torchruns_agent_and_cuda_ranks_are_fresh_interpreters():
    exec_cmd = torchrun_command(Path("pretrain.py"), ["--plan", "p.json"], ranks=3, nodes=1, max_restarts=2)
    forked = torchrun_command(Path("pretrain.py"), ["--plan", "p.json"], ranks=3, nodes=1, max_restarts=2,
                              forked=True)
    assert exec_cmd[1:3] == ["-m", "torch.distributed.run"]
    assert forked[1:3] == ["-m", "pretrain_bench.train.forked_ranks"]
    assert forked[3:] == exec_cmd[3:], "the same torchrun options, script and arguments"
    assert [forks_ranks(start, device) for start in ("auto", "fork", "exec") for device in ("cpu", "cuda")] == \
        [True, False, True, True, False, False]
    check_settings(TrainSettings(rank_start="fork", comm_backend="gloo"), "cpu")
    check_settings(TrainSettings(rank_start="exec"), "cuda")
    with pytest.raises(ConfigError, match="train.rank_start fork is for CPU ranks"):
        check_settings(TrainSettings(rank_start="fork"), "cuda")


def test_summary_excludes_warmup_and_resume_step(tmp_path):
    records = [{"step": s, "loss": 10.0 - s, "step_time_s": t, "forward_s": 0.1, "backward_s": 0.2,
                "optimizer_s": 0.05, "after_resume": s == 5}
               for s, t in [(1, 9.0), (2, 1.0), (3, 1.0), (4, 2.0), (5, 7.0), (6, 1.0)]]
    summary = summarise_steps(records, warmup_steps=1, tokens_per_step=100)
    assert summary["steady_steps"] == 4  # steps 2, 3, 4, 6
    assert summary["tokens_per_s"] == pytest.approx(400 / 5.0)
    assert summary["step_time_s"]["median"] == 1.0 and summary["step_time_s"]["max"] == 2.0
    assert summary["loss"] == {"first": 9.0, "last": 4.0, "min": 4.0}
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    truncate_jsonl(path, 3)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]


def test_pinned_memory_is_turned_off_where_torch_cannot_pin_exactly():
    from pretrain_bench.train.launcher import exact_pinning

    # this machine's torch has no CUDA: the probe fails, so offloaded buffers are not pinned (and never rounded)
    additions, pin_memory, note = exact_pinning(dict(os.environ))
    assert additions == {} and pin_memory is False and "pinned host memory off" in note


def test_stale_torch_extension_locks_are_removed_fresh_ones_kept(tmp_path):
    from pretrain_bench.train.launcher import clear_stale_extension_locks

    stale = tmp_path / "deepspeed_shm_comm" / "lock"
    fresh = tmp_path / "cpu_adam" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir()
        lock.touch()
    hour_ago = time.time() - 3600
    os.utime(stale, (hour_ago, hour_ago))
    assert clear_stale_extension_locks(root=tmp_path) == [stale]
    assert not stale.exists() and fresh.exists(), "a build in progress keeps its lock"
    assert clear_stale_extension_locks(root=tmp_path / "missing") == []


def test_the_launcher_finds_the_extension_cache_and_the_cpu_device_without_importing_torch(tmp_path):
    # in a fresh interpreter: the launcher runs before every rank, and importing torch there costs seconds
    code = ("import sys\n"
            "from pretrain_bench.train.launcher import extension_build_root\n"
            "from pretrain_bench.core.devices import resolve_device\n"
            "print(extension_build_root(), resolve_device('cpu'), 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    root, device, imported = out.stdout.split()
    assert (root, device, imported) == (str(Path(sys.prefix) / "torch_extensions"), "cpu", "False"), \
        "this environment's own cache (the test venv is writable), not the one all environments share"
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == str(tmp_path)


def test_ranks_load_deepspeeds_ops_from_the_environments_cache_where_make_install_built_them(monkeypatch):
    from torch.utils.cpp_extension import get_default_build_root

    from pretrain_bench.train.launcher import extension_build_root

    base = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    env = rank_environment(LaunchContext.for_job("cpu", ranks=3, cores=2), base=base)
    assert env["TORCH_EXTENSIONS_DIR"] == str(Path(sys.prefix) / "torch_extensions")
    # what `make install` runs: DeepSpeed's CPU ops are (already, after make install) in that directory
    code = ("from pretrain_bench.train.launcher import build_cpu_ops; print(*build_cpu_ops())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=base, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-2:] == ["ShareMemCommBuilder", "CPUAdamBuilder"]
    root = Path(env["TORCH_EXTENSIONS_DIR"])
    assert (root / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").is_file()
    assert (root / "cpu_adam" / "cpu_adam.so").is_file()
    alone = LaunchContext.for_job("cpu", 1, 2)
    assert rank_environment(alone, dict(base, TORCH_EXTENSIONS_DIR="/x"))["TORCH_EXTENSIONS_DIR"] == "/x"
    # the environment's own ninja first, whatever PATH the job had: another ninja version would rebuild the ops
    own_bin = str(Path(sys.executable).parent)
    path = rank_environment(alone, dict(base, PATH=f"/usr/bin:{own_bin}:/bin"))["PATH"]
    assert path == f"{own_bin}:/usr/bin:/bin"
    assert Path(shutil.which("ninja", path=path)).parent == Path(own_bin), "deepspeed's dependency ninja is there"
    # an environment this user cannot write to (a system Python): torch's own default, shared
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    assert extension_build_root(environ={}) == Path(get_default_build_root())


def test_a_rank_gives_up_on_a_stale_build_lock_and_waits_for_a_live_one(tmp_path, monkeypatch):
    from torch.utils import file_baton

    from pretrain_bench.train.launcher import wait_out_stale_build_locks

    monkeypatch.setattr(file_baton.FileBaton, "wait", file_baton.FileBaton.wait)  # restored after the test
    wait_out_stale_build_locks(max_age_s=60)
    stale = tmp_path / "lock"
    stale.touch()
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    started = time.monotonic()
    file_baton.FileBaton(str(stale)).wait()  # left by a killed rank: removed, no wait
    assert not stale.exists() and time.monotonic() - started < 5
    live = tmp_path / "live-lock"
    live.touch()
    import threading

    threading.Timer(0.5, live.unlink).start()  # the builder finishes
    started = time.monotonic()
    file_baton.FileBaton(str(live), wait_seconds=0.05).wait()
    assert 0.4 < time.monotonic() - started < 5, "a live lock is waited for"
