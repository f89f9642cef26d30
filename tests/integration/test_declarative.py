"""Edit the config, rerun: Snakemake reruns exactly what depends on the edit, and the outputs follow it.

One tiny pipeline is run to the end; then one key per config section is edited (each its own overlay) and
`snakemake -n` must schedule the rules that read that key and no others. Then edits are run for real: more steps
continue training (run with no virtualenv on PATH, as `.venv/bin/snakemake` may be started), evaluation, benchmark
and report edits show up in their outputs without retraining, and a new learning rate and model shape start a fresh
run beside the old one (`--forcerun pretrain` on a finished run: test_faults.py).
"""
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain_bench.train.checkpoints.files import committed_steps
from support import (
    DATA_NAME,
    SNAKEFILE,
    TINY_CONFIG,
    data_products,
    read_jsonl,
    run_snakemake,
    scheduled_rules,
    seeded_workflow_dir,
    snakemake_command,
    tree_digest,
    workflow_dir,
    write_yaml,
)

pytestmark = pytest.mark.pipeline

NAME = DATA_NAME  # in a working directory of its own, from a copy of the tiny data
# Small and quick: one rank, 6 steps (2 of learning-rate warm-up, 1 left out of the timing), a checkpoint every 3 of
# which the last is kept (so each training evaluates one), no held-out loss while training, one benchmark cell, no
# lm-eval, a short evaluation. What these tests prove does not depend on the number of ranks or steps; resume across
# ranks is test_engine's.
STEPS, MORE_STEPS = 6, 9
BASE = {"name": NAME, "train": {"gpus": 1, "max_steps": STEPS, "checkpoint_every": 3, "keep_checkpoints": 1,
                                "warmup_steps": 2, "warmup_timing_steps": 1, "eval_every": None},
        "evaluate": {"lm_eval": {"tasks": []}, "max_tokens": 4096, "prompts": ["def main("],
                     "generation": {"max_new_tokens": 8}},
        "benchmark": {"matrix": {"gpus": [1], "comm_backend": ["gloo"]}, "steps": 4, "warmup_steps": 1}}
TRAINING = {"plan_pretrain", "pretrain", "evaluate", "report"}
DATA = {"download_corpus", "train_tokenizer", "shard_tokens", "index_shards"}
BENCH = {"plan_bench_cell", "bench_cell"}


@pytest.fixture(scope="module")
def overlays(tmp_path_factory):
    folder = tmp_path_factory.mktemp("overlays")

    def write(name: str, content: dict) -> Path:
        return write_yaml(folder / f"{name}.yaml", content)
    return write


@pytest.fixture(scope="module")
def edits(tiny_data, tmp_path_factory) -> Path:
    """The working directory of the edited runs."""
    return seeded_workflow_dir(tmp_path_factory.mktemp("edits") / "workflow", tiny_data)


@pytest.fixture(scope="module")
def finished_copy(tmp_path_factory) -> Path:
    """Where `finished` copies the finished run's working directory, before any test edits it."""
    return tmp_path_factory.mktemp("finished") / "workflow"


@pytest.fixture(scope="module")
def finished(edits, overlays, finished_copy):
    base = overlays("base", BASE)
    snakemake(edits, base)
    shutil.copytree(edits, finished_copy, symlinks=True)
    return base


def snakemake(workdir, *overlays, args=(), env=None, check=True):
    return run_snakemake(workdir, *args, configfiles=(TINY_CONFIG, *overlays), env=env, check=check)


def scheduled(workdir, *overlays) -> set[str]:
    """Rules `snakemake -n` would run (from its job-stats table)."""
    return scheduled_rules(snakemake(workdir, *overlays, args=("-n",))) - {"all"}


EDITS = {  # section: (edit, rules that must rerun, rules that must not)
    "corpus": ({"corpus": {"min_chars": 40}}, DATA | TRAINING | BENCH, set()),
    "tokenizer": ({"tokenizer": {"vocab_size": 3000}}, DATA - {"download_corpus"} | TRAINING | BENCH,
                  {"clean_corpus_part", "download_corpus"}),
    "model": ({"model": {"overrides": {"num_hidden_layers": 3}}}, TRAINING | BENCH | {"bench_matrix"}, DATA),
    "train": ({"train": {"lr": 5.0e-3}}, TRAINING | BENCH, DATA | {"bench_matrix", "measure_peak"}),
    "evaluate": ({"evaluate": {"prompts": ["def main(", "class Queue:"]}}, {"evaluate", "report"},
                 DATA | BENCH | {"plan_pretrain", "pretrain"}),
    "benchmark": ({"benchmark": {"steps": 5}}, BENCH | {"bench_matrix", "report"},
                  DATA | {"plan_pretrain", "pretrain", "evaluate"}),
    "report": ({"report": {"target_corpus_tokens": 2.0e+12}}, {"report"},
               DATA | BENCH | {"plan_pretrain", "pretrain", "evaluate", "bench_matrix"}),
}


