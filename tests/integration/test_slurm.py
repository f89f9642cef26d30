"""The tiny pipeline on a real SLURM cluster, through `--profile profiles/slurm` (snakemake-executor-plugin-slurm).

The cluster (tests/slurm_cluster.py) is Debian's slurm-wlm + munge, started here for the module: two
nodes on this machine, 2 CPUs and 3 (file-backed) `gpu` GRES each, no accounting. First the pipeline up to training
runs on one node (every job an sbatch allocation, training 3 gloo ranks), then training again on both nodes (one
torchrun agent per node through srun, c10d rendezvous on the first node found with `scontrol show hostnames`).
Installs slurm-wlm and munge when missing (root + apt-get); skips only when that is impossible, and fails instead
where PRETRAIN_BENCH_REQUIRE_SLURM=1 (CI).
"""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_cluster import SlurmCluster, ensure_slurm
from support import (
    LAUNCHER,
    SNAKEFILE,
    TINY_CONFIG,
    data_folders,
    job_logs,
    read_jsonl,
    snakemake_env,
    workflow_dir,
    write_yaml,
)

pytestmark = pytest.mark.slurm

NAME = "itest-slurm"
STEPS = 20
SUBMITTED = re.compile(r"Job \d+ has been submitted with SLURM jobid (\d+) \(log: \S*/rule_(\w+)/")


@pytest.fixture(scope="module")
def cluster():
    reason = ensure_slurm()
    if reason and os.environ.get("PRETRAIN_BENCH_REQUIRE_SLURM") == "1":  # CI (.ci/run) installs them: must run
        pytest.fail(reason)
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(nodes=2, cpus=2, gpus=3)
    cluster.start()
    yield cluster
    daemons = [proc for _, proc in cluster.daemons]
    cluster.stop()
    assert all(proc.poll() is not None for proc in daemons), "munged, slurmctld and the slurmds are stopped"
    shutil.rmtree(cluster.folder, ignore_errors=True)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The working directory of both runs (the SLURM jobs run there too)."""
    return workflow_dir(tmp_path_factory.mktemp("slurm") / "workflow")


def results(workdir: Path) -> Path:
    return workdir / "results" / NAME


def snakemake(cluster, workdir, tmp_path, train: dict, *args) -> str:
    """Run the tiny pipeline up to training with the SLURM profile; returns Snakemake's output."""
    overlay = write_yaml(tmp_path / "overlay.yaml", {"name": NAME, "train": {
        "max_steps": STEPS, "checkpoint_every": 10, "warmup_timing_steps": 2, "micro_batch_size": 8, **train}})
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(SNAKEFILE), f"results/{NAME}/train/summary.json",
           f"results/{NAME}/train/hf", "--profile", "profiles/slurm", "--configfile", TINY_CONFIG, str(overlay),
           # The test nodes: 2 CPUs and 16 GB each. Status checks 1 s after submission and 1 s after a check that
           # saw a job finish (squeue stays reliable while MinJobAge >= 3 x this delay); the plugin adds 10 s to the
           # pause after each check that saw none, which this cluster's squeue absorbs by answering when a job ends
           # (tests/slurm_cluster.py).
           "--cores", "2", "--set-resources", "pretrain:mem_mb=4000", "pretrain:runtime=30",
           "--slurm-init-seconds-before-status-checks", "1", "--seconds-between-status-checks", "1",
           "--rerun-triggers", "mtime", "params", *args]
    proc = subprocess.run(cmd, cwd=workdir, env=snakemake_env(cluster.env), capture_output=True, text=True,
                          timeout=1500)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"snakemake failed ({proc.returncode}):\n{output[-5000:]}\n{job_logs(workdir)}\n{cluster.logs()}")
    return output


def submitted_jobs(output: str) -> dict[str, list[str]]:
    """rule → SLURM job ids, from Snakemake's output."""
    jobs: dict[str, list[str]] = {}
    for job_id, rule in SUBMITTED.findall(output):
        jobs.setdefault(rule, []).append(job_id)
    return jobs


@pytest.fixture(scope="module")
def single_node(cluster, workdir, tmp_path_factory):
    output = snakemake(cluster, workdir, tmp_path_factory.mktemp("single"), {})
    return output, (workdir / "logs" / NAME / "pretrain.log").read_text()


@pytest.fixture(scope="module")
def two_nodes(cluster, workdir, single_node, tmp_path_factory):
    # Same corpus, tokenizer and shards; a new plan and a fresh training state (the old one has world size 3).
    shutil.rmtree(results(workdir) / "state", ignore_errors=True)
    # the edited train.nodes/gpus reach plan_pretrain as params: Snakemake replans without being told
    output = snakemake(cluster, workdir, tmp_path_factory.mktemp("two"), {"nodes": 2, "gpus": 1})
    return output, (workdir / "logs" / NAME / "pretrain.log").read_text()


