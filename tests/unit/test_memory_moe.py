"""The memory model of a mixture-of-experts (DeepSeek) model: expert vs non-expert states, the gathered unit with
fused experts, MoE and MLA activations, and the pre-flight's verdicts for DeepSeek-V2-Lite and DeepSeek-V3."""
from dataclasses import replace
from pathlib import Path

import pytest

from pretrain_bench.core import devices
from pretrain_bench.train.memory import model as memory_model
from pretrain_bench.train.memory.fit import fit_run
from pretrain_bench.train.memory.model import GIB, estimate, model_state_bytes, run_shape
from pretrain_bench.train.models.deepseek import PRESETS, count_parameters
from pretrain_bench.train.models.registry import MODEL_FAMILIES
from pretrain_bench.train.settings import ConfigError, TrainSettings
from pretrain_bench.workflow.experiment import load_config, plan_config

ROOT = Path(__file__).resolve().parents[2]

# The published configs (deepseek-ai/DeepSeek-V3 and DeepSeek-V2-Lite config.json) and parameter counts
# (DeepSeek-V3 report: 671B total, 37B activated; DeepSeek-V2 report: V2-Lite 15.7B total, 2.4B activated).
# Routed experts by hand: MoE layers × E × 3 (gate, up, down) × H × I.
V3_EXPERTS = (61 - 3) * 256 * 3 * 7168 * 2048
V2_LITE_EXPERTS = (27 - 1) * 64 * 3 * 2048 * 1408
PUBLISHED = {"deepseek-v3": (671e9, 37e9, V3_EXPERTS), "deepseek-v2-lite": (15.7e9, 2.4e9, V2_LITE_EXPERTS)}


def moe_run(preset="tiny-moe", vocab=2048, **kw):
    family = MODEL_FAMILIES["deepseek"]
    shape = replace(PRESETS[preset], vocab_size=PRESETS[preset].vocab_size or vocab)
    base = dict(parameters=count_parameters(shape)["total"], **family.memory_dims(shape), seq_len=64,
                micro_batch_size=2, ranks=2, zero_stage=2, precision="fp32", device="cpu")
    return memory_model.RunShape(**{**base, **kw})


