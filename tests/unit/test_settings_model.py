import math

import pytest

from pretrain_bench.train.engines.spec import deepspeed_config
from pretrain_bench.train.models.flops import flops_per_token, gpu_table_peak
from pretrain_bench.train.models.llama import build_model, count_parameters, resolve_shape
from pretrain_bench.train.settings import ConfigError, TrainSettings, check_settings


def settings(**kw):
    base = dict(gpus=3, device="cpu", comm_backend="gloo", precision="fp32", micro_batch_size=8,
                grad_accum_steps=1, global_batch_size=24)
    return TrainSettings.from_config({**base, **kw})


def test_global_batch_must_match_micro_accum_ranks():
    with pytest.raises(ConfigError, match=r"global_batch_size 24 is not micro_batch_size 8 × grad_accum_steps 3 × "
                                          r"ranks 3 .* = 72"):
        check_settings(settings(grad_accum_steps=3))
    check_settings(settings())  # 8 × 1 × 3 = 24 is fine


def test_fp16_on_cpu_is_rejected_before_launch():
    with pytest.raises(ConfigError, match="fp16 is not supported on a CPU run"):
        check_settings(settings(precision="fp16"))
    # 'auto' does not know the device yet; the launcher repeats the check with the resolved device
    check_settings(settings(precision="fp16", device="auto"))
    with pytest.raises(ConfigError, match="fp16"):
        check_settings(settings(precision="fp16", device="auto"), device="cpu")


def test_nccl_without_cuda_and_offload_param_without_stage3():
    with pytest.raises(ConfigError, match="nccl needs CUDA"):
        check_settings(settings(comm_backend="nccl"))
    with pytest.raises(ConfigError, match="offload_param=cpu needs train.zero_stage 3"):
        check_settings(settings(offload_param="cpu", zero_stage=2))
    with pytest.raises(ConfigError, match="unknown key"):
        TrainSettings.from_config({"gpus": 1, "zero": 2})


def test_deepspeed_config_reflects_settings():
    cfg = deepspeed_config(settings(zero_stage=3, precision="bf16", offload_param="cpu", offload_optimizer="cpu"),
                           "cpu", total_steps=100)
    assert cfg["train_batch_size"] == 24 and cfg["train_micro_batch_size_per_gpu"] == 8
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert cfg["bf16"] == {"enabled": True} and "fp16" not in cfg
    fp16 = deepspeed_config(TrainSettings.from_config({"gpus": 1, "precision": "fp16"}), "cuda", 10)
    assert fp16["fp16"]["enabled"] and fp16["fp16"]["loss_scale"] == 0  # 0 = dynamic loss scaling
    assert "scheduler" not in fp16  # the trainer hands DeepSpeed a LambdaLR over settings.learning_rate


def test_max_tokens_sets_the_step_count():
    s = settings(max_tokens=24 * 128 * 10 + 1)
    assert s.total_steps(128) == 11


@pytest.mark.parametrize("preset", ["tiny", "llama-125m"])
def test_parameter_count_equals_the_built_model(preset):
    shape = resolve_shape(preset, {"num_hidden_layers": 2}, tokenizer_vocab=4096)
    model = build_model(shape, 64, seed=0)
    assert count_parameters(shape)["total"] == sum(p.numel() for p in model.parameters())


def test_deepseek_7b_preset_has_deepseek_llm_shape():
    shape = resolve_shape("deepseek-7b", {}, tokenizer_vocab=102400)
    assert (shape.num_hidden_layers, shape.hidden_size, shape.num_attention_heads, shape.intermediate_size,
            shape.vocab_size) == (30, 4096, 32, 11008, 102400)
    assert 6.8e9 < count_parameters(shape)["total"] < 7.0e9


def test_shape_errors_name_the_field():
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        resolve_shape("llama-125m", {}, tokenizer_vocab=50000)
    with pytest.raises(ValueError, match="hidden_size 100 is not divisible"):
        resolve_shape("tiny", {"hidden_size": 100}, 4096)


def test_flops_formula_and_gpu_table():
    # 6N + 12·L·H·Q·T
    assert flops_per_token(1000, 2, 4, 8, 16) == 6000 + 12 * 2 * 4 * 8 * 16
    peak, source = gpu_table_peak("NVIDIA GeForce RTX 4090", "fp16")
    assert peak == 165.2e12 and "RTX 4090" in source
    assert gpu_table_peak("NVIDIA GeForce RTX 4090 D", "bf16")[0] == 147.0e12
    assert gpu_table_peak("NVIDIA H200", "bf16")[0] == 989.5e12
    assert gpu_table_peak("NVIDIA H200", "fp32") is None


