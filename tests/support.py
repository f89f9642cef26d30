"""What several test modules need: running Snakemake on the tiny config, the merged tiny config, folder digests, and
plans launched on the training engine (tests/integration/test_engine.py, test_faults.py)."""
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import sysconfig
import uuid
from pathlib import Path

import pytest

from pretrain_bench.config_types import load_config
from pretrain_bench.tokenizer import EOS_TOKEN

ROOT = Path(__file__).resolve().parents[1]
TINY_CONFIG = "config/tiny-cpu.yaml"
# The one run of the whole tiny pipeline that the pipeline, evaluation and report tests share (conftest.pipeline): a
# short main run with two kept checkpoints (two points on the evaluation curves), both lm-eval tasks, and a benchmark
# matrix of 1 and 2 ranks × DeepSpeed ZeRO-2 and DDP × 2 repeats (8 launches; 2 ranks fit 2 cores). nccl cells and
# cells with a micro batch of 100,000 are declared too: they must be reported, not run.
PIPELINE_NAME = "itest-pipeline"
PIPELINE_STEPS = (10, 20)
PIPELINE_OVERLAY = {
    "name": PIPELINE_NAME,
    "train": {"max_steps": 20, "checkpoint_every": 10, "warmup_timing_steps": 2},
    "evaluate": {"max_tokens": 4096, "lm_eval": {"limit": 4, "tasks": ["pretrain_bench_last_word",
                                                                       "pretrain_bench_doc_perplexity"]}},
    # DDP beside DeepSpeed ZeRO-2: its cells collapse the ZeRO axis (one layout), see bench_matrix.cells
    "benchmark": {"repeats": 2, "matrix": {"gpus": [1, 2], "micro_batch_size": [8, 100000], "zero_stage": [2],
                                           "engine": ["deepspeed", "ddp"]}},
}
LAUNCHER = ROOT / "workflow_scripts" / "launch.py"


@contextlib.contextmanager
def engine_data_lock():
    """Held around Snakemake runs on the shared engine data (conftest `data`, results/itest-engine): under pytest-xdist
    two workers must not run Snakemake on the same files at once (Snakemake refuses to lock them)."""
    import fcntl

    path = ROOT / "results" / ".itest-engine.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_snakemake(name: str, *args, configfiles=(TINY_CONFIG,), check=True, timeout=3600, env=None):
    """`snakemake --cores 2 --resources gpu=3 --configfile … ARGS` in the repository; on failure the test fails
    showing Snakemake's stderr and the tail of every job log of run `name`."""
    cmd = [sys.executable, "-m", "snakemake", "--cores", "2", "--resources", "gpu=3",
           "--configfile", *map(str, configfiles), *args]
    env = dict(env or os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in (ROOT / "logs" / name).rglob("*.log"))
        pytest.fail(f"snakemake failed ({proc.returncode}):\n{proc.stderr[-4000:]}\n{logs}")
    return proc


def tiny_config(name: str) -> dict:
    """config.yaml with the tiny overlay applied the way Snakemake applies --configfile, validated (the schema's
    defaults filled in), and another name."""
    config = load_config(ROOT / "config.yaml", ROOT / TINY_CONFIG)
    config["name"] = name
    return config


def tree_digest(folder: Path, exclude: tuple[str, ...] = ()) -> str:
    """sha256 over every file's relative path and bytes: any write, rename or deletion changes it (files named in
    `exclude` left out)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file() and p.name not in exclude):
        digest.update(str(path.relative_to(folder)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def plan_for(data, run_dir: Path, **train):
    config, results = data
    # warmup_steps: the tiny config's 10 would not end before these short runs do (settings.check_settings)
    overrides = {"max_steps": 8, "checkpoint_every": 4, "warmup_timing_steps": 1, "warmup_steps": 2, **train}
    config = {**config, "train": {**config["train"], **overrides}}
    from pretrain_bench.plan import make_plan

    plan = make_plan(config, index=results / "shards" / "index.json", tokenizer=results / "tokenizer",
                     out_dir=run_dir / "out", state_dir=run_dir / "state")
    path = run_dir / "plan.json"
    plan.to_json(path)
    return path


def start(plan_path: Path, ranks: int, log: Path, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(LAUNCHER), "--ranks", str(ranks), "--plan", str(plan_path)],
                            cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})


def crash_after_first_checkpoint(plan_path: Path, run_dir: Path, log: Path) -> list[int]:
    """Launch the plan on 3 ranks, let it record two steps past its first committed checkpoint, then kill -9 every
    process of the job at once (launcher, torchrun, ranks); returns the committed steps left behind."""
    import time

    import psutil

    from pretrain_bench.checkpoint import committed_steps

    proc = start(plan_path, 3, log)
    deadline = time.monotonic() + 600
    while not ((steps := committed_steps(run_dir / "state" / "checkpoints"))
               and len(recorded_losses(run_dir)) >= steps[0] + 2):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    # crash hard: every process of the job at once
    root = psutil.Process(proc.pid)
    job = [root, *root.children(recursive=True)]
    assert len(job) >= 5, "launcher, torchrun and three ranks"
    for process in job:
        process.kill()
    proc.wait()
    psutil.wait_procs(job, timeout=30)
    assert not (run_dir / "out" / "summary.json").exists()
    return committed_steps(run_dir / "state" / "checkpoints")


def run(plan_path: Path, ranks: int, log: Path, timeout=600, env=None) -> int:
    proc = start(plan_path, ranks, log, env)
    try:
        return proc.wait(timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "state" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def recorded_losses(run_dir: Path) -> list[float]:
    """The losses of the complete records in metrics.jsonl so far: a run may be writing, or have been killed while
    writing, the last line."""
    path = run_dir / "state" / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line)["loss"] for line in text.split("\n")[:-1]]


@contextlib.contextmanager
def mounted_tmpfs(parent: Path, size: str, why_skip: str):
    """A real tmpfs of `size` under `parent` for the with-block (root only); the test is skipped, saying why, where
    none can be mounted."""
    mount = Path(parent) / f"tmpfs-{uuid.uuid4().hex[:8]}"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                                           capture_output=True).returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {why_skip}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


# Awkward documents every corpus meets sooner or later: non-ASCII, tabs and CRLF, a literal special-token string.
TRICKY_TEXTS = [
    "naïve café — 中文字符 and emoji 😀👩‍👩‍👧 in one line\n",
    "\tindented\r\n    four spaces\n\n\n        eight\n",
    f"a document that mentions {EOS_TOKEN} in its text",
    "",
]


def stdlib_texts(max_bytes: int) -> list[str]:
    """Python standard-library sources under 20 kB, in a fixed order, up to about max_bytes: a code corpus of
    many documents (one 200 kB module would otherwise be the whole corpus)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.glob("*.py")):
        if path.stat().st_size > 20_000:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text.encode())
        if total >= max_bytes:
            break
    return texts


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return path
