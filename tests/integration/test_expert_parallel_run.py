"""Expert parallelism under DDP and FSDP2 (train.expert_parallel 2, tiny-moe native on 2 gloo ranks) through the
real launcher: the same per-step losses as EP 1 on the same 2 ranks (fp32, to a stated tolerance), kill -9 past a
checkpoint then a rerun gives every step the loss it had bit for bit, the checkpoint holds the whole experts, and the
export is EP 1's export of the same training (to the same tolerance), loaded back as DeepseekV3ForCausalLM."""
import json

import pytest

from pretrain_bench.train.plan import Plan
from support import crash_after_first_checkpoint, losses, moe_plan_for, read_jsonl, recorded_losses, run

pytestmark = pytest.mark.engine

STEPS = 8
# fp32: EP 2 computes each expert's rows in other batches than EP 1 (its own and the other rank's pairs together),
# sums the gradient norm in another order and averages the experts' gradients in its own all-reduce, so the last bits
# differ from step 2 on, and AdamW amplifies them where a gradient is near 0 (m / √v). Measured over 8 steps on
# 2 ranks: the first two losses equal, max |Δloss| 2.1e-5; weights max |Δ| 2.6e-4 (rarely seen embedding rows),
# under a tenth of one step's largest move (lr 3e-3)
LOSS_TOLERANCE, WEIGHT_TOLERANCE = 1e-4, 1e-3


def ep_plan(data, run_dir, expert_parallel, engine="ddp", zero_stage=0):
    # DeepSpeed's AutoEP layer has no balance loss: both of its runs train without it (the bias update stays on)
    return moe_plan_for(data, run_dir, {"aux_loss_alpha": 0.0} if engine == "deepspeed" else None, engine=engine,
                        zero_stage=zero_stage, gpus=2,
                        expert_parallel=expert_parallel, max_steps=STEPS, checkpoint_every=4, rank_start="exec",
                        eval_every=4, eval_tokens=1024)


