"""Evaluation reruns through Snakemake follow the checkpoints: a raised train.max_steps evaluates only the new ones, an
edit that may train afresh or a checkpoint written anew evaluates again; and what rule plan_pretrain refuses before any
rank starts. A run of its own (the shared pipeline run of test_evaluate.py must stay as it is), in a working directory
of its own from a copy of the tiny data: 10 steps with checkpoints 5 and 10, then 15 steps."""
import contextlib
import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from support import (
    DATA_NAME,
    ROOT,
    TINY_CONFIG,
    data_products,
    read_jsonl,
    run_snakemake,
    seeded_workflow_dir,
    write_yaml,
)

pytestmark = pytest.mark.pipeline

TINY = yaml.safe_load((ROOT / TINY_CONFIG).read_text())

RERUN_NAME = DATA_NAME
RERUN_OVERLAY = {  # one rank: what these tests prove does not depend on the number of ranks
    "name": RERUN_NAME,
    "train": {"gpus": 1, "max_steps": 10, "checkpoint_every": 5, "warmup_steps": 2, "warmup_timing_steps": 1,
              "eval_every": None},
    "evaluate": {"max_tokens": 1024, "prompts": ["def main("], "generation": {"max_new_tokens": 4},
                 "lm_eval": {"tasks": []}},
}


def rerun_targets(steps):
    return [f"results/{RERUN_NAME}/{kind}/step{step}{suffix}" for step in steps
            for kind, suffix in (("export", ""), ("eval", ".json"))]


def rerun_snakemake(workdir, configfiles, *args, targets=(), check=True):
    return run_snakemake(workdir, *args, "--", *targets, configfiles=configfiles, check=check, timeout=1800)


def scheduled_jobs(proc) -> list[tuple[str, str]]:
    """(rule, wildcards) of every job a dry run lists."""
    jobs, rule = [], None
    for line in (proc.stdout + proc.stderr).splitlines():
        if match := re.match(r"^(?:local)?rule (\w+):", line):
            rule = match.group(1)
            jobs.append((rule, ""))
        elif rule and (match := re.match(r"^\s+wildcards: (.*)$", line)):
            jobs[-1] = (rule, match.group(1))
    return jobs


def evaluated_steps(proc) -> list[int]:
    return sorted(int(re.search(r"step=(\d+)", wildcards).group(1))
                  for rule, wildcards in scheduled_jobs(proc) if rule == "evaluate")


def evaluation_files(results: Path, steps) -> dict:
    """Every file of the evaluations and exports of `steps`, with its modification time and bytes."""
    files = {}
    for step in steps:
        for path in [results / "eval" / f"step{step}.json", *sorted((results / "export" / f"step{step}").rglob("*"))]:
            if path.is_file():
                files[str(path.relative_to(results))] = (path.stat().st_mtime_ns, path.read_bytes())
    return files


def overlay_file(folder: Path, name: str, **train) -> Path:
    return write_yaml(folder / name, {**RERUN_OVERLAY, "train": {**RERUN_OVERLAY["train"], **train}})


@pytest.fixture(scope="module")
def trained_further(tiny_data, tmp_path_factory):
    """The run trained and evaluated at 10 steps, then asked for 15: the dry run of that, and the files before and
    after it ran."""
    folder = tmp_path_factory.mktemp("rerun")
    workdir = seeded_workflow_dir(folder / "workflow", tiny_data)
    results = workdir / "results" / RERUN_NAME
    first = (TINY_CONFIG, overlay_file(folder, "steps10.yaml"))
    further = (TINY_CONFIG, overlay_file(folder, "steps15.yaml", max_steps=15))
    rerun_snakemake(workdir, first, targets=rerun_targets((5, 10)))
    before = evaluation_files(results, (5, 10))
    markers = {step: (results / "state" / "checkpoints" / f"step{step}" / "COMMITTED.json").read_bytes()
               for step in (5, 10)}
    dry_run = rerun_snakemake(workdir, further, "-n", targets=rerun_targets((5, 10, 15)))
    rerun_snakemake(workdir, further, targets=rerun_targets((5, 10, 15)))
    return SimpleNamespace(first=first, further=further, before=before, markers=markers, dry_run=dry_run,
                           after=evaluation_files(results, (5, 10)), folder=folder, workdir=workdir,
                           results=results)


def test_raising_max_steps_schedules_training_and_only_the_new_checkpoints_evaluation(trained_further):
    jobs = [rule for rule, _ in scheduled_jobs(trained_further.dry_run)]
    assert "plan_pretrain" in jobs and "pretrain" in jobs, "the run trains on"
    assert evaluated_steps(trained_further.dry_run) == [15]


def test_raising_max_steps_leaves_earlier_evaluations_and_exports_untouched(trained_further):
    assert len(trained_further.before) > 6 and trained_further.after == trained_further.before, \
        "same bytes and modification times"
    results = trained_further.results
    assert json.loads((results / "eval" / "step15.json").read_text())["step"] == 15
    assert json.loads((results / "train" / "summary.json").read_text())["steps"] == 15
    for step, marker in trained_further.markers.items():
        assert (results / "state" / "checkpoints" / f"step{step}" / "COMMITTED.json").read_bytes() == marker
    proc = rerun_snakemake(trained_further.workdir, trained_further.further, "-n",
                           targets=rerun_targets((5, 10, 15)))
    assert "Nothing to be done" in proc.stdout + proc.stderr