def test_every_job_ran_as_a_slurm_job(cluster, single_node):
    output, _ = single_node
    jobs = submitted_jobs(output)
    # corpus.jobs is null and the tiny config's cap stops one job before a part's share of the files: one corpus job
    assert set(jobs) == {"download_corpus", "train_tokenizer", "shard_tokens", "index_shards",
                         "measure_peak", "plan_pretrain", "pretrain", "export_final"}, output[-3000:]
    assert len(jobs["shard_tokens"]) == 4  # 2 shards × train/val
    run_names = set()
    for rule, ids in jobs.items():
        for job_id in ids:
            job = cluster.job(job_id)
            assert job["JobState"] == "COMPLETED" and job["Comment"].startswith(f"rule_{rule}"), job
            run_names.add(job["JobName"])
    assert len(run_names) == 1, "one Snakemake run: all jobs carry its run id as job name"


def test_training_ranks_ran_inside_the_slurm_allocation(cluster, single_node):
    output, log = single_node
    (job_id,) = submitted_jobs(output)["pretrain"]
    job = cluster.job(job_id)
    # The GPU request of rule pretrain (train.gpus) reached sbatch as --gpus; one node, `cores` CPUs.
    assert job["NumNodes"] == "1" and job["TresPerJob"] == "gres:gpu:3" and job["CPUs/Task"] == "2", job
    assert f"SLURM_JOB_ID={job_id} node={job['NodeList']}" in log, log[-3000:]
    assert "--nproc-per-node=3" in log and "--standalone" in log


def test_single_node_training_outputs(workdir, single_node):
    run = results(workdir)
    summary = json.loads((run / "train" / "summary.json").read_text())
    records = read_jsonl(run / "train" / "metrics.jsonl")
    assert summary["world_size"] == 3 and summary["nodes"] == 1 and summary["device"] == "cpu"
    assert summary["steps"] == STEPS and [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert summary["loss"]["last"] < summary["loss"]["first"] - 0.5
    assert summary["tokens_per_step"] == 24 * 128
    assert (run / "train" / "hf" / "config.json").exists()
    index = json.loads((data_folders(workdir).shards / "index.json").read_text())
    assert index["splits"]["train"]["shards"] and index["splits"]["val"]["shards"]


def test_two_node_training_through_srun_and_rendezvous_on_the_first_node(cluster, workdir, two_nodes):
    output, log = two_nodes
    jobs = submitted_jobs(output)
    assert set(jobs) == {"plan_pretrain", "pretrain", "export_final"}, "upstream outputs were reused"
    (job_id,) = jobs["pretrain"]
    job = cluster.job(job_id)
    assert job["JobState"] == "COMPLETED" and job["NumNodes"] == "2" and job["NumTasks"] == "2", job
    hosts = cluster.nodes
    assert job["NodeList"] == ",".join(hosts), job
    # train.gpus GPUs on every node (--gres per node), train.gpus × train.nodes for the job (--gpus)
    assert job["TresPerNode"] == "gres:gpu:1" and job["TresPerJob"] == "gres:gpu:2", job
    assert "launch: srun --nodes=2 --ntasks=2 --ntasks-per-node=1" in log, log[-3000:]
    endpoint = re.search(rf"--rdzv-endpoint {re.escape(hosts[0])}:(\d+)", log)
    assert endpoint, log[-3000:]
    for task, host in enumerate(hosts):  # srun --label prefixes every line with the task (= node) number
        assert f"{task}: SLURM_JOB_ID={job_id} node={host}" in log, log[-3000:]
        assert f"{task}: node rank {task} of 2, rendezvous {hosts[0]}:{endpoint.group(1)}" in log
    summary = json.loads((results(workdir) / "train" / "summary.json").read_text())
    records = read_jsonl(results(workdir) / "train" / "metrics.jsonl")
    assert summary["world_size"] == 2 and summary["nodes"] == 2 and summary["global_batch_size"] == 16
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert summary["loss"]["last"] < summary["loss"]["first"] - 0.5


def test_multi_node_plan_in_a_one_node_allocation_is_refused(cluster, workdir, two_nodes):
    plan = results(workdir) / "train" / "plan.json"  # train.nodes = 2, left by the two-node run
    proc = subprocess.run(["srun", "--nodes=1", "--ntasks=1", sys.executable, str(LAUNCHER),
                           "--ranks", "1", "--plan", str(plan)], cwd=workdir, env=snakemake_env(cluster.env),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and re.search(r"train.nodes=2 but SLURM job \d+ holds 1 node", proc.stderr), proc.stderr
