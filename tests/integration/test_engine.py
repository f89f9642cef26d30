"""The training engine on CPU through the real launcher: ZeRO stages, exact resume after kill -9, non-finite loss,
incompatible checkpoints, concurrent launches (pre-emption by SIGTERM: test_faults.py, with a second run refused)."""
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pretrain_bench.train.checkpoints.files import committed_steps
from pretrain_bench.train.plan import Plan, make_plan
from pretrain_bench.workflow.experiment import plan_config
from support import (
    crash_after_first_checkpoint,
    losses,
    plan_for,
    rank_startups,
    read_jsonl,
    recorded_losses,
    run,  # the data fixture: tests/conftest.py
)

pytestmark = pytest.mark.engine


def test_zero_stages_0_to_3_train_concurrently_and_shut_down(zero_stage_runs):
    # Launched two at a time, each exited 0 (tests/conftest.py zero_stage_runs, shared with test_export_zero.py).
    runs = zero_stage_runs
    for stage in range(4):
        summary = json.loads((runs / f"z{stage}" / "out" / "summary.json").read_text())
        assert summary["zero_stage"] == stage and summary["world_size"] == 2
        assert committed_steps(runs / f"z{stage}" / "state" / "checkpoints") == [3]
        ds = json.loads((runs / f"z{stage}" / "out" / "ds_config.json").read_text())
        assert ds["zero_optimization"]["stage"] == stage
        assert ("offload_optimizer" in ds["zero_optimization"]) == (stage == 2)
    # The same data and seed give the same first loss whatever the stage: only the partitioning differs.
    first = {s: losses(runs / f"z{s}")[0] for s in range(4)}
    assert max(first.values()) - min(first.values()) < 1e-4, first


def test_kill_9_then_rerun_resumes_with_identical_losses(data, tmp_path):
    """The killed run, up to the kill, is the uninterrupted run: the steps it had done past its checkpoint are done
    again after the resume, and every one of them must give the loss it gave the first time. The first run's ranks
    are fresh interpreters (train.rank_start exec, as on CUDA), the resumed run's are forked from a fork server
    made from torchrun's agent (fork, the CPU default): either start trains the same bits."""
    crashed = tmp_path / "crashed"
    plan = plan_for(data, crashed, max_steps=12, rank_start="exec")
    kept = crash_after_first_checkpoint(plan, crashed, tmp_path / "crash.log")
    uninterrupted = recorded_losses(crashed)
    assert len(uninterrupted) >= kept[-1] + 1, "at least one step past the checkpoint is done again"
    plan = plan_for(data, crashed, max_steps=12, rank_start="fork")  # not in the resume fingerprint
    assert run(plan, 3, tmp_path / "resume.log") == 0, (tmp_path / "resume.log").read_text()[-3000:]
    assert "-m torch.distributed.run " in (tmp_path / "crash.log").read_text()
    assert "-m pretrain_bench.train.forked_ranks " in (tmp_path / "resume.log").read_text()
    summary = json.loads((crashed / "out" / "summary.json").read_text())
    assert summary["resumed_from_step"] == kept[-1] and summary["resumed_from_step"] in (4, 8)
    resumed = losses(crashed)
    assert len(resumed) == 12 and len(set(resumed)) == 12
    assert resumed[:len(uninterrupted)] == uninterrupted, "every per-step loss equals the first run's, bit for bit"
    assert "resumed from" in (tmp_path / "resume.log").read_text()


