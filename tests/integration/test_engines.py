"""train.engine on CPU through the real launcher: DeepSpeed, DDP and FSDP train the same work, DDP reproduces
DeepSpeed ZeRO-0's losses, DDP and FSDP resume exactly after kill -9, and every engine's checkpoint exports."""
import json
import shutil

import pytest

from pretrain_bench.train.checkpoints.checkpointer import load_fp32_state_dict
from pretrain_bench.train.checkpoints.files import committed_steps
from pretrain_bench.train.plan import Plan
from support import crash_after_first_checkpoint, losses, plan_for, run

pytestmark = pytest.mark.engine

STEPS = 12
ENGINES = {"deepspeed": {"zero_stage": 0}, "ddp": {"engine": "ddp", "zero_stage": 0},
           "fsdp": {"engine": "fsdp", "zero_stage": 3}}


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    """Each engine, 3 gloo ranks, fp32, the same seed, data and global batch, 12 steps with checkpoints at 4, 8 and
    12. The kill -9 tests below use these runs as their uninterrupted reference."""
    root = tmp_path_factory.mktemp("engines")
    for name, train in ENGINES.items():
        assert run(plan_for(data, root / name, max_steps=STEPS, **train), 3, root / f"{name}.log") == 0, \
            (root / f"{name}.log").read_text()[-3000:]
    return root


def test_every_engine_trains_three_ranks_and_its_loss_falls(trained):
    for name in ENGINES:
        summary = json.loads((trained / name / "out" / "summary.json").read_text())
        assert summary["engine"] == name and summary["world_size"] == 3 and summary["steps"] == STEPS
        assert len(summary["peak_mem_bytes"]) == 3 and summary["tokens_per_s"] > 0
        assert committed_steps(trained / name / "state" / "checkpoints") == [4, 8, 12]
        curve = losses(trained / name)
        assert len(curve) == STEPS and curve[-1] < curve[0] - 0.5, (name, curve)
    # only DeepSpeed has a DeepSpeed config; DDP times its all-reduces with its communication hook
    assert (trained / "deepspeed" / "out" / "ds_config.json").is_file()
    assert not (trained / "ddp" / "out" / "ds_config.json").exists()
    ddp = json.loads((trained / "ddp" / "out" / "summary.json").read_text())
    assert 0 < ddp["comm_fraction"] < 1 and "DDP communication hook" in ddp["comm_method"]
    fsdp = json.loads((trained / "fsdp" / "out" / "summary.json").read_text())
    assert fsdp["comm_fraction"] is None and "not measured" in fsdp["comm_method"]


def test_ddp_and_fsdp_follow_deepspeed_zero0_step_for_step(trained):
    """Same model, data, AdamW maths, clipping and schedule: the losses agree to float tolerance."""
    reference = losses(trained / "deepspeed")
    for name in ("ddp", "fsdp"):
        curve = losses(trained / name)
        assert curve == pytest.approx(reference, rel=1e-5, abs=1e-5), (name, curve, reference)
    # and the trained weights too (the HF export reads every engine's checkpoint layout)
    weights = {name: load_fp32_state_dict(trained / name / "state" / "checkpoints", STEPS) for name in ENGINES}
    assert set(weights["ddp"]) == set(weights["deepspeed"]) == set(weights["fsdp"])
    for key, tensor in weights["deepspeed"].items():
        for name in ("ddp", "fsdp"):
            assert (weights[name][key] - tensor).abs().max().item() < 1e-4, (name, key)


