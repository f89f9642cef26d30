"""Device discovery, local GPU slot allocation and the process setup that goes with them.

Snakemake's `--resources gpu=3` counts GPUs but never says which ones a job may use, so two 1-GPU jobs would both
land on device 0. `allocate_slots` hands out disjoint device ids to concurrent local jobs through lock files
(`fcntl.flock`, released automatically if the job dies). Slots are taken from the devices this process may see:
the entries of CUDA_VISIBLE_DEVICES when the user set it (say "2,3" to keep the pipeline off two GPUs), else every
GPU. Only a scheduler's allocation of exactly the job's GPUs (SLURM sets CUDA_VISIBLE_DEVICES for them) is used as it
is; an allocation that holds more (local Snakemake inside sbatch or salloc) is shared out as slots.

Two ways to look for GPUs: `cuda_device_count` asks torch; `resolve_device_cheaply`, `nvidia_smi_memory` and
`gpu_names` ask nvidia-smi, so that DAG time and the pre-flight do not import torch where they can avoid it.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path


class SlotError(RuntimeError):
    """Not enough free device slots."""


def cuda_device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver is the same as no GPU for this purpose
        return 0


def resolve_device(requested: str) -> str:
    """'auto' → 'cuda' when a GPU is visible, else 'cpu'; 'cuda' without a GPU is an error."""
    if requested == "cpu":
        return "cpu"  # without importing torch, which costs a launch seconds before any rank starts
    count = cuda_device_count()
    if requested == "auto":
        return "cuda" if count else "cpu"
    if requested == "cuda" and not count:
        raise SlotError("train.device is cuda but no CUDA device is visible on this machine (set train.device: cpu)")
    return requested


def resolve_device_cheaply(requested: str) -> str:
    """cuda|cpu without importing torch unless a GPU driver is present (DAG time must stay fast)."""
    if requested != "auto":
        return requested
    if nvidia_smi_memory():
        return "cuda"
    if shutil.which("nvidia-smi") is None and os.path.exists("/dev/nvidiactl"):
        return "cuda" if cuda_device_count() else "cpu"
    return "cpu"


# The nvidia-smi fields planning reads, asked for in one call.
_NVIDIA_SMI_FIELDS = ("name", "memory.total", "memory.free")


@functools.lru_cache(maxsize=1)
def _nvidia_smi_table() -> tuple[tuple[str, ...], ...]:
    """(name, memory.total, memory.free in MiB) of every GPU nvidia-smi lists, from one call per process: a DAG build
    asks several times (device, budget of the matrix and of the main run, datasheet peak), and each nvidia-smi start
    costs from tens of milliseconds to seconds. () when there is no nvidia-smi or it fails."""
    if shutil.which("nvidia-smi") is None:
        return ()
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(_NVIDIA_SMI_FIELDS)}",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    # the memory is a number: a comma in a GPU's name stays in the name
    return tuple(tuple(value.strip() for value in line.rsplit(",", len(_NVIDIA_SMI_FIELDS) - 1))
                 for line in out.splitlines() if line.strip())


def _nvidia_smi(field: str) -> list[str]:
    """One nvidia-smi field per visible GPU ([] when there is none or no nvidia-smi)."""
    column = _NVIDIA_SMI_FIELDS.index(field)
    values = [row[column] for row in _nvidia_smi_table()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() and all(p.strip().isdigit() for p in visible.split(",")):
        values = [values[int(i)] for i in visible.split(",") if int(i) < len(values)]
    return values


def nvidia_smi_memory() -> list[int]:
    """Total memory in bytes of each visible GPU, from nvidia-smi ([] when there is none or no nvidia-smi)."""
    return [int(float(value)) * 1024**2 for value in _nvidia_smi("memory.total")]


def nvidia_smi_free_memory() -> list[int]:
    """Free memory in bytes of each visible GPU now, from nvidia-smi: its total less what other processes hold (a
    desktop's display, another user's job). [] when there is none, no nvidia-smi, or a figure it cannot give."""
    values = _nvidia_smi("memory.free")
    try:
        return [int(float(value)) * 1024**2 for value in values]
    except ValueError:  # "[N/A]" on some virtualised GPUs
        return []


def gpu_names() -> list[str]:
    """Names of the visible GPUs, from nvidia-smi ([] when there is none)."""
    return _nvidia_smi("name")


def usable_cpu_count() -> int:
    """The CPU cores this process may run on (its affinity mask: a scheduler's or taskset's share), at least 1."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _prctl(option: int, argument) -> None:
    """Linux's prctl(option, argument) for this process; elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, argument, 0, 0, 0)


def die_with_parent(signal_number: int = signal.SIGKILL) -> None:
    """Ask Linux to send this process `signal_number` when its parent dies (prctl PR_SET_PDEATHSIG); elsewhere a
    no-op. Called first thing in a rank, or as a child's preexec_fn, so a hard kill of a job leaves no orphans."""
    PR_SET_PDEATHSIG = 1
    _prctl(PR_SET_PDEATHSIG, signal_number)


