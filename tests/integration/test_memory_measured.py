"""The memory model against real runs: host RSS of offloaded ZeRO-2 and ZeRO-3 runs of a mid-size preset on CPU."""
import json

import pytest

from support import plan_for, run

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("zero_stage,precision", [(2, None), (3, "bf16")])
def test_offloaded_run_rss_matches_the_memory_model(data, tmp_path, zero_stage, precision):
    # llama-125m (134M parameters with its 32k vocabulary), one rank, optimizer offloaded: on CPU the rank's peak
    # RSS holds the model, activations, DeepSpeed's buffers and every offloaded term (offload_host_terms for
    # ZeRO-2, stage3_offload_host_terms for ZeRO-3, the default's chosen setup)
    config, results = data
    # 32-token samples, one per step: the states this test weighs do not depend on them, and the matmuls stay cheap
    # where bf16 is slow (on a CPU without native bf16 matmuls, AVX2 only, x @ wᵀ ran about 8× slower than fp32)
    config = {**config, "model": {**config["model"], "preset": "llama-125m", "overrides": {}, "seq_len": 32}}
    chosen = {"precision": precision} if precision else {}  # None: the tiny config's own
    # 2 steps: the peak comes in step 2 (step 1's RSS is ~0.8-0.9 of it); no checkpoint: each step's record measures
    # its RSS, and saving this model's 2 GB of states would only add time
    plan_path = plan_for((config, results), tmp_path, gpus=1, global_batch_size=None, zero_stage=zero_stage,
                         **chosen, offload_optimizer="cpu", micro_batch_size=1, max_steps=2,
                         warmup_steps=1, memory_fit="strict", eval_every=None, save_checkpoints=False)
    assert run(plan_path, 1, tmp_path / "train.log") == 0, (tmp_path / "train.log").read_text()[-3000:]
    # a bf16 run on a CPU that emulates bf16 matmuls says so; any other run does not
    import torch

    emulated = precision == "bf16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert ("note: train.precision bf16 on a CPU without native bf16 matmuls" in
            (tmp_path / "train.log").read_text()) == emulated
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["precision_note"] is not None) == emulated, summary["precision_note"]  # what the report names
    plan = json.loads(plan_path.read_text())
    estimate = plan["memory_fit"]["estimate"]
    predicted = estimate["per_rank"] + estimate["host_states"]
    measured = summary["peak_mem_bytes"][0]
    assert estimate["host_states"] > estimate["params"], "the offloaded states dominate"
    assert 0.85 * predicted <= measured <= 1.15 * predicted, (measured / 2**30, predicted / 2**30)


# tiny-moe widened until its states outweigh the rank's runtime term (RUNTIME_BYTES["cpu"], 0.6 GiB): 32 routed
# experts of 512 (2 per token) in 3 MoE layers, H = 512, about 81M parameters of which 75M in the fused expert tensors
MOE_OVERRIDES = {"hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 512, "n_routed_experts": 32,
                 "n_group": 4, "topk_group": 2, "q_lora_rank": 128, "kv_lora_rank": 64, "qk_nope_head_dim": 64,
                 "qk_rope_head_dim": 32, "v_head_dim": 64}


@pytest.mark.parametrize("ranks,engine,expert_parallel", [(1, "deepspeed", 1), (2, "deepspeed", 1), (2, "ddp", 2),
                                                         (2, "fsdp", 2), (2, "deepspeed", 2)])
def test_moe_run_rss_matches_the_memory_model(data, tmp_path, ranks, engine, expert_parallel):
    # fp32 on CPU, no offload: peak RSS per rank holds the expert and the non-expert states (ZeRO-2's formula over
    # each, the experts on their expert-data-parallel group; DDP's 16 bytes per parameter a rank holds, half the
    # experts at EP 2), MoE and MLA activations (the busiest expert-parallel rank's), the buffers, the runtime
    config, results = data
    # DeepSpeed splits experts with AutoEP, whose layer has no balance loss
    overrides = {**MOE_OVERRIDES, "aux_loss_alpha": 0.0} if engine == "deepspeed" and expert_parallel > 1 else \
        MOE_OVERRIDES
    config = {**config, "model": {**config["model"], "preset": "tiny-moe", "implementation": "native",
                                  "overrides": overrides, "seq_len": 64}}
    plan_path = plan_for((config, results), tmp_path, gpus=ranks, global_batch_size=None, engine=engine,
                         zero_stage={"deepspeed": 2, "ddp": 0, "fsdp": 3}[engine], expert_parallel=expert_parallel,
                         precision="fp32", micro_batch_size=4, grad_accum_steps=1, max_steps=2, warmup_steps=1,
                         memory_fit="strict", eval_every=None, save_checkpoints=False)
    assert run(plan_path, ranks, tmp_path / "train.log") == 0, (tmp_path / "train.log").read_text()[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    estimate = json.loads(plan_path.read_text())["memory_fit"]["estimate"]
    assert estimate["expert_states"] > estimate["non_expert_states"] > 0
    assert estimate["model_states"] > estimate["runtime"], "the model's terms, not the runtime, dominate"
    predicted = estimate["per_rank"] + estimate["host_states"]
    ratios = [measured / predicted for measured in summary["peak_mem_bytes"]]
    print(f"tiny-moe {engine} EP {expert_parallel} fp32, {ranks} rank(s): measured ÷ predicted "
          f"{[round(r, 3) for r in ratios]} (predicted {predicted / 2**30:.3f} GiB)")
    assert all(0.85 <= ratio <= 1.15 for ratio in ratios), ratios
