"""The DeepSeek family (tiny-moe, native) on every engine but DeepSpeed ZeRO-2 (test_moe_run.py's), each on 2 gloo
ranks with the experts as ordinary data-parallel parameters (no expert parallelism): DDP, FSDP2 and DeepSpeed
ZeRO-0, 1 and 3. Each run is killed with kill -9 past its first checkpoint and rerun: every step has the loss and the
expert load it had, the router biases in the last checkpoint are exactly the sum of the bias updates the recorded
loads call for (so each engine's checkpoint carried the real, updated buffer across the resume), and the export
loads as transformers' DeepseekV3ForCausalLM with the native model's logits."""
import json
import shutil
from pathlib import Path

import pytest

from pretrain_bench.train.checkpoints.checkpointer import load_fp32_state_dict
from pretrain_bench.train.plan import Plan
from support import MOE_OVERRIDES, crash_after_first_checkpoint, losses, moe_plan_for, read_jsonl, recorded_losses, run

pytestmark = pytest.mark.engine

RANKS, STEPS, EVERY = 2, 6, 3
MICRO_BATCH, SEQ_LEN, TOP_K = 4, 128, 2  # the tiny config's batch and length; tiny-moe's experts per token
RATE = MOE_OVERRIDES["bias_update_rate"]  # larger than DeepSeek-V3's so that 6 steps move the biases
ENGINES = {"ddp": {"engine": "ddp", "zero_stage": 0}, "fsdp": {"engine": "fsdp", "zero_stage": 3},
           "zero0": {"zero_stage": 0}, "zero1": {"zero_stage": 1}, "zero3": {"zero_stage": 3}}
# also resumed at another world size (train.allow_reshape): ZeRO-3, through DeepSpeed's universal checkpoint
RESHAPED = {"zero3"}


def moe_plan(data, run_dir, **train):
    return moe_plan_for(data, run_dir, max_steps=STEPS, checkpoint_every=EVERY, eval_every=None, **train)


def biases_from_loads(records: list[dict]):
    """(MoE layers, experts) float32: DeepSeek-V3's update b += γ·sign(mean load − load) applied, step by step, to
    the recorded loads (summed over the ranks), from zeros."""
    import torch

    bias = None
    for record in sorted(records, key=lambda r: r["step"]):
        load = torch.tensor(record["expert_load"], dtype=torch.float32)
        bias = torch.zeros_like(load) if bias is None else bias
        bias += RATE * torch.sign(load.mean(dim=-1, keepdim=True) - load)
    return bias


@pytest.mark.parametrize("engine", ENGINES)
def test_moe_kill_9_then_rerun_repeats_losses_expert_load_and_router_bias_and_exports(data, tmp_path, engine):
    import torch

    run_dir = tmp_path / engine
    plan = moe_plan(data, run_dir, gpus=RANKS, **ENGINES[engine])
    kept = crash_after_first_checkpoint(plan, run_dir, tmp_path / "crash.log", ranks=RANKS)
    assert kept == [EVERY]
    if engine in RESHAPED:
        shutil.copytree(run_dir / "state", tmp_path / "reshaped" / "state")
    # the complete records of the killed run (kill -9 may have cut its last line)
    lines = (run_dir / "state" / "metrics.jsonl").read_text().split("\n")[:-1]
    first = {record["step"]: record for record in map(json.loads, lines)}
    uninterrupted = recorded_losses(run_dir)
    assert run(plan, RANKS, tmp_path / "resume.log") == 0, (tmp_path / "resume.log").read_text()[-3000:]
    summary = json.loads((run_dir / "out" / "summary.json").read_text())
    assert (summary["engine"], summary["resumed_from_step"]) == (ENGINES[engine].get("engine", "deepspeed"), EVERY)
    resumed = losses(run_dir)
    assert len(resumed) == STEPS and len(uninterrupted) > EVERY
    assert resumed[:len(uninterrupted)] == uninterrupted, "bit for bit"
    records = read_jsonl(run_dir / "state" / "metrics.jsonl")
    for record in records:
        load = record["expert_load"]  # 3 MoE layers × 8 experts, every token of both ranks sent to 2 of them
        assert len(load) == 3 and all(len(layer) == 8 and sum(layer) == MICRO_BATCH * SEQ_LEN * RANKS * TOP_K
                                      for layer in load), "summed over the ranks exactly once"
        if record["step"] in first:
            assert record["expert_load"] == first[record["step"]]["expert_load"], record["step"]
    # the router biases each engine saved at the last step: every step's update from the loads, resume included
    state = load_fp32_state_dict(run_dir / "state" / "checkpoints", STEPS)
    saved = torch.stack([state[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"] for layer in (1, 2, 3)])
    expected = biases_from_loads(records)
    assert expected.abs().sum() > 0 and torch.allclose(saved, expected, atol=1e-6, rtol=0), (saved, expected)
    assert_export_is_the_native_model(Plan.from_json(plan), state, tmp_path / "hf")
    if engine in RESHAPED:
        assert_reshaped_resume_keeps_the_biases(data, tmp_path / "reshaped", tmp_path / "reshaped.log",
                                                ENGINES[engine])


def assert_reshaped_resume_keeps_the_biases(data, run_dir, log, train: dict):
    """The crashed 2-rank run (a copy of its state in `run_dir`) resumed on 1 rank under train.allow_reshape: a
    DeepSpeed run loads a universal copy of the checkpoint, which holds no buffers, so its router biases come from the
    checkpoint's model-states files (DeepSpeedEngine.load_buffers); the last checkpoint's biases are every step's
    update, the 2-rank steps' and the 1-rank steps'."""
    import torch

    plan = moe_plan(data, run_dir, gpus=1, allow_reshape=True, **train)
    assert run(plan, 1, log) == 0, log.read_text()[-3000:]
    assert "saved at world size 2, now 1" in log.read_text()
    records = read_jsonl(run_dir / "state" / "metrics.jsonl")
    assert [record["step"] for record in records] == list(range(1, STEPS + 1))
    state = load_fp32_state_dict(run_dir / "state" / "checkpoints", STEPS)
    saved = torch.stack([state[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"] for layer in (1, 2, 3)])
    assert torch.allclose(saved, biases_from_loads(records), atol=1e-6, rtol=0)


def assert_export_is_the_native_model(plan, state: dict, target):
    """The export of the last checkpoint loads as DeepseekV3ForCausalLM with the checkpoint's weights (router biases
    included), and scores a batch as the native model with those weights does."""
    import torch
    from transformers import AutoModelForCausalLM

    from pretrain_bench.evaluate.export import export_checkpoint
    from pretrain_bench.train.models.native_deepseek import NativeDeepseekForCausalLM
    from pretrain_bench.train.plan import plan_shape

    export_checkpoint(plan, STEPS, target)
    exported = AutoModelForCausalLM.from_pretrained(target, local_files_only=True).eval()
    assert type(exported).__name__ == "DeepseekV3ForCausalLM"
    assert all(torch.equal(exported.state_dict()[key], value) for key, value in state.items()), "the same weights"
    index = json.loads(Path(plan.paths.index).read_text())
    native = NativeDeepseekForCausalLM(plan_shape(plan, index["vocab_size"]))
    native.load_state_dict(state, strict=True)
    native.eval()
    tokens = torch.randint(0, index["vocab_size"], (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(exported(tokens).logits, native(tokens).logits, atol=1e-5, rtol=0)