def test_a_finished_run_has_nothing_to_do(edits, finished):
    assert scheduled(edits, finished) == set()


@pytest.mark.parametrize("section", sorted(EDITS))
def test_one_edit_per_section_reruns_exactly_its_dependants(edits, finished, overlays, section):
    edit, must, must_not = EDITS[section]
    rules = scheduled(edits, finished, overlays(section, edit))
    assert must <= rules, f"{section}: {sorted(must - rules)} should rerun"
    assert not rules & must_not, f"{section}: {sorted(rules & must_not)} should not rerun"
    if section == "report":
        assert rules == {"report"}


def summary(workdir):
    return json.loads((workdir / "results" / NAME / "train" / "summary.json").read_text())


def pretrain_log(workdir) -> str:
    return (workdir / "logs" / NAME / "pretrain.log").read_text()


def losses(workdir) -> list[float]:
    return [record["loss"] for record in read_jsonl(workdir / "results" / NAME / "train" / "metrics.jsonl")]


def test_more_steps_continue_the_run_started_without_the_venv_on_path(edits, finished, overlays):
    results = edits / "results" / NAME
    more = overlays("more-steps", {"train": {"max_steps": MORE_STEPS}})
    # .venv/bin/snakemake started directly, no activated venv: every rule must still find torch
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    cmd = [str(Path(sys.executable).parent / "snakemake"), "--snakefile", str(SNAKEFILE), "--cores", "2",
           "--resources", "gpu=3", "--configfile", TINY_CONFIG, str(finished), str(more)]
    proc = subprocess.run(cmd, cwd=edits, capture_output=True, text=True, env=env, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:] + pretrain_log(edits)[-3000:]
    assert summary(edits)["steps"] == MORE_STEPS and summary(edits)["resumed_from_step"] == STEPS
    assert "resumed from" in pretrain_log(edits) and (results / "eval" / f"step{MORE_STEPS}.json").is_file()
    assert committed_steps(results / "state" / "checkpoints") == [MORE_STEPS]  # train.keep_checkpoints: 1
    assert scheduled(edits, finished, more) == set()


def test_evaluation_benchmark_and_report_edits_show_in_their_outputs(edits, finished, overlays):
    results = edits / "results" / NAME
    more = overlays("more-steps", {"train": {"max_steps": MORE_STEPS}})
    trained = (results / "train" / "summary.json").stat().st_mtime
    outputs = overlays("outputs", {"evaluate": {"prompts": ["def main(", "class Queue:"]},
                                   "benchmark": {"steps": 5}, "report": {"target_corpus_tokens": 2.0e+12}})
    snakemake(edits, finished, more, outputs)
    assert (results / "train" / "summary.json").stat().st_mtime == trained, "no retraining"
    generations = json.loads((results / "eval" / f"step{MORE_STEPS}.json").read_text())["generations"]
    assert [g["prompt"] for g in generations if g["mode"] == "greedy"] == ["def main(", "class Queue:"]
    cell = json.loads((results / "bench" / "ranks1-zero2-fp32-gloo" / "rep1" / "summary.json").read_text())
    assert cell["steps"] == 5
    assert "report.target_corpus_tokens = 2e12 tokens" in (results / "report" / "report.md").read_text()


def test_new_learning_rate_and_shape_start_fresh_and_keep_the_old_run(edits, finished, overlays):
    results = edits / "results" / NAME
    more = overlays("more-steps", {"train": {"max_steps": MORE_STEPS}})
    old_losses = losses(edits)
    changed = overlays("changed", {"train": {"lr": 5.0e-3}, "model": {"overrides": {"num_hidden_layers": 3}}})
    # the training alone, which is all this test reads (the other outputs' edits: the test above)
    snakemake(edits, finished, more, changed, args=("--", f"results/{NAME}/train/summary.json"))
    log = pretrain_log(edits)
    assert "the settings changed since the run in" in log and "train.lr" in log and "model" in log
    kept = re.search(r"that run is kept in (\S+);", log).group(1)
    assert committed_steps(edits / kept / "checkpoints") == [MORE_STEPS]  # the old run, whole
    new = summary(edits)
    assert new["resumed_from_step"] is None and new["model"]["layers"] == 3 and new["steps"] == MORE_STEPS
    new_losses = losses(edits)
    assert len(new_losses) == MORE_STEPS and new_losses != old_losses
    plan = json.loads((results / "train" / "plan.json").read_text())
    assert plan["train"]["lr"] == 5.0e-3 and plan["model"]["overrides"] == {"num_hidden_layers": 3}