def set_process_name(name: str) -> None:
    """This process's name as ps and top show it (prctl PR_SET_NAME, at most 15 bytes); elsewhere than Linux a
    no-op."""
    PR_SET_NAME = 15
    _prctl(PR_SET_NAME, name.encode()[:15])


# The launcher's and the evaluation rules' shared lock folder: training ranks and evaluations never share a GPU.
GPU_LOCK_DIR = Path(".pretrain-bench/gpu-slots")


def scheduler_owns_devices(count: int) -> bool:
    """True inside a scheduler's allocation (SLURM) that named exactly this job's `count` GPUs in
    CUDA_VISIBLE_DEVICES: a SLURM job per Snakemake job. Local Snakemake inside an sbatch script or an salloc step
    sees the whole allocation's GPUs there, which its concurrent jobs must share out as slots: trusted as one job's,
    every 1-GPU job would run on cuda:0."""
    return bool(os.environ.get("SLURM_JOB_ID")) and "CUDA_VISIBLE_DEVICES" in os.environ \
        and len(visible_device_ids()) == count


def visible_device_ids() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries (indices or UUIDs)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [entry.strip() for entry in visible.split(",") if entry.strip()]
    return [str(i) for i in range(cuda_device_count())]


@contextlib.contextmanager
def gpu_slots(count: int, lock_dir: Path = GPU_LOCK_DIR, *, timeout_s: float = 3600.0):
    """The CUDA_VISIBLE_DEVICES entries a job holds for the with-block; None when a scheduler assigned them."""
    if scheduler_owns_devices(count):
        yield None
        return
    with allocate_slots(count, visible_device_ids(), lock_dir, timeout_s=timeout_s) as ids:
        yield ids


@contextlib.contextmanager
def evaluation_device(requested: str, lock_dir: Path):
    """'cpu', or 'cuda:<index>' holding one GPU slot (gpu_slots) for the duration of the block: an evaluation's or
    the peak measurement's one device. Here, beside the slots, so that a module naming it imports no torch (the
    workflow plans without it: `snakemake -n` spent 1.3 s importing torch through the peak module).

    A scheduler's CUDA_VISIBLE_DEVICES is respected: the job then uses the first device it was given.
    """
    device = resolve_device(requested)
    if device != "cuda":
        yield "cpu"
        return
    import torch

    with gpu_slots(1, Path(lock_dir)) as ids:
        # torch numbers the visible devices 0..N-1: the slot's position in the visible list is its index
        index = 0 if ids is None else visible_device_ids().index(ids[0])
        torch.cuda.set_device(index)  # so that current_device() (hardware_description) names this GPU
        yield f"cuda:{index}"


