"""What several test modules need: the tiny pipeline's Snakemake runs in working directories of their own (never the
repository's results/), the tiny data built once per session and copied into them, the merged tiny config, folder
digests, and plans launched on the training engine (tests/integration/test_engine.py, test_faults.py)."""
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from pretrain_bench.data.products import DataProducts
from pretrain_bench.data.tokenizer import EOS_TOKEN
from pretrain_bench.workflow.experiment import load_config

ROOT = Path(__file__).resolve().parents[1]
SNAKEFILE = ROOT / "Snakefile"
TINY_CONFIG = "config/tiny-cpu.yaml"
# What the workflow and the tests name relative to the working directory (the Snakefile's `configfile: config.yaml`,
# `--configfile config/tiny-cpu.yaml`, `--profile profiles/slurm`): linked into every test's working directory. What
# a run writes there (results/, logs/, benchmarks/, resources/, .snakemake/) stays out of the repository, whose own
# folders of that kind the suite checks it left alone (tests/conftest.py).
WORKFLOW_LINKS = ("config.yaml", "config", "profiles")
RUN_OUTPUTS = ("results", "logs", "benchmarks", "resources", ".snakemake")
# The run name the tiny data (corpus → tokenizer → shards of config/tiny-cpu.yaml) is built with once per session
# (conftest `tiny_data`). The data products live under results/data/, shared by every name with the same data settings.
DATA_NAME = "itest"
# The one run of the whole tiny pipeline that the pipeline, evaluation, report and demo tests share
# (conftest.pipeline): the demo's main run as config/tiny-cpu.yaml trains it (its model and train blocks unchanged:
# test_demo_learns checks that it learns), its two kept checkpoints (two points on the evaluation curves), both lm-eval
# tasks, and a benchmark matrix of 1 and 2 ranks × DeepSpeed ZeRO-2 and DDP × 2 repeats (8 launches; 2 ranks fit 2
# cores) of PIPELINE_BENCH_STEPS steps each, the first 2 untimed (the tiny config's benchmark.warmup_steps). nccl
# cells and cells with a micro batch of 100,000 are declared too: they must be reported, not run.
PIPELINE_NAME = DATA_NAME
TINY_TRAIN = load_config(ROOT / "config.yaml", ROOT / TINY_CONFIG)["train"]  # as tiny_config() has it, validated
PIPELINE_STEPS = tuple(range(TINY_TRAIN["checkpoint_every"], TINY_TRAIN["max_steps"] + 1,
                             TINY_TRAIN["checkpoint_every"]))  # the main run's kept checkpoints
# The main run's micro batch: the tiny config's (4 per rank, a global batch of 12 on 3 ranks). The benchmark matrix
# below declares it, so its cells are named as the main run's (no -mb<n>), and benchmark.search tries it and 4 × it.
PIPELINE_MICRO_BATCH = TINY_TRAIN["micro_batch_size"]
PIPELINE_BENCH_STEPS = 4
PIPELINE_OVERLAY = {
    "name": PIPELINE_NAME,
    "evaluate": {"max_tokens": 4096, "lm_eval": {"limit": 4, "tasks": ["pretrain_bench_last_word",
                                                                       "pretrain_bench_doc_perplexity"]}},
    # DDP beside DeepSpeed ZeRO-2: its cells collapse the ZeRO axis (one layout), see bench_matrix.cells
    "benchmark": {"repeats": 2, "steps": PIPELINE_BENCH_STEPS,
                  "matrix": {"gpus": [1, 2], "micro_batch_size": [PIPELINE_MICRO_BATCH, 100000], "zero_stage": [2],
                             "engine": ["deepspeed", "ddp"]}},
}
LAUNCHER = ROOT / "workflow_scripts" / "launch.py"