def dry_run_default(folder: Path, *args) -> subprocess.CompletedProcess:
    """`snakemake -n` on the default experiment (config.yaml), as the README shows it; no GPU here."""
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(SNAKEFILE), "-n", "--cores", "32", *args]
    return subprocess.run(cmd, cwd=workflow_dir(folder / "workflow"), capture_output=True, text=True, timeout=300)


def test_readme_train_only_override_on_eight_gpus(tmp_path):
    proc = dry_run_default(tmp_path, "--resources", "gpu=8", "--config", 'benchmark={"enabled": false}',
                           'train={"gpus": 8}')
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert re.search(r"rule pretrain:.*?resources: [^\n]*gpu=8", out, re.S), "8 ranks, global batch derived"
    assert "rule bench_cell:" not in out and "rule bench_matrix:" not in out and "rule report:" in out
    assert "rule measure_peak:" in out  # the machine's peak: the main run's MFU divides by it
    assert "benchmark matrix (0 launches): off" in out
    # printed by -n: 16Ψ/8 fits each 24 GiB GPU, so nothing is offloaded
    assert "memory fit: asked ZeRO-2" in out and "; ran ZeRO-3, micro-batch 8 × 1 accumulation" in out


def test_dry_run_prints_the_memory_choice_and_the_cost_of_the_matrix(tmp_path):
    proc = dry_run_default(tmp_path, "--resources", "gpu=3")
    out = proc.stdout + proc.stderr
    assert "memory fit: asked ZeRO-2" in out and "because the settings asked for are predicted not to fit" in out
    # ZeRO-3's offloads need more than 128 GiB of host RAM in fp16: ZeRO-2 + CPU offload with activation
    # checkpointing runs, and its offload terms (host Adam, PCIe) are in the predicted time, with formula and figures
    assert "ran ZeRO-2 + CPU optimizer offload + activation checkpointing" in out
    main = re.search(r"main run \(rule pretrain\): ~ (.+?) at 100 % MFU, .+; offload ([\d.,]+) s per step "
                     r"\(host Adam ([\d.,]+) s \+ PCIe ([\d.,]+) s \+ NVMe ([\d.,]+) s\)", out)
    assert main and float(main.group(3)) > 0 and float(main.group(4)) > 0 and float(main.group(5)) == 0
    assert "offload per step = host Adam Ψ ÷ (R × cores)" in out
    # the host Adam runs on the articles' box's 16 cores (benchmark.host_cores), not on this machine's
    assert "× 16 cores (assumed: benchmark.host_cores, no GPU detected here)" in out
    # the cells the main run's choice can run (ZeRO-2 + offload + checkpointing on 1 and 3 cards, NCCL and Gloo)
    # launch; the others are counted with what they lack
    # (and the plain single-device baseline, DDP on one card: 7B's 16Ψ does not fit 24 GiB)
    assert ("; 4 of 17 cells run, left out: 13 predicted not to fit 24.0 GiB per GPU (assumed) / 128.0 GiB host RAM "
            "(assumed) (9 short "
            "of GPU memory, 4 short of host RAM)") in out
    assert "benchmark matrix (12 launches): ~ " in out and out.count("rule bench_cell:") == 12
    assert all(f"results/deepseek7b-3gpu/bench/ranks{g}-zero2-fp16-{b}-offload-ckpt/rep{r}/summary.json" in out
               for g in (1, 3) for b in ("nccl", "gloo") for r in (1, 2, 3))


def test_dry_run_of_a_matrix_that_does_not_fit_says_so_and_how_to_launch_it(tmp_path):
    proc = dry_run_default(tmp_path, "--resources", "gpu=3", "--config",
                           'benchmark={"matrix": {"activation_checkpointing": [false]}}')
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert ("benchmark matrix (0 launches): 0 of 17 cells run: 17 predicted not to fit 24.0 GiB per GPU (assumed) / "
            "128.0 GiB host RAM (assumed) (13 short of GPU memory, 4 short of host RAM), set benchmark.force: true "
            "to launch them anyway (each with its reason in bench/matrix.json)") in out
    assert out.count("rule bench_cell:") == 0 and "rule bench_matrix:" in out  # matrix.json lists the 17 and why