@contextlib.contextmanager
def allocate_slots(count: int, devices: int | list[str], lock_dir: Path, *, timeout_s: float = 3600.0):
    """Hold `count` of `devices` (ids, or a count: ids 0..N-1) with lock files in lock_dir for the with-block.

    Waits (polling) until enough slots are free, so jobs that Snakemake starts together never share a device.
    Yields the list of ids held.
    """
    import time

    devices = list(range(devices)) if isinstance(devices, int) else list(devices)
    total = len(devices)
    if count > total:
        raise SlotError(f"job needs {count} devices but this machine has {total}"
                        + (f" visible (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']})"
                           if "CUDA_VISIBLE_DEVICES" in os.environ else ""))
    lock_dir = Path(lock_dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    while True:
        held: list[tuple[int, int]] = []
        for device_id in devices:
            fd = os.open(lock_dir / f"slot{device_id}.lock", os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            held.append((device_id, fd))
            if len(held) == count:
                break
        if len(held) == count:
            try:
                for _, fd in held:
                    os.ftruncate(fd, 0)
                    os.write(fd, f"{os.getpid()}\n".encode())
                yield [device_id for device_id, _ in held]
            finally:
                for _, fd in held:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    os.close(fd)
            return
        for _, fd in held:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        if time.monotonic() > deadline:
            raise SlotError(f"no {count} free device slots of {total} in {lock_dir} after {timeout_s:.0f} s")
        time.sleep(0.5)


def cpu_bf16_is_native() -> bool:
    """Whether this CPU's matmuls have native bf16, as oneDNN reports it (AVX-512 with its bf16 extension, or AMX);
    elsewhere they are emulated: converted and computed in fp32."""
    import torch

    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def emulated_bf16_note(device: str, precision: str, native=None) -> str | None:
    """A notice for a bf16 run on a CPU whose matmuls have no native bf16 (oneDNN reports none: AVX2 and older, or
    AVX-512 without its bf16 extension), or on a GPU without bf16 arithmetic (compute capability below 8.0: T4, V100),
    where they are emulated; None otherwise. `native`: the CPU check (a test's stand-in), by default oneDNN's own."""
    if precision != "bf16" or device not in ("cpu", "cuda"):
        return None
    import torch

    if device == "cuda":
        # torch counts a bf16 tensor that can merely be created as support unless told not to
        if (not torch.cuda.is_available() or torch.version.hip is not None
                or torch.cuda.is_bf16_supported(including_emulation=False)):
            return None  # no GPU to ask (a CPU build of torch), or one with bf16 arithmetic
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return (f"train.precision bf16 on {torch.cuda.get_device_name(index)} (compute capability "
                f"{props.major}.{props.minor}): "
                "GPUs before compute capability 8.0 (Ampere) have no bf16 arithmetic, so it is emulated, many times "
                "slower; train.precision fp16 is the choice on this GPU")

    if (native or cpu_bf16_is_native)():
        return None
    return ("train.precision bf16 on a CPU without native bf16 matmuls (oneDNN reports none; torch's CPU capability: "
            f"{torch.backends.cpu.get_cpu_capability()}): they are emulated, several times slower than fp32 "
            "(README: MFU); train.precision fp32 is the faster choice on this CPU")


def flush_denormals() -> bool:
    """Make this CPU process treat denormal floats (below 1.2e-38 in fp32 and bf16) as zero, in its inputs and results
    (x86's DAZ and FTZ; torch.set_flush_denormal), and return whether the CPU supports it (`denormals_flushed`
    measures whether it holds). Training produces denormals as it goes (in its tiny gradients and AdamW's second
    moments), and a CPU's arithmetic on them is many times slower: a 6-layer, 11M-parameter model's fp32 step on 2
    cores grew from 317 ms over its first 8 steps to 522 ms by step 40, and stayed at 210–270 ms with them flushed
    (README: "Denormal floats"). Called early in a rank's setup; tests/unit/test_cpu_math.py measures that it also
    holds on torch's intra-op threads started before the call."""
    import torch

    return torch.set_flush_denormal(True)


def denormals_flushed() -> bool:
    """Whether this process's CPU arithmetic treats denormal floats as zero, measured: a multiplication of a tensor of
    denormals large enough that torch's intra-op threads share it (all of them must flush)."""
    import torch

    denormals = torch.full((1 << 18,), 1e-39, dtype=torch.float32)
    return bool(denormals.mul(1.0).eq(0).all())


def hardware_description(device: str) -> dict:
    """What the run ran on, for provenance."""
    import platform

    info = {"device": device, "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "processor": _cpu_model()}
    if device == "cuda":
        import torch

        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        info.update(gpu_name=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda)
    return info


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    import platform

    return platform.processor() or "unknown"


def peer_access_pairs(count: int) -> list[tuple[int, int, bool]]:
    """(a, b, can a access b's memory directly) for every ordered pair of the first `count` visible GPUs."""
    import torch

    return [(a, b, bool(torch.cuda.can_device_access_peer(a, b)))
            for a in range(count) for b in range(count) if a != b]


# Run in a child with the job's CUDA_VISIBLE_DEVICES, so the launcher itself never holds a CUDA context on a GPU its
# ranks will use, and the devices probed are exactly the job's.
_PEER_PROBE = """
import json, sys
import torch
from pretrain_bench.core.devices import peer_access_pairs
count = torch.cuda.device_count()
if count < int(sys.argv[1]):
    sys.exit(f"{count} CUDA device(s) visible, the job has {sys.argv[1]}")
print(json.dumps(peer_access_pairs(int(sys.argv[1]))))
"""


def probe_peer_access(count: int, env: dict) -> tuple[list[tuple[int, int, bool]] | None, str | None]:
    """(pairs, None) from peer_access_pairs run in a child with `env` (the job's CUDA_VISIBLE_DEVICES), or
    (None, why the probe failed)."""
    library = str(Path(__file__).resolve().parents[2])
    child_env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [library, env.get("PYTHONPATH")]))}
    try:
        probe = subprocess.run([sys.executable, "-c", _PEER_PROBE, str(count)], env=child_env, capture_output=True,
                               text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"the probe did not run: {error}"
    if probe.returncode:
        lines = (probe.stderr or probe.stdout).strip().splitlines()
        return None, f"the probe failed: {lines[-1] if lines else f'exit status {probe.returncode}'}"
    return [tuple(pair) for pair in json.loads(probe.stdout.strip().splitlines()[-1])], None