def test_hf_export_of_an_fsdp_checkpoint_loads_and_scores_like_training(trained):
    import torch
    from transformers import AutoModelForCausalLM

    from pretrain_bench.evaluate.export import export_checkpoint

    plan = Plan.from_json(trained / "fsdp" / "plan.json")
    target = trained / "fsdp-hf"
    info = export_checkpoint(plan, STEPS, target)
    assert info["step"] == STEPS
    model = AutoModelForCausalLM.from_pretrained(target, local_files_only=True)
    state = load_fp32_state_dict(trained / "fsdp" / "state" / "checkpoints", STEPS)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[key], value) for key, value in state.items() if key in loaded)


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_kill_9_then_rerun_resumes_with_identical_losses(data, trained, tmp_path, engine):
    reference = trained / engine  # the same plan, run without interruption
    crashed = tmp_path / "crashed"
    plan = plan_for(data, crashed, max_steps=STEPS, **ENGINES[engine])
    kept = crash_after_first_checkpoint(plan, crashed, tmp_path / "crash.log")
    assert run(plan, 3, tmp_path / "resume.log") == 0, (tmp_path / "resume.log").read_text()[-3000:]
    summary = json.loads((crashed / "out" / "summary.json").read_text())
    assert summary["engine"] == engine and summary["resumed_from_step"] == kept[-1]
    assert losses(crashed) == losses(reference), "every per-step loss equals the uninterrupted run, bit for bit"


def test_ddp_resumes_at_another_world_size_without_conversion(data, trained, tmp_path):
    """DDP's checkpoint is world-size independent: train.allow_reshape resumes it directly (no universal copy). The
    3-rank run resumed is a copy of the module's finished DDP run (12 steps)."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained / "ddp" / "state", run_dir / "state", symlinks=True)
    plan = plan_for(data, run_dir, max_steps=STEPS + 4, gpus=2, global_batch_size=None, allow_reshape=True,
                    **ENGINES["ddp"])
    assert run(plan, 2, tmp_path / "b.log") == 0, (tmp_path / "b.log").read_text()[-3000:]
    assert "saved at world size 3, now 2" in (tmp_path / "b.log").read_text()
    summary = json.loads((run_dir / "out" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["resumed_from_step"] == STEPS
    assert not list((run_dir / "state" / "checkpoints").glob("*-universal"))
    assert len(losses(run_dir)) == STEPS + 4
    assert losses(run_dir)[:STEPS] == losses(trained / "ddp"), "the 3-rank steps are kept as they were"


def test_keys_an_engine_cannot_honour_are_refused_before_launch(data, tmp_path):
    from pretrain_bench.train.settings import ConfigError

    with pytest.raises(ConfigError, match=r"train.zero_stage 2 means nothing under train.engine ddp"):
        plan_for(data, tmp_path / "a", engine="ddp", zero_stage=2)
    with pytest.raises(ConfigError, match=r"train.offload_optimizer cpu means nothing under train.engine fsdp"):
        plan_for(data, tmp_path / "b", engine="fsdp", zero_stage=3, offload_optimizer="cpu")
    assert not (tmp_path / "a" / "plan.json").exists() and not (tmp_path / "b" / "plan.json").exists()


def test_the_pipeline_trains_and_exports_with_fsdp(workdir, tmp_path):
    """The main run under train.engine fsdp through Snakemake: pretrain on 2 ranks (the module's other FSDP runs
    train on 3), then the HF export of its last checkpoint."""
    from transformers import AutoModelForCausalLM

    from support import DATA_NAME, TINY_CONFIG, run_snakemake, write_yaml

    overlay = write_yaml(tmp_path / "fsdp.yaml", {"name": DATA_NAME, "train": {
        "engine": "fsdp", "zero_stage": 3, "gpus": 2, "max_steps": 6, "checkpoint_every": 3, "warmup_steps": 2,
        "warmup_timing_steps": 1, "eval_every": None}})
    target, results = f"results/{DATA_NAME}/train/hf", workdir / "results" / DATA_NAME
    run_snakemake(workdir, "--", target, configfiles=(TINY_CONFIG, overlay))
    summary = json.loads((results / "train" / "summary.json").read_text())
    assert summary["engine"] == "fsdp" and summary["steps"] == 6 and summary["checkpoints"] == [3, 6]
    assert not (results / "train" / "ds_config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(workdir / target, local_files_only=True)
    assert json.loads((workdir / target / "pretrain_bench_export.json").read_text())["step"] == 6
    assert sum(p.numel() for p in model.parameters()) == summary["model"]["parameters"]
