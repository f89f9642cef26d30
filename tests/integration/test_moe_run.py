"""The DeepSeek family (tiny-moe: MLA + 8 routed experts, 2 per token) through the real launcher on 3 gloo ranks with
DeepSpeed ZeRO-2: the balance loss and the auxiliary-loss-free bias update train, every step records each layer's
tokens per expert summed over the ranks, and kill -9 past a checkpoint, then a rerun, gives every step the loss and
the expert load it had: the router's bias is part of the checkpoint."""
import json

import pytest

from support import crash_after_first_checkpoint, losses, moe_plan_for, read_jsonl, recorded_losses, run

pytestmark = pytest.mark.engine

def moe_plan(data, run_dir, **train):
    return moe_plan_for(data, run_dir, max_steps=12, rank_start="exec", **train)


def test_moe_run_records_the_expert_load_and_kill_9_then_rerun_repeats_it_bit_for_bit(data, tmp_path):
    crashed = tmp_path / "crashed"
    plan = moe_plan(data, crashed)
    kept = crash_after_first_checkpoint(plan, crashed, tmp_path / "crash.log")
    first = [record for record in read_jsonl(crashed / "state" / "metrics.jsonl")]
    uninterrupted = recorded_losses(crashed)
    assert len(uninterrupted) >= kept[-1] + 1
    assert run(plan, 3, tmp_path / "resume.log") == 0, (tmp_path / "resume.log").read_text()[-3000:]
    summary = json.loads((crashed / "out" / "summary.json").read_text())
    assert summary["resumed_from_step"] == kept[-1] and summary["model"]["preset"] == "tiny-moe"
    resumed = losses(crashed)
    assert len(resumed) == 12 and resumed[:len(uninterrupted)] == uninterrupted, "bit for bit"
    records = read_jsonl(crashed / "state" / "metrics.jsonl")
    by_step = {record["step"]: record for record in records}
    # every step: 3 MoE layers × 8 experts, each layer's tokens summed over the 3 ranks: 4 samples × 128 tokens ×
    # 3 ranks, each sent to 2 experts
    for record in by_step.values():
        load = record["expert_load"]
        assert len(load) == 3 and all(len(layer) == 8 for layer in load)
        assert all(sum(layer) == 4 * 128 * 3 * 2 for layer in load)
        assert len(record["max_violation"]) == 3 and all(v >= 0 for v in record["max_violation"])
        # the balance loss trained on (α = 0.01 of a sequence-wise loss near 1 per layer) and the biases' norms
        assert 0.005 < record["aux_loss"] < 0.2
        assert len(record["router_bias_norm"]) == 3 and all(n > 0 for n in record["router_bias_norm"])
    # the bias moves by at most the rate per expert and step: its norm by at most 0.01 × √8
    norms = [by_step[step]["router_bias_norm"][0] for step in sorted(by_step)]
    assert all(abs(b - a) <= 0.01 * 8 ** 0.5 + 1e-9 for a, b in zip(norms, norms[1:]))
    # the steps done again after the resume routed exactly as the first time (the biases were restored)
    for record in first:
        again = by_step[record["step"]]
        assert again["expert_load"] == record["expert_load"], record["step"]
        assert (again["aux_loss"], again["router_bias_norm"]) == (record["aux_loss"], record["router_bias_norm"])
    # the export of the last checkpoint is transformers' DeepseekV3ForCausalLM
    from pretrain_bench.evaluate.export import export_checkpoint
    from pretrain_bench.train.plan import Plan

    export_checkpoint(Plan.from_json(plan), 12, crashed / "out" / "hf")
    assert json.loads((crashed / "out" / "hf" / "config.json").read_text())["architectures"] == \
        ["DeepseekV3ForCausalLM"]