# --- continuing from another run: its results are read, never built or deleted with this config ---
# A is the tiny data's run (a copy of the data in the working directory), B another run beside it.
SIBLING_A, SIBLING_B = DATA_NAME, "itest-sibling-b"


def test_continuing_from_a_sibling_export_builds_nothing_of_the_sibling(finished, finished_copy, overlays):
    """Run A is the finished run (BASE, named SIBLING_A), in a copy of its own working directory."""
    workdir, base, export = finished_copy, finished, f"results/{SIBLING_A}/train/hf"
    assert (workdir / export / "model.safetensors").is_file()
    sibling = {top: tree_digest(workdir / top / SIBLING_A) for top in ("results", "logs", "benchmarks")}
    continued = overlays("b", {"name": SIBLING_B, "model": {"init_from": export}})
    run_snakemake(workdir, "--", f"results/{SIBLING_B}/train/summary.json",
                  configfiles=(TINY_CONFIG, base, continued))
    assert {top: tree_digest(workdir / top / SIBLING_A) for top in sibling} == sibling, "run A was written to"
    summary_b = json.loads((workdir / "results" / SIBLING_B / "train" / "summary.json").read_text())
    assert summary_b["init_from"]["uri"] == export and summary_b["init_from"]["path"] == export
    assert summary_b["init_from"]["loaded"]["files"], "B started from A's weights"
    plan_b = json.loads((workdir / "results" / SIBLING_B / "train" / "plan.json").read_text())
    tokenizer = json.loads((workdir / plan_b["data"]["tokenizer"] / "tokenizer.json").read_text())
    assert tokenizer == json.loads((workdir / export / "tokenizer.json").read_text()), "A's tokenizer adopted"
    # A's export is a plain input of B now: B has nothing left to do, and still nothing of A is scheduled
    dry = run_snakemake(workdir, "-n", "--", f"results/{SIBLING_B}/train/summary.json",
                        configfiles=(TINY_CONFIG, base, continued))
    assert "Nothing to be done" in dry.stdout + dry.stderr