def test_adam_needs_no_compiler_unless_fused_adam_is_prebuilt():
    s = settings(device="cuda", comm_backend="nccl", precision="bf16")
    assert deepspeed_config(s, "cuda", 10)["optimizer"]["params"]["torch_adam"] is True
    # torch's AdamW with its fused kernel, as DDP and FSDP build it (DeepSpeed passes the key through)
    assert deepspeed_config(s, "cuda", 10)["optimizer"]["params"]["fused"] is True
    assert deepspeed_config(settings(), "cpu", 10)["optimizer"]["params"]["fused"] is True
    assert not {"torch_adam", "fused"} & set(deepspeed_config(s, "cuda", 10, fused_adam=True)["optimizer"]["params"])
    # with the optimizer offloaded DeepSpeedCPUAdam runs (built with the host compiler): no torch_adam switch
    offloaded = settings(device="cuda", comm_backend="nccl", precision="bf16", offload_optimizer="cpu")
    assert "torch_adam" not in deepspeed_config(offloaded, "cuda", 10)["optimizer"]["params"]



def test_every_run_divides_by_the_machines_one_peak():
    from pretrain_bench.train.models.flops import plan_peak

    measured = {"peak_flops": 2.0e11, "peak_source": "measured: best bf16 matmul on 2 cores"}
    cpu = plan_peak(measured, None, "cpu", 3)  # three CPU ranks share the machine
    assert cpu["flops_per_rank"] * 3 == pytest.approx(2.0e11) and "rule measure_peak" in cpu["source"]
    gpu = plan_peak({"peak_flops": 165.2e12, "peak_source": "datasheet table: RTX 4090"}, None, "cuda", 3)
    assert gpu["flops_per_rank"] == 165.2e12  # each GPU brings its own
    assert plan_peak(measured, 100.0, "cpu", 3) == {"flops_per_rank": 1e14,
                                                    "source": "report.peak_tflops in the config"}


def test_learning_rate_schedules():
    from pretrain_bench.train.settings import learning_rate

    def rates(schedule, **kw):
        s = settings(lr=1.0, min_lr=0.1, warmup_steps=10, lr_schedule=schedule, **kw)
        return [learning_rate(step, s, 110) for step in range(110)]

    for schedule in ("cosine", "linear", "constant", "warmup-stable-decay"):
        r = rates(schedule)
        assert r[:10] == pytest.approx([(i + 1) / 10 for i in range(10)]), "linear warm-up to lr"
        assert max(r) == pytest.approx(1.0)
    cosine, linear, constant, wsd = (rates(s) for s in ("cosine", "linear", "constant", "warmup-stable-decay"))
    assert cosine[-1] == pytest.approx(0.1) and linear[-1] == pytest.approx(0.1) and wsd[-1] == pytest.approx(0.1)
    assert linear[60] == pytest.approx(1.0 - 0.9 * 51 / 100)
    assert cosine[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 51 / 100)))
    assert constant[10:] == [1.0] * 100
    assert wsd[10:90] == [1.0] * 80 and wsd[90] < 1.0, "stable until the last decay_fraction (20 of 100 steps)"
    with pytest.raises(ConfigError, match="train.lr_schedule 'step'"):
        check_settings(settings(lr_schedule="step"))


def test_adam_settings_and_deepspeed_passthrough():
    s = settings(adam_betas=[0.8, 0.99], adam_eps=1e-6,
                 deepspeed={"csv_monitor": {"enabled": True, "output_path": "m"},
                            "zero_optimization": {"reduce_bucket_size": 12345}, "flops_profiler": {"enabled": True}})
    check_settings(s)
    cfg = deepspeed_config(s, "cpu", 10)
    assert cfg["optimizer"]["params"]["betas"] == [0.8, 0.99] and cfg["optimizer"]["params"]["eps"] == 1e-6
    assert cfg["csv_monitor"] == {"enabled": True, "output_path": "m"} and cfg["flops_profiler"]["enabled"]
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 12345 and cfg["zero_optimization"]["stage"] == 2, \
        "a nested mapping is merged key by key"
    for extra, key in (({"optimizer": {"type": "SGD"}}, "train.lr, train.weight_decay, train.adam_betas"),
                       ({"train_batch_size": 48}, "train.global_batch_size"),
                       ({"zero_optimization": {"stage": 3}}, "train.zero_stage"),
                       ({"bf16": {"enabled": True}}, "train.precision"),
                       ({"scheduler": {}}, "train.lr_schedule"),
                       ({"gradient_clipping": 0.5}, "train.grad_clip")):
        with pytest.raises(ConfigError, match=r"train.deepspeed\S*: set " + key):
            check_settings(settings(deepspeed=extra))