# DeepSpeed: AutoEP at ZeRO-2 (its experts in files of their own) and ZeRO-3 (in the partitions), both merged for
# the export by ds_to_universal
@pytest.mark.parametrize("engine,zero_stage", [("ddp", 0), ("fsdp", 3), ("deepspeed", 2), ("deepspeed", 3)])
def test_expert_parallel_trains_as_ep_1_resumes_bit_for_bit_and_exports_whole_experts(data, tmp_path, engine,
                                                                                      zero_stage):
    import torch

    from pretrain_bench.evaluate.export import export_checkpoint, read_checkpoint_weights

    # EP 1 on 2 ranks, uninterrupted
    whole = tmp_path / "ep1"
    plan1 = ep_plan(data, whole, 1, engine, zero_stage)
    assert run(plan1, 2, tmp_path / "ep1.log") == 0, (tmp_path / "ep1.log").read_text()[-3000:]
    # EP 2 on 2 ranks, killed past its first checkpoint and run again
    split = tmp_path / "ep2"
    plan2 = ep_plan(data, split, 2, engine, zero_stage)
    kept = crash_after_first_checkpoint(plan2, split, tmp_path / "crash.log", ranks=2)
    before = recorded_losses(split)
    assert len(before) >= kept[-1] + 1
    assert run(plan2, 2, tmp_path / "ep2.log") == 0, (tmp_path / "ep2.log").read_text()[-3000:]
    summary = json.loads((split / "out" / "summary.json").read_text())
    assert summary["resumed_from_step"] == kept[-1]
    # the all-to-alls were timed like the all-reduces: every step's, and their share of the steady steps' time
    assert summary["expert_parallel"] == 2 and 0 < summary["all_to_all_fraction"] < 1
    assert all(0 < record["all_to_all_s"] < record["step_time_s"]
               for record in read_jsonl(split / "state" / "metrics.jsonl"))
    whole_summary = json.loads((whole / "out" / "summary.json").read_text())
    assert whole_summary["expert_parallel"] == 1 and whole_summary["all_to_all_fraction"] is None
    assert all("all_to_all_s" not in record for record in read_jsonl(whole / "state" / "metrics.jsonl"))
    resumed = losses(split)
    assert len(resumed) == STEPS and resumed[:len(before)] == before, "bit for bit"
    # the same training as EP 1
    reference = losses(whole)
    difference = max(abs(a - b) for a, b in zip(reference, resumed))
    print(f"EP 1 vs EP 2 losses over {STEPS} steps: max |difference| {difference:.3e}")
    assert difference < LOSS_TOLERANCE, (reference, resumed)
    assert abs(resumed[0] - reference[0]) < 1e-6  # the same initial weights and data (the experts EP 1's, split)
    # the held-out loss (every rank's forward passes exchange tokens too)
    held_out = [[record["val_loss"] for record in read_jsonl(folder / "state" / "metrics.jsonl")
                 if record.get("val_loss") is not None] for folder in (whole, split)]
    assert len(held_out[1]) == 2 and max(abs(a - b) for a, b in zip(*held_out)) < LOSS_TOLERANCE, held_out
    # the first step's gradient norm: the replicated parameters' and every rank's experts' together
    norms = [[record["grad_norm"] for record in read_jsonl(folder / "state" / "metrics.jsonl")] for folder in
             (whole, split)]
    assert abs(norms[0][0] - norms[1][0]) < 1e-5 * norms[0][0], norms
    # every rank counts its own tokens' routing, summed over both: 4 samples × 128 tokens × 2 ranks × 2 experts
    for record in read_jsonl(split / "state" / "metrics.jsonl"):
        assert all(sum(layer) == 4 * 128 * 2 * 2 for layer in record["expert_load"])
    # the auxiliary-loss-free bias moved from those counts, as at EP 1 (under DeepSpeed: AutoEP's router's bias)
    biases = [read_jsonl(folder / "state" / "metrics.jsonl")[-1]["router_bias_norm"] for folder in (whole, split)]
    assert min(biases[1]) > 0 and biases[1] == pytest.approx(biases[0], rel=1e-6), biases
    # the checkpoint holds the whole experts (8 per layer), as EP 1's; the exports agree
    ep1 = read_checkpoint_weights(whole / "state" / "checkpoints", STEPS)
    ep2 = read_checkpoint_weights(split / "state" / "checkpoints", STEPS)
    assert ep1.keys() == ep2.keys()
    assert ep2["model.layers.1.mlp.experts.gate_up_proj"].shape[0] == 8
    weights = max(float((ep1[key].float() - ep2[key].float()).abs().max()) for key in ep1)
    print(f"EP 1 vs EP 2 weights after {STEPS} steps: max |difference| {weights:.3e}")
    assert weights < WEIGHT_TOLERANCE
    export_checkpoint(Plan.from_json(plan2), STEPS, split / "out" / "hf")
    import transformers

    exported = transformers.AutoModelForCausalLM.from_pretrained(split / "out" / "hf", dtype=torch.float32)
    assert type(exported).__name__ == "DeepseekV3ForCausalLM"
    assert exported.config.num_nextn_predict_layers == 0  # what is exported: no multi-token prediction module
    from pretrain_bench.train.models.native_deepseek import NativeDeepseekForCausalLM
    from pretrain_bench.train.plan import plan_shape

    plan = Plan.from_json(plan2)
    native = NativeDeepseekForCausalLM(plan_shape(plan, exported.config.vocab_size))
    native.load_state_dict(ep2)
    ids = torch.randint(0, exported.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (exported.eval()(input_ids=ids).logits - native.eval()(input_ids=ids).logits).abs().max()
    assert float(gap) < 1e-4, float(gap)


# FSDP2 for the torch engines (DDP shares its ExpertShards: the same averaging, the same whole-expert checkpoints),
# DeepSpeed for AutoEP
@pytest.mark.parametrize("engine,zero_stage", [("fsdp", 3), ("deepspeed", 2)])
def test_four_ranks_average_each_experts_gradients_over_its_group_and_resume_from_two(data, tmp_path, engine,
                                                                                   zero_stage):
    # 4 ranks at EP 2: two expert-parallel groups, and each expert on 2 ranks whose gradients are averaged over
    # them (the expert-data-parallel group, which 2 ranks at EP 2 do not have): EP 1's losses on the same 4 ranks
    overrides = {"aux_loss_alpha": 0.0} if engine == "deepspeed" else None
    common = dict(engine=engine, zero_stage=zero_stage, checkpoint_every=4, eval_every=None, rank_start="exec",
                  global_batch_size=None)
    runs = {}
    for ep in (1, 2):
        plan = moe_plan_for(data, tmp_path / f"ep{ep}", overrides, False, gpus=4, expert_parallel=ep, max_steps=3,
                            **common)
        assert run(plan, 4, tmp_path / f"ep{ep}.log") == 0, (tmp_path / f"ep{ep}.log").read_text()[-3000:]
        runs[ep] = read_jsonl(tmp_path / f"ep{ep}" / "state" / "metrics.jsonl")
    difference = max(abs(a["loss"] - b["loss"]) for a, b in zip(runs[1], runs[2]))
    assert difference < LOSS_TOLERANCE, difference
    assert runs[2][-1]["router_bias_norm"] == pytest.approx(runs[1][-1]["router_bias_norm"], rel=1e-6)
    assert all(sum(layer) == 4 * 128 * 4 * 2 for record in runs[2] for layer in record["expert_load"])
    # a run at EP 2 on 2 ranks resumed on 4 (train.allow_reshape): the whole experts (DDP, FSDP) or DeepSpeed's
    # universal copy give each of the 4 ranks its slice; the 2-rank steps are kept
    reshaped = tmp_path / "reshaped"
    common.update(expert_parallel=2, allow_reshape=True)
    plan = moe_plan_for(data, reshaped, overrides, gpus=2, max_steps=4, **common)
    assert run(plan, 2, tmp_path / "two.log") == 0, (tmp_path / "two.log").read_text()[-3000:]
    before = losses(reshaped)
    plan = moe_plan_for(data, reshaped, overrides, gpus=4, max_steps=8, **common)
    assert run(plan, 4, tmp_path / "four.log") == 0, (tmp_path / "four.log").read_text()[-3000:]
    summary = json.loads((reshaped / "out" / "summary.json").read_text())
    assert (summary["world_size"], summary["resumed_from_step"], summary["expert_parallel"]) == (4, 4, 2)
    after = losses(reshaped)
    assert len(after) == 8 and after[:4] == before and after[-1] < after[3]