def test_a_missing_sibling_export_names_the_command_that_builds_it(overlays, tmp_path):
    missing, continued = "itest-sibling-missing", "itest-sibling-c"
    folder = workflow_dir(tmp_path / "workflow")
    overlay = overlays("c", {"name": continued, "model": {"init_from": f"results/{missing}/train/hf"}})
    proc = run_snakemake(folder, configfiles=(TINY_CONFIG, overlay), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert (f"run {missing!r} has not written it yet" in out
            and f"--config name={missing} -- results/{missing}/train/hf" in out), out[-3000:]
    assert not (folder / "results" / missing).exists() and not (folder / "logs" / continued).exists()
    # the same for a tokenizer taken from another run
    overlay = overlays("c-tokenizer", {"name": continued, "tokenizer": {"path": f"results/{missing}/tokenizer"}})
    proc = run_snakemake(folder, "-n", configfiles=(TINY_CONFIG, overlay), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"tokenizer.path results/{missing}/tokenizer: run {missing!r} keeps no tokenizer" in out
    # tokenizers are data products: the error names one, never the old results/<run>/tokenizer as a target
    assert f"--config name={missing} --until train_tokenizer" in out and f"-- results/{missing}/tokenizer" not in out


def test_init_from_inside_this_runs_own_results_is_refused(overlays, tmp_path):
    overlay = overlays("self", {"name": "itest-sibling-self",
                                "model": {"init_from": "results/itest-sibling-self/train/hf"}})
    proc = run_snakemake(workflow_dir(tmp_path / "workflow"), "-n", configfiles=(TINY_CONFIG, overlay), check=False)
    assert proc.returncode != 0 and "a run cannot start from itself" in proc.stdout + proc.stderr


# --- local source files are inputs of the corpus ---
SOURCE_EDIT = "itest-source-edit"


def rules_scheduled(workdir, configfiles, target) -> set[str]:
    """Rules `snakemake -n TARGET` would run."""
    return scheduled_rules(run_snakemake(workdir, "-n", "--", target, configfiles=configfiles))


def test_editing_a_local_source_file_rebuilds_the_corpus_and_what_follows(overlays, tmp_path):
    folder = workflow_dir(tmp_path / "workflow")
    source = tmp_path / "notes.txt"
    source.write_text("def alpha_function(value):\n    return value * 2\n" * 40)
    edit = {**BASE, "name": SOURCE_EDIT,
            "corpus": {"sources": [{"uri": f"file://{source}"}, {"uri": "builtin://python-stdlib"}], "jobs": 2}}
    overlay = overlays("source-edit", edit)
    products = data_products(edit)
    configfiles, index = (TINY_CONFIG, overlay), products.index
    corpus = folder / "results" / products.corpus
    run_snakemake(folder, "--", index, configfiles=configfiles)
    before = json.loads((corpus / "manifest.json").read_text())
    assert before["sources"][0]["sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    assert "alpha_function" in (corpus / "train.jsonl").read_text() + (corpus / "val.jsonl").read_text()
    shards_before = (folder / index).read_bytes()

    size = source.stat().st_size
    source.write_text(source.read_text().replace("alpha", "omega"))  # the same path, the same size
    assert source.stat().st_size == size
    # the corpus is cleaned in two part jobs (corpus.jobs) and merged (the run's own job table: what it scheduled)
    rebuilt = run_snakemake(folder, "--", index, configfiles=configfiles)
    assert scheduled_rules(rebuilt) == {"clean_corpus_part", "download_corpus", "train_tokenizer", "shard_tokens",
                                        "index_shards"}
    after = json.loads((corpus / "manifest.json").read_text())
    text = (corpus / "train.jsonl").read_text() + (corpus / "val.jsonl").read_text()
    assert "omega_function" in text and "alpha_function" not in text
    edited = hashlib.sha256(source.read_bytes()).hexdigest()
    assert after["sources"][0]["sha256"] == edited != before["sources"][0]["sha256"]
    assert after["sources"][0]["details"]["file_sha256"] == {str(source): after["sources"][0]["sha256"]}
    assert (folder / index).read_bytes() != shards_before
    assert rules_scheduled(folder, configfiles, index) == set()


# --- two pipelines on the same name's data stages at once ---
CONCURRENT = "itest-concurrent"


def test_a_second_pipeline_on_the_same_data_job_waits_for_the_holder_then_uses_its_product(overlays, tmp_path):
    """Two experiments at once (`--nolock`): the second pipeline's job for the same data product says whom it waits
    for, downloads nothing, deletes nothing of the first's, and finishes on the first's product."""
    import threading

    import psutil

    from httpfixture import FixtureServer, Route
    from support import snakemake_env

    folder = workflow_dir(tmp_path / "workflow")
    payload = "".join(json.dumps({"text": f"document {i}: " + "text " * 20}) + "\n" for i in range(40)).encode()
    release = threading.Event()
    route = Route(payload, hold=release)  # the first pipeline's download stays in progress until released
    with FixtureServer({"/held.jsonl": route}) as server:
        edit = {"name": CONCURRENT, "corpus": {"sources": [{"uri": server.url("/held.jsonl")}]}}
        overlay = overlays("concurrent", edit)
        products = data_products(edit)
        target = products.manifest
        first = subprocess.Popen(snakemake_command("--", target, configfiles=(TINY_CONFIG, overlay)), cwd=folder,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        second = None
        try:
            while route.served == 0:  # the first job holds its lock before it downloads
                assert first.poll() is None, first.stdout.read()[-3000:]
                release.wait(0.05)
            first_job = {p.pid for p in psutil.Process(first.pid).children(recursive=True)}
            log = folder / "logs" / products.corpus / "download_corpus.log"
            first_log = log.read_text()
            second = subprocess.Popen(snakemake_command("--nolock", "--", target,
                                                        configfiles=(TINY_CONFIG, overlay)),
                                      cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=snakemake_env(None))
            seen = []
            for line in second.stdout:  # the second says whom it waits for before the first is let go
                seen.append(line)
                if "waiting for pid" in line:
                    break
            waiting = seen[-1] if seen else ""
            assert "waiting for pid" in waiting, "".join(seen)[-3000:]
            assert int(re.search(r"waiting for pid (\d+)", waiting).group(1)) in first_job, waiting
        finally:
            release.set()
            out_first = first.communicate(timeout=600)[0]
            out_second = "".join(seen) + second.communicate(timeout=600)[0] if second else ""
    assert first.returncode == 0, out_first[-3000:]
    assert second.returncode == 0, out_second[-3000:]
    assert route.served == 1, "the waiting job never downloaded"
    assert "Removing output files of failed job" not in out_first + out_second
    # the first pipeline's corpus is whole and its log its own, never truncated or replaced
    manifest = json.loads((folder / target).read_text())
    assert manifest["documents"] == 40 and manifest["sources"][0]["sha256"] == hashlib.sha256(payload).hexdigest()
    attempts = sorted((log.parent / "download_corpus.attempts").glob("*.log"))
    first_attempt = next(path.read_text() for path in attempts if path.read_text().startswith(first_log))
    assert "corpus: 40 documents" in first_attempt and "waiting for pid" not in first_attempt