def test_other_config_or_world_size_start_fresh_beside_the_old_run_or_resume_reshaped(data, tmp_path):
    run_dir = tmp_path / "run"
    assert run(plan_for(data, run_dir, max_steps=4), 3, tmp_path / "a.log") == 0
    # a changed learning rate: a fresh run, the old one kept whole beside it and named in the log (the settings are
    # compared before the world size, so this run needs no third rank)
    plan = plan_for(data, run_dir, max_steps=4, lr=1e-3, gpus=2, global_batch_size=None)
    assert run(plan, 2, tmp_path / "c.log") == 0, (tmp_path / "c.log").read_text()[-3000:]
    log = (tmp_path / "c.log").read_text()
    assert "the settings changed since the run in" in log and "(train.lr)" in log
    kept = [p for p in (run_dir / "state" / "runs").iterdir()]
    assert len(kept) == 1 and committed_steps(kept[0] / "checkpoints") == [4]
    assert json.loads((run_dir / "out" / "summary.json").read_text())["resumed_from_step"] is None
    # the original settings again (at world size 2): the kept run comes back and resumes below
    # with train.allow_reshape: converted through a universal checkpoint and resumed at world size 2
    plan = plan_for(data, run_dir, max_steps=8, gpus=2, global_batch_size=None, allow_reshape=True)
    assert run(plan, 2, tmp_path / "d.log") == 0, (tmp_path / "d.log").read_text()[-3000:]
    summary = json.loads((run_dir / "out" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["resumed_from_step"] == 4
    assert "saved at world size 3, now 2" in (tmp_path / "d.log").read_text()
    assert (run_dir / "state" / "checkpoints" / "step4-universal" / "zero").is_dir()
    resumed = losses(run_dir)
    assert len(resumed) == 8 and resumed[4] < resumed[0], "training continued from the trained weights"
    # another world size (1 rank) without train.allow_reshape: a fresh run; the 2-rank run is kept beside it, untouched
    plan = plan_for(data, run_dir, max_steps=4, gpus=1, global_batch_size=None)
    assert run(plan, 1, tmp_path / "e.log") == 0, (tmp_path / "e.log").read_text()[-3000:]
    log = (tmp_path / "e.log").read_text()
    assert "the world size changed since the run in" in log and "(train.gpus × train.nodes: 2 → 1)" in log
    assert "resumed from" not in log
    assert json.loads((run_dir / "out" / "summary.json").read_text())["resumed_from_step"] is None
    assert [committed_steps(p / "checkpoints") for p in (run_dir / "state" / "runs").glob("*-world2")] == [[4, 8]]


def test_non_finite_loss_aborts_and_keeps_last_good_checkpoint(data, tmp_path):
    run_dir = tmp_path / "run"
    plan = plan_for(data, run_dir, gpus=2, global_batch_size=None, max_steps=8, checkpoint_every=2)
    assert run(plan, 2, tmp_path / "nan.log", env={"PRETRAIN_BENCH_INJECT_NAN_AT_STEP": "5"}) != 0
    log = (tmp_path / "nan.log").read_text()
    assert "non-finite loss at step 5 on rank(s) [1]" in log
    assert "the last complete one is step 4" in log
    assert committed_steps(run_dir / "state" / "checkpoints") == [2, 4], "nothing saved at or after the bad step"
    assert not (run_dir / "out" / "summary.json").exists()


def test_continue_from_export_eval_every_and_csv_monitor(data, tmp_path):
    """Run A evaluates while training, logs through DeepSpeed's csv monitor and exports; run B starts from A's
    export under ZeRO-3 and its step-1 loss is the export's own loss on the same batches. Both on 2 ranks."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pretrain_bench.data.loader import PackedTokens, RankBatches

    config, results = data
    csv_dir = tmp_path / "csv"

    def make(run_dir, model=None, **train):
        train = {"gpus": 2, "global_batch_size": None, **train}
        cfg = {**config, "model": {**config["model"], **(model or {})}, "train": {**config["train"], **train}}
        plan = make_plan(plan_config(cfg), index=results.shards / "index.json", tokenizer=results.tokenizer,
                         out_dir=run_dir / "out", state_dir=run_dir / "state",
                         manifest=results.corpus / "manifest.json")
        plan.to_json(run_dir / "plan.json")
        return run_dir / "plan.json"

    first = tmp_path / "first"
    plan = make(first, max_steps=4, checkpoint_every=4, warmup_timing_steps=1, warmup_steps=2, eval_every=2,
                eval_tokens=3 * 256,
                deepspeed={"csv_monitor": {"enabled": True, "output_path": str(csv_dir), "job_name": "tiny"}})
    assert run(plan, 2, tmp_path / "first.log") == 0, (tmp_path / "first.log").read_text()[-3000:]
    # the final export, as rule export_final makes it once training has ended
    from pretrain_bench.evaluate.export import export_checkpoint

    export_checkpoint(Plan.from_json(plan), 4, first / "out" / "hf")
    records = read_jsonl(first / "out" / "metrics.jsonl")
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4]
    assert all(r["val_perplexity"] > 1 and r["eval_time_s"] > 0 for r in records if "val_loss" in r)
    summary = json.loads((first / "out" / "summary.json").read_text())
    assert summary["eval_during_training"]["evaluations"] == 2 and summary["eval_during_training"]["samples"] == 6
    assert summary["init_from"] is None and summary["init_seed"] == config["train"]["seed"]
    csv_files = sorted(p.name for p in (csv_dir / "tiny").glob("*.csv"))
    assert csv_files, f"DeepSpeed's csv monitor wrote nothing under {csv_dir}"
    assert any(len((csv_dir / "tiny" / name).read_text().splitlines()) >= 2 for name in csv_files)
    export = first / "out" / "hf"
    card = (export / "README.md").read_text()
    assert "## Held-out evaluation" in card and f"loss {records[-1]['val_loss']:.4f}" in card
    assert "builtin://python-stdlib" in card and "train split `train.jsonl`" in card
    assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] is not None

    # The README's `tail -f` of the training log and `tensorboard --logdir` on the run's events.
    follow = subprocess.Popen(["tail", "-f", str(tmp_path / "first.log")], stdout=subprocess.PIPE, text=True)
    try:
        assert any("held-out loss" in follow.stdout.readline() for _ in range(200))
    finally:
        follow.kill()
    port = 20000 + os.getpid() % 20000
    board = subprocess.Popen([str(Path(sys.executable).parent / "tensorboard"), "--logdir",
                              str(first / "out" / "tensorboard"), "--port", str(port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import urllib.request

        deadline, tags = time.monotonic() + 120, ""
        while "val/loss" not in tags and time.monotonic() < deadline:
            time.sleep(0.2)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/scalars/tags", timeout=5) as answer:
                    tags = answer.read().decode()
            except OSError:
                pass
        assert "val/loss" in tags and "train/loss" in tags, tags
    finally:
        board.kill()

    # The README's three lines load the export.
    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    assert tokenizer.decode(model.generate(**tokenizer("def ", return_tensors="pt"), max_new_tokens=4)[0])

    # Run B: from the export, under ZeRO-3. Its step-1 batches are those of a fresh run with the same seed.
    second = tmp_path / "second"
    plan = make(second, model={"init_from": str(export)}, max_steps=1, checkpoint_every=1, zero_stage=3,
                warmup_steps=0)
    assert run(plan, 2, tmp_path / "second.log") == 0, (tmp_path / "second.log").read_text()[-3000:]
    step_one = json.loads((second / "state" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    data_view = PackedTokens(results.shards / "index.json", "train", config["model"]["seq_len"])
    rank_losses = []
    with torch.no_grad():
        for rank in range(2):
            batch = RankBatches(data_view, rank=rank, world_size=2,
                                micro_batch_size=config["train"]["micro_batch_size"],
                                seed=config["train"]["seed"]).next_batch()
            logits = model(input_ids=batch[:, :-1]).logits
            rank_losses.append(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                               batch[:, 1:].reshape(-1)).item())
    expected = sum(rank_losses) / 2
    assert abs(step_one - expected) < 1e-4, (step_one, expected)
    assert step_one < records[0]["loss"] - 0.5, "B starts where A ended, not from random weights"
    summary = json.loads((second / "out" / "summary.json").read_text())
    assert summary["init_from"]["uri"] == str(export) and summary["init_from"]["loaded"]["files"]
    assert "weights from model.init_from" in (tmp_path / "second.log").read_text()


# train.compile: losses within this of eager's (same weights, batches and maths; inductor's fused kernels sum in
# another order). Measured: below 1e-5 over these steps (bench/bench_compile.py records the difference it sees).
COMPILE_LOSS_TOLERANCE = 1e-4


def test_compile_under_every_engine_trains_to_eagers_losses(data, zero_stage_runs, tmp_path):
    """DeepSpeed (ZeRO-2), DDP and FSDP with train.compile at 2 gloo ranks against eager DeepSpeed ZeRO-0 (the three
    engines agree step for step in eager mode: test_engines.py). The summary reports the compile time apart. The eager
    reference is the session's ZeRO-0 run (zero_stage_runs: the same plan as these runs, less train.compile)."""
    engines = {"deepspeed": {"zero_stage": 2}, "ddp": {"engine": "ddp", "zero_stage": 0},
               "fsdp": {"engine": "fsdp", "zero_stage": 3}}
    # no held-out evaluation: its no-grad forward of another batch shape is a graph of its own, which roughly doubles
    # each run's compile time (test_compiled_run_killed_then_rerun_resumes_with_identical_losses evaluates compiled)
    no_eval = {"eval_every": None}
    # the tiny config's native model class: compiled whole, per block under FSDP (compiling.compile_scope)
    scopes = {"deepspeed": "whole model", "ddp": "whole model", "fsdp": "decoder blocks"}
    common = {"gpus": 2, "global_batch_size": None, "max_steps": 3, "checkpoint_every": 3}
    eager = zero_stage_runs / "z0"
    eager_train = json.loads((eager / "plan.json").read_text())["train"]
    assert {key: eager_train[key] for key in common} == common and eager_train["compile"] is False
    reference = losses(eager)
    assert len(reference) == 3 and json.loads((eager / "out" / "summary.json").read_text())["compile"] is None
    # eager DeepSpeed ranks at ZeRO-0 to 2 (2 with DeepSpeedCPUAdam) reach their first step without torch._dynamo
    # (deepspeed_engine.optimizers_without_dynamo); ZeRO-3's parameter hooks import it (torch.compiler.disable), as
    # compiled ranks do (so the check can fail)
    for stage in range(4):
        imported = [r["imported"] for r in rank_startups(zero_stage_runs / f"z{stage}.log")]
        assert len(imported) == 2 and [("torch._dynamo" in names) for names in imported] == [stage == 3] * 2, \
            (stage, imported)
        # CPU ranks treat denormal floats as zero (devices.flush_denormals), as measured at their first step
        assert [r["denormals_flushed"] for r in rank_startups(zero_stage_runs / f"z{stage}.log")] == [True, True]
    for name, train in engines.items():
        log = tmp_path / f"{name}.log"
        assert run(plan_for(data, tmp_path / name, compile=True, **{**common, **train, **no_eval}), 2, log) == 0, \
            log.read_text()[-3000:]
        curve = losses(tmp_path / name)
        assert curve == pytest.approx(reference, abs=COMPILE_LOSS_TOLERANCE), (name, curve, reference)
        imported = [r["imported"] for r in rank_startups(log)]
        assert len(imported) == 2 and all("torch._dynamo" in names for names in imported), (name, imported)
        summary = json.loads((tmp_path / name / "out" / "summary.json").read_text())
        assert summary["engine"] == name and summary["model"]["attn_implementation"] == "sdpa"
        compiled = summary["compile"]
        # forward and backward: one compilation where the caches hold both, more where the backward compiles lazily or
        # DDP splits the graph at its gradient buckets
        assert compiled["scope"] == scopes[name] and compiled["compilations"] >= 1, (name, compiled)
        # compiled within the first step: wall time it took
        records = read_jsonl(tmp_path / name / "out" / "metrics.jsonl")
        assert not any("eval_time_s" in r for r in records) and 0 < compiled["time_s"] < records[0]["step_time_s"]


def test_compiled_run_killed_then_rerun_resumes_with_identical_losses(data, tmp_path):
    """train.compile under the bit-exact resume setting (ZeRO-2, fp32, gloo): the resumed run compiles the same
    graphs again, so every step done again gives the loss it gave the first time, bit for bit. On 2 ranks, each of
    which compiles its own graphs (3 ranks' exact resume is test_kill_9_then_rerun_resumes_with_identical_losses). The
    last step's held-out evaluation runs through the compiled model too (its no-grad graph)."""
    crashed = tmp_path / "crashed"
    plan = plan_for(data, crashed, max_steps=6, checkpoint_every=3, compile=True, gpus=2, global_batch_size=None)
    kept = crash_after_first_checkpoint(plan, crashed, tmp_path / "crash.log", ranks=2)
    uninterrupted = recorded_losses(crashed)
    assert run(plan, 2, tmp_path / "resume.log") == 0, (tmp_path / "resume.log").read_text()[-3000:]
    summary = json.loads((crashed / "out" / "summary.json").read_text())
    assert summary["resumed_from_step"] == kept[-1] == 3 and summary["compile"]["time_s"] > 0
    resumed = losses(crashed)
    assert len(resumed) == 6 and resumed[:len(uninterrupted)] == uninterrupted
    records = read_jsonl(crashed / "state" / "metrics.jsonl")
    assert [r["step"] for r in records if "val_loss" in r] == [6] and math.isfinite(records[-1]["val_loss"])