def workflow_dir(folder: Path) -> Path:
    """`folder` (created) as a working directory for the repository's workflow: the files it names relative to the
    working directory are linked in, nothing else."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in WORKFLOW_LINKS:
        (folder / name).symlink_to(ROOT / name)
    return folder


def seeded_workflow_dir(folder: Path, data: Path) -> Path:
    """A working directory (workflow_dir) holding a copy of the tiny data built in working directory `data`: its
    results/data/ (corpus, tokenizer, shards) with their modification times (Snakemake's mtime trigger) and
    Snakemake's records of the jobs that wrote them (its params, code and input triggers), so that a run with the tiny
    data settings there, whatever its name, finds them up to date, and builds new ones only where its config changes
    what they are made from."""
    workflow_dir(folder)
    shutil.copytree(data / "results" / "data", folder / "results" / "data")
    shutil.copytree(data / ".snakemake" / "metadata", folder / ".snakemake" / "metadata")
    return folder


def data_products(*overlays: dict, configfiles=(TINY_CONFIG,)) -> DataProducts:
    """The data products (ids and folders) of the config `configfiles` make, with `overlays` merged in as further
    --configfile files would be (the tiny config's by default)."""
    from snakemake.utils import update_config

    from pretrain_bench.config.schema import SCHEMA_PATH, fill_defaults_and_validate, load_schema

    config = load_config(ROOT / "config.yaml", *(ROOT / path for path in configfiles))
    for overlay in overlays:
        update_config(config, overlay)
    from pretrain_bench.workflow.experiment import Config

    settings = Config.from_config(fill_defaults_and_validate(config, load_schema(SCHEMA_PATH)))
    return DataProducts.from_config(settings.corpus, settings.tokenizer, settings.shards, settings.model.init_from)


def data_folders(workdir: Path, products: DataProducts | None = None) -> SimpleNamespace:
    """The corpus, tokenizer and shards folders of `products` (the tiny data's by default) in working directory
    `workdir`."""
    products = products or data_products()
    results = Path(workdir) / "results"
    return SimpleNamespace(corpus=results / products.corpus, tokenizer=results / products.tokenizer,
                           shards=results / products.shards)


def snakemake_command(*args, configfiles=(TINY_CONFIG,), cores: int = 2) -> list[str]:
    """`snakemake --snakefile <repository>/Snakefile --cores N --resources gpu=3 --configfile … ARGS`, for a working
    directory made by workflow_dir."""
    return [sys.executable, "-m", "snakemake", "--snakefile", str(SNAKEFILE), "--cores", str(cores),
            "--resources", "gpu=3", "--configfile", *map(str, configfiles), *args]


def snakemake_env(env=None) -> dict:
    """The environment a user's shell gives Snakemake: this interpreter's bin/ first on PATH."""
    env = dict(env or os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return env


def run_snakemake(workdir: Path, *args, configfiles=(TINY_CONFIG,), check=True, timeout=3600, env=None):
    """snakemake_command(ARGS) in `workdir`; on failure the test fails showing Snakemake's stderr and the tail of
    every job log there."""
    proc = subprocess.run(snakemake_command(*args, configfiles=configfiles), cwd=workdir, capture_output=True,
                          text=True, env=snakemake_env(env), timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"snakemake failed ({proc.returncode}):\n{proc.stderr[-4000:]}\n{job_logs(workdir)}")
    return proc


def job_logs(workdir: Path) -> str:
    """The tail of every job log under `workdir`/logs, each headed by its path."""
    return "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted((Path(workdir) / "logs").rglob("*.log")))


def scheduled_rules(proc: subprocess.CompletedProcess) -> set[str]:
    """Rules a `snakemake -n` run would run, or a real run ran, from its job-stats table (empty when it has nothing
    to do)."""
    out = proc.stdout + proc.stderr
    if "Nothing to be done" in out:
        return set()
    table = out.split("Job stats:")[1].split("total")[0]
    return {m.group(1) for m in re.finditer(r"^(\w+)\s+\d+\s*$", table, re.M)}


def write_yaml(path: Path, content: dict) -> Path:
    path.write_text(yaml.safe_dump(content))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_outputs_snapshot(root: Path = ROOT) -> dict[str, int]:
    """Every path under `root`'s RUN_OUTPUTS folders with its modification time (ns): what a Snakemake run there
    creates or rewrites changes it."""
    snapshot = {}
    for top in RUN_OUTPUTS:
        for folder, _dirs, files in os.walk(root / top):
            for path in (Path(folder), *(Path(folder, name) for name in files)):  # a folder's mtime: its entries
                with contextlib.suppress(FileNotFoundError):
                    snapshot[str(path.relative_to(root))] = path.lstat().st_mtime_ns
    return snapshot


def changed_run_outputs(before: dict[str, int], root: Path = ROOT) -> list[str]:
    """The paths under `root`'s RUN_OUTPUTS folders created or modified since `before` (run_outputs_snapshot)."""
    after = run_outputs_snapshot(root)
    return sorted(path for path, mtime in after.items() if before.get(path) != mtime)


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


def plan_for(data, run_dir: Path, save_checkpoints: bool = True, **train):
    """A plan of the tiny config with short-run `train` overrides, written to `run_dir`/plan.json (returned);
    save_checkpoints False: a run that saves no checkpoint (for a test that reads none)."""
    config, results = data
    # warmup_steps: the tiny config's 10 would not end before these short runs do (settings.check_settings)
    # lr 3e-3: the demo's 1.5e-2 amplifies float rounding differences between engines past the comparisons' 1e-5
    overrides = {"max_steps": 8, "checkpoint_every": 4, "warmup_timing_steps": 1, "warmup_steps": 2,
                 "lr": 3.0e-3, "min_lr": 3.0e-4, **train}
    config = {**config, "train": {**config["train"], **overrides}}
    from pretrain_bench.train.plan import make_plan
    from pretrain_bench.workflow.experiment import plan_config

    plan = make_plan(plan_config(config), index=results.shards / "index.json", tokenizer=results.tokenizer,
                     out_dir=run_dir / "out", state_dir=run_dir / "state", save_checkpoints=save_checkpoints)
    path = run_dir / "plan.json"
    plan.to_json(path)
    return path


# tiny-moe's balance loss and bias update both on, larger than DeepSeek-V3's so that a few steps move them
MOE_OVERRIDES = {"aux_loss_alpha": 0.01, "bias_update_rate": 0.01}


def moe_plan_for(data, run_dir: Path, overrides: dict | None = None, save_checkpoints: bool = True, **train):
    """plan_for with the model tiny-moe, native (the class with the balance loss, the bias update and the load
    counts), and MOE_OVERRIDES (updated by `overrides`)."""
    config, results = data
    model = {**config["model"], "preset": "tiny-moe", "implementation": "native",
             "overrides": {**MOE_OVERRIDES, **(overrides or {})}}
    return plan_for(({**config, "model": model}, results), run_dir, save_checkpoints, **train)


def rank_startups(log: Path) -> list[dict]:
    """The start-up records (pretrain_bench.core.logs.log_startup) that a launch's ranks wrote to its log `log`."""
    from pretrain_bench.core.logs import read_startups

    return [record for record in read_startups(log.read_text()) if "rank" in record]


def start(plan_path: Path, ranks: int, log: Path, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(LAUNCHER), "--ranks", str(ranks), "--plan", str(plan_path)],
                            cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})


def crash_after_first_checkpoint(plan_path: Path, run_dir: Path, log: Path, ranks: int = 3) -> list[int]:
    """Launch the plan on `ranks` ranks, let it record two steps past its first committed checkpoint, then kill -9
    every process of the job at once (launcher, torchrun, ranks); returns the committed steps left behind."""
    import time

    import psutil

    from pretrain_bench.train.checkpoints.files import committed_steps

    proc = start(plan_path, ranks, log)
    deadline = time.monotonic() + 600
    while not ((steps := committed_steps(run_dir / "state" / "checkpoints"))
               and len(recorded_losses(run_dir)) >= steps[0] + 2):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    # crash hard: every process of the job at once
    root = psutil.Process(proc.pid)
    job = [root, *root.children(recursive=True)]
    assert len(job) >= 2 + ranks, f"launcher, torchrun and {ranks} ranks"
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


@contextlib.contextmanager
def read_only_folder(folder: Path):
    """`folder` made read-only for real: a read-only tmpfs mounted on it (root, whom permission bits do not stop),
    else its write permission taken away."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
                          capture_output=True).returncode:
            pytest.skip("cannot mount a read-only tmpfs here")
        try:
            yield folder
        finally:
            subprocess.run(["umount", "-l", str(folder)], check=True)
    else:
        folder.chmod(0o555)
        try:
            yield folder
        finally:
            folder.chmod(0o755)


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


class RandomBatches:
    """Token batches of `batch` × (`seq_len` + 1) random ids from a seeded generator: the same sequence every run."""

    def __init__(self, vocab_size: int, batch: int, seq_len: int, seed: int = 0):
        import torch

        self.generator = torch.Generator().manual_seed(seed)
        self.shape, self.vocab_size = (batch, seq_len + 1), vocab_size

    def next_batch(self):
        import torch

        return torch.randint(0, self.vocab_size, self.shape, generator=self.generator)


def built_once(tmp_path_factory, name: str, build) -> Path:
    """Folder `name` in the session's temporary folder, made by `build(folder)` once per session: under pytest-xdist
    the first worker to ask builds it, the others wait for it and reuse it. Read it, never write to it: copy it first.
    """
    from filelock import FileLock  # a dependency of torch

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # pytest-<N>/popen-gw<K>: pytest-<N> is this session's, common to its workers
    folder, built = shared / name, shared / f"{name}.built"
    with FileLock(shared / f"{name}.lock"):
        if not built.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            built.touch()
    return folder


def bare_plan_config(train, name: str = "run", preset: str = "tiny"):
    """A plan config of `train` (TrainSettings) with every other block at its defaults: for a Plan a test writes by
    hand."""
    from pretrain_bench.config.schema import (
        BenchSettings,
        ModelSettings,
        ReportSettings,
        ShardSettings,
        TokenizerSettings,
    )
    from pretrain_bench.train.plan import PlanConfig

    return PlanConfig.of(name, ModelSettings(preset=preset), train, TokenizerSettings(), BenchSettings(),
                         ReportSettings(), ShardSettings())


def bare_cuda_trainer(tmp_path: Path, grad_norm=None):
    """A Trainer with only what gather_step and record read, as on a 1-rank CUDA run whose device is the CPU (for a
    test that fakes torch.cuda's memory figures); `grad_norm`: what its engine reports."""
    import types

    from pretrain_bench.train.checkpoints.checkpointer import Checkpointer
    from pretrain_bench.train.settings import TrainSettings
    from pretrain_bench.train.trainer import Trainer

    settings = TrainSettings()
    trainer = Trainer.__new__(Trainer)
    trainer.__dict__.update(
        engine=types.SimpleNamespace(grad_norm=lambda: grad_norm, skipped_steps=0, lr=lambda: 1e-3,
                                     loss_scale=lambda: None),
        settings=settings, rank=0, world=1, device="cuda", run_device="cpu", inject_nan_step=0, start_step=0,
        preemption=types.SimpleNamespace(requested=False), comm_steady_ms=0.0, all_to_all_steady_ms=0.0,
        steady_time_s=0.0,
        tokens_per_step=100, heldout=None, flops_token=6.0e6, peak={"flops_per_rank": 1.0e12, "source": "test"},
        checkpointer=Checkpointer(tmp_path, settings, seq_len=8, rank=0, world=1, run_device="cpu", fingerprint={},
                                  saves=False, log=print))
    return trainer