def test_states_are_zero_over_the_non_expert_plus_zero_over_the_experts():
    for stage in range(4):
        run = moe_run(zero_stage=stage, ranks=4, precision="bf16")
        est = estimate(run)
        ne = model_state_bytes(run.non_expert_parameters, 4, stage, "bf16")
        ex = model_state_bytes(run.expert_parameters, 4, stage, "bf16")
        assert est.expert_states == ex["params"] + ex["grads"] + ex["optimizer"]
        assert est.non_expert_states == ne["params"] + ne["grads"] + ne["optimizer"]
        assert "non-expert" in est.state_formula and "EP 1" in est.state_formula
    # expert parallelism enters in one place: EP 2 of 4 ranks holds half the experts, on a 2-rank group
    run = moe_run(zero_stage=2, ranks=4, expert_parallel=2)
    ex = model_state_bytes(run.expert_parameters // 2, 2, 2, "fp32")
    assert estimate(run).expert_states == ex["params"] + ex["grads"] + ex["optimizer"]
    with pytest.raises(ValueError, match="expert parallelism 3"):
        estimate(moe_run(ranks=4, expert_parallel=3))


def test_a_dense_model_has_no_expert_states():
    run = replace(moe_run(), moe=None, attention=None)
    est = estimate(run)
    assert est.expert_states == 0 and est.non_expert_states == est.model_states
    assert est.as_dict()["non_expert_states"] == est.model_states


def test_offloaded_expert_and_non_expert_host_terms_share_the_largest_staging_buffer():
    run = moe_run(zero_stage=2, offload_optimizer="cpu", device="cuda", precision="bf16")
    est = estimate(run)
    ne = model_state_bytes(run.non_expert_parameters, 2, 2, "bf16", "cpu",
                           largest=replace(run, moe=None).largest_parameter)
    ex = model_state_bytes(run.expert_parameters, 2, 2, "bf16", "cpu", largest=run.moe.largest_expert_tensor)
    staging = min(ne["host_terms"]["grad_staging"][0], ex["host_terms"]["grad_staging"][0])
    assert est.host_states == ne["host"] + ex["host"] - staging
    assert est.expert_host_states == est.host_states - ne["host"]


def test_the_gathered_unit_is_a_moe_layer_with_its_fused_experts():
    run = moe_run(zero_stage=3, device="cuda", precision="bf16")
    moe = run.moe
    assert run.largest_parameter == max(run.vocab_size * run.hidden_size, moe.largest_expert_tensor)
    assert run.gather_unit == max(moe.dense_layer_parameters, moe.moe_layer_parameters)
    buckets = memory_model.buffer_terms(run)["buckets"][0]
    assert buckets == 2 * (memory_model.REDUCE_BUCKET_ELEMENTS + memory_model.PREFETCH_BUCKET_ELEMENTS)  # tiny
    v3 = moe_run("deepseek-v3", zero_stage=3, ranks=8, device="cuda", precision="bf16")
    unit = v3.moe.moe_layer_parameters  # 11.5e9: attention, router, shared expert and 256 fused experts
    assert v3.gather_unit == unit and unit > 11e9
    assert memory_model.buffer_terms(v3)["buckets"][0] == 2 * (v3.moe.largest_expert_tensor + unit)
    fsdp = memory_model.torch_engine_terms(replace(v3, engine="fsdp"))[1]
    assert fsdp["layers_gathered"][0] == 2 * unit * 2
    assert memory_model.root_parameters(v3) == 2 * 129280 * 7168 + 7168  # embeddings, head, final norm


def test_moe_and_mla_activations_follow_the_stated_formula():
    run = moe_run(micro_batch_size=1, seq_len=64)  # fp32: b = 4
    b, h = 4, run.hidden_size
    a, moe = run.attention, run.moe
    qk, n = a.qk_nope_head_dim + a.qk_rope_head_dim, a.heads
    attention = b * (2 * h + 2 * a.q_lora_rank + n * qk + a.kv_lora_rank + a.qk_rope_head_dim + a.kv_lora_rank
                     + n * (a.qk_nope_head_dim + a.v_head_dim) + 2 * n * qk + n * a.v_head_dim) \
        + 4 * (h + a.q_lora_rank + a.kv_lora_rank)
    assert memory_model.attention_activations(run, b) == attention
    k, i = moe.experts_per_token, moe.expert_ffn_size
    ffn = b * (2 * h + k * (2 * h + 4 * i) + 4 * moe.shared_ffn_size) + 4 * h + 4 * moe.routed_experts * 2
    assert memory_model.moe_ffn_activations(run, b) == ffn
    dense = attention + b * (2 * h + 4 * run.ffn_size) + 4 * h
    layers = moe.dense_layers * dense + run.moe_layers * (attention + ffn)
    logits = run.vocab_size * 8
    assert memory_model.activation_bytes(run) == 64 * (layers + logits + 3 * b * h)
    checkpointed = run.layers * b * h + max(dense, attention + ffn)
    assert memory_model.activation_bytes(replace(run, activation_checkpointing=True)) == \
        64 * (checkpointed + logits + 3 * b * h)
    more_experts = replace(run, moe=replace(moe, experts_per_token=2 * k))
    assert memory_model.activation_bytes(more_experts) > memory_model.activation_bytes(run)


def test_fewer_layers_drop_moe_layers_first():
    run = moe_run("deepseek-v3", ranks=8)
    smaller = memory_model._fewer_layers(run, 4)  # 3 dense + 1 MoE
    assert smaller.moe_layers == 1 and smaller.expert_parameters == 256 * 3 * 7168 * 2048
    assert smaller.parameters == run.parameters - 57 * run.moe.moe_layer_parameters
    two = memory_model._fewer_layers(run, 2)
    assert two.moe_layers == 0 and two.moe.dense_layers == 2


def test_a_ddp_run_takes_its_expert_parallel_size_from_the_config():
    config = load_config(ROOT / "config.yaml", ROOT / "config/tiny-cpu.yaml")
    config["model"].update(preset="tiny-moe", implementation="native")
    config["train"].update(engine="ddp", zero_stage=0, gpus=4)
    one = TrainSettings.from_config(config["train"])
    two = replace(one, expert_parallel=2)
    run_one, run_two = run_shape(plan_config(config), one, "cpu"), run_shape(plan_config(config), two, "cpu")
    assert (run_one.expert_parallel, run_two.expert_parallel) == (1, 2)
    # DDP replicates: 16 bytes per expert parameter a rank holds, half of them under EP 2
    assert estimate(run_one).expert_states == 16 * run_one.expert_parameters
    assert estimate(run_two).expert_states == 16 * run_one.expert_parameters // 2



def test_expert_parallel_receive_buffers_and_all_to_all_bytes():
    # tiny-moe: E 8, K 2, 3 MoE layers. At EP 4 a rank holds 2 experts, so a token sends it at most 2 pairs: f = 4
    one = moe_run(ranks=4, engine="ddp", zero_stage=0)
    four = replace(one, expert_parallel=4)
    assert one.receive_factor == 1.0 and four.receive_factor == 4.0
    assert replace(four, expert_parallel=2).receive_factor == 2.0  # 4 experts per rank, K 2: 2·2/2
    # force-balanced routing: every rank receives its share
    assert replace(four, moe=replace(four.moe, force_balanced=True)).receive_factor == 1.0
    b, h, moe = 4, four.hidden_size, four.moe
    k, i = moe.experts_per_token, moe.expert_ffn_size
    assert memory_model.moe_ffn_activations(four, b) - memory_model.moe_ffn_activations(one, b) == \
        b * k * (2 * h + 4 * i) * 3  # the busiest rank runs f = 4 times its own pairs through its experts
    # the dispatch's send and receive buffers
    pairs = 2 * 64 * k  # micro-batch 2 × seq 64 × K
    terms = memory_model.torch_engine_terms(four)[1]
    assert terms["ep_exchange"][0] == pairs * h * b * (1 + 4) and "ep_exchange" not in \
        memory_model.torch_engine_terms(one)[1]
    # all-to-all: 4 exchanges (dispatch, combine, both backward) × MoE layers × pairs × H × b × (EP-1)/EP
    assert one.all_to_all_bytes() == 0 and estimate(one).all_to_all_bytes == 0
    assert four.all_to_all_bytes() == 4 * 3 * pairs * h * b * 3 // 4 == estimate(four).all_to_all_bytes



def test_fsdp_keeps_split_experts_whole_outside_its_shards():
    # EP 1: FSDP shards the experts with everything else over the 4 ranks; EP 2: each rank keeps its half of the
    # experts whole (16 bytes per parameter), and a MoE layer's gathered unit no longer holds them
    one = moe_run(ranks=4, engine="fsdp", zero_stage=3)
    two = replace(one, expert_parallel=2)
    assert estimate(one).expert_states == 16 * one.expert_parameters // 4
    assert estimate(two).expert_states == 16 * (one.expert_parameters // 2)
    assert estimate(two).non_expert_states == estimate(one).non_expert_states
    assert "kept whole outside FSDP" in estimate(two).state_formula
    gathered = {name: memory_model.torch_engine_terms(run)[1]["layers_gathered"][0] for name, run in
                (("one", one), ("two", two))}
    moe = one.moe
    unit = max(moe.moe_layer_parameters - moe.expert_parameters_per_layer, moe.dense_layer_parameters)
    assert gathered["two"] == 2 * unit * 4 < gathered["one"]


# ---- the pre-flight's verdicts ----------------------------------------------------------------------------------

def preflight(preset, gpus, gpu_gib, host_gib, disk_gib):
    """fit_run (what `snakemake -n` runs) for `preset` in bf16 under ZeRO-2 asked, on a planned GPU machine."""
    config = load_config(ROOT / "config.yaml")
    config["model"] = {**config["model"], "preset": preset}
    config["train"].update(gpus=gpus, precision="bf16")
    config["benchmark"].update(device_memory_gib=gpu_gib, host_memory_gib=host_gib, disk_gib=disk_gib)
    settings = TrainSettings.from_config(config["train"])
    run = run_shape(plan_config(config), settings, "cuda")
    with pytest.raises(ConfigError) as error:
        fit_run(plan_config(config), settings)
    return run, estimate(run), str(error.value)


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(devices, "nvidia_smi_memory", lambda: [])


@pytest.mark.parametrize("preset,gpus,gpu_gib,host_gib,disk_gib", [
    ("deepseek-v2-lite", 3, 24, 128, 1800),  # the articles' box (config.yaml)
    ("deepseek-v3", 3, 24, 128, 1800),
    ("deepseek-v3", 8, 141, 2048, 30000),  # an 8 × H200 node: 2 TiB RAM, 8 × 3.84 TB NVMe
])
def test_deepseek_verdicts_and_hand_calculated_states(no_gpu, preset, gpus, gpu_gib, host_gib, disk_gib):
    run, est, message = preflight(preset, gpus, gpu_gib, host_gib, disk_gib)
    total, active, experts = PUBLISHED[preset]
    counts = count_parameters(PRESETS[preset])
    assert abs(run.parameters - total) < 0.01 * total and abs(counts["active"] - active) < 0.11 * active
    assert run.expert_parameters == experts == counts["expert"]
    # ZeRO-2, bf16 (ZeRO paper §5): 2Ψ + 14Ψ/N bytes, over the non-expert and over the expert parameters
    for psi, got in ((run.parameters - experts, est.non_expert_states), (experts, est.expert_states)):
        assert abs(got - (2 * psi + 2 * psi / gpus + 12 * psi / gpus)) <= 3
    # ZeRO-3 + every offload still builds the whole model on one GPU first: 2Ψ bytes (memory_model.estimate's init)
    assert est.init == 2 * run.parameters
    assert "is predicted not to fit" in message and "non-expert Ψ_ne" in message
    if preset == "deepseek-v2-lite":
        # 2Ψ = 29.3 GiB of bf16 weights alone exceed a 24 GiB card; 4 of 27 layers would fit
        assert "fewer layers (4 of 27)" in message and "[fits]" in message
        assert "needs 109.6 GiB per GPU" in message
    elif gpus == 3:
        assert "(none of the single changes above is enough on this machine)" in message
        assert est.init / GIB > 1200
    else:
        # 8 × 141 GB: ZeRO-3 alone needs 16Ψ/8 + the build's 2Ψ; the offloads leave the 2Ψ build (1,250 GiB)
        assert "ZeRO-3: train.zero_stage: 3 → needs 1,346.5 GiB per GPU" in message
        assert "needs 1,250.9 GiB per GPU, has 141.0 GiB" in message
        assert "fewer layers (4 of 61)" in message and "[fits]" in message