def test_an_edit_that_may_train_afresh_evaluates_every_checkpoint_again(trained_further):
    edited = (TINY_CONFIG, overlay_file(trained_further.folder, "lr.yaml", max_steps=15, lr=2.0e-3))
    proc = rerun_snakemake(trained_further.workdir, edited, "-n", targets=rerun_targets((5, 10, 15)))
    assert evaluated_steps(proc) == [5, 10, 15]


def test_a_checkpoint_written_anew_is_evaluated_anew(trained_further):
    marker = trained_further.results / "state" / "checkpoints" / "step5" / "COMMITTED.json"
    original = marker.read_bytes()
    try:
        # what a new save of step 5 leaves: another marker (here the same facts, written again in another layout)
        marker.write_text(json.dumps(json.loads(original), indent=1))
        proc = rerun_snakemake(trained_further.workdir, trained_further.further, "-n",
                               targets=rerun_targets((5, 10, 15)))
        assert evaluated_steps(proc) == [5]
    finally:
        marker.write_bytes(original)
    proc = rerun_snakemake(trained_further.workdir, trained_further.further, "-n", targets=rerun_targets((5, 10, 15)))
    assert "Nothing to be done" in proc.stdout + proc.stderr


def test_the_learning_rate_after_a_raised_max_steps_follows_the_new_total(trained_further):
    """What the README states: steps after the resume take the schedule computed for the new train.max_steps (the
    cosine stretched to 15 steps), so the rate rises at the resume point from where the 10-step schedule ended."""
    from pretrain_bench.train.settings import TrainSettings, learning_rate

    records = read_jsonl(trained_further.results / "train" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 16))
    train = {**TINY["train"], **RERUN_OVERLAY["train"]}
    settings = TrainSettings.from_config({k: v for k, v in train.items() if k in TrainSettings.__dataclass_fields__})
    lr = {r["step"]: r["lr"] for r in records}
    print("lr by step:", {step: f"{value:.3e}" for step, value in lr.items()})
    # the rate recorded with step k is the one step k + 1 uses (the scheduler has stepped): learning_rate(k)
    assert [lr[k] for k in range(1, 11)] == pytest.approx([learning_rate(k, settings, 10) for k in range(1, 11)])
    assert [lr[k] for k in range(11, 16)] == pytest.approx([learning_rate(k, settings, 15) for k in range(11, 16)])
    assert lr[10] == pytest.approx(settings.min_lr), "the 10-step schedule had reached min_lr"
    assert lr[11] > 2 * lr[10], "not a continuation of the old curve: it rises to the 15-step cosine"


# --- refused before launch, through Snakemake: rule plan_pretrain stops, no rank starts ---
PREFLIGHT_NAME = DATA_NAME  # in a working directory of its own


def test_init_from_weights_and_a_small_val_split_are_refused_by_the_plan_rule(trained_further, workdir, tmp_path):
    """model.init_from: a copy of the run above's step-5 export whose config.json names another FFN width; then the
    right config.json and a train.eval_tokens larger than the val split. Both stop in plan_pretrain, naming why."""
    logs = workdir / "logs" / PREFLIGHT_NAME
    model = tmp_path / "model"
    shutil.copytree(trained_further.results / "export" / "step5", model)
    config_json = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config_json, "intermediate_size": 640}))
    # 3 ranks, as in the tiny config: the samples an evaluation needs are a multiple of the ranks
    overlay = {**RERUN_OVERLAY, "name": PREFLIGHT_NAME, "model": {"init_from": str(model)},
               "train": {**RERUN_OVERLAY["train"], "gpus": 3}}
    write_yaml(tmp_path / "init_from.yaml", overlay)
    target = f"results/{PREFLIGHT_NAME}/train/summary.json"
    proc = run_snakemake(workdir, "--", target, check=False, timeout=1800,
                         configfiles=(TINY_CONFIG, tmp_path / "init_from.yaml"))
    log = (logs / "plan_pretrain.log").read_text()
    assert proc.returncode != 0
    assert f"model.init_from {model}: its weights do not fit the model its config.json describes" in log
    assert "model.layers.0.mlp.gate_proj.weight has shape [512, 192], the model [640, 192]" in log
    assert not (logs / "pretrain.attempts").exists(), "no rank was started"

    (model / "config.json").write_text(json.dumps(config_json))
    small = {**overlay, "train": {**overlay["train"], "eval_every": 5, "eval_tokens": 10**8}}
    write_yaml(tmp_path / "small_val.yaml", small)
    proc = run_snakemake(workdir, "--", target, check=False, timeout=1800,
                         configfiles=(TINY_CONFIG, tmp_path / "small_val.yaml"))
    log = (logs / "plan_pretrain.log").read_text()
    assert proc.returncode != 0
    # model.init_from's tokenizer is adopted, keyed by its content: where it is the content of a tokenizer product
    # already in the working directory, that product (and its shards) is the run's
    with contextlib.chdir(workdir):
        index = data_products(small).index
    assert re.search(rf"train.eval_every: the val split of {re.escape(index)} holds [\d,]+ tokens, [\d,]+ sample\(s\) "
                     r"of 128\+1 tokens .* an evaluation needs 781,248 sample\(s\) .* lower train.eval_tokens to at "
                     r"most [\d,]+, or set train.eval_every: null", log), log[-2000:]
    assert not (logs / "pretrain.attempts").exists(), "no rank was started"
