"""The pre-flight memory model: ZeRO formulas, activations, the guard on the main run and its advice."""
import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from pretrain_bench.config.schema import BenchSettings
from pretrain_bench.core import devices
from pretrain_bench.train.memory import model as memory_model
from pretrain_bench.train.memory.fit import fit_run
from pretrain_bench.train.memory.model import GB, GIB, Budget, estimate, judge, model_state_bytes
from pretrain_bench.train.plan import make_plan
from pretrain_bench.train.settings import ConfigError, TrainSettings
from pretrain_bench.workflow.experiment import load_config, plan_config

ROOT = Path(__file__).resolve().parents[2]

PSI = 7_000_000_000


def states(psi, n, stage, precision="fp16", **kw):
    s = model_state_bytes(psi, n, stage, precision, **kw)
    return s["params"] + s["grads"] + s["optimizer"]


def test_zero_paper_mixed_precision_formulas():
    # ZeRO paper §3.1 / Fig. 1 with K = 12, N = 3: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N.
    assert states(PSI, 3, 0) == 16 * PSI
    assert states(PSI, 3, 1) == pytest.approx(4 * PSI + 12 * PSI / 3, abs=3)
    assert states(PSI, 3, 2) == pytest.approx(2 * PSI + 14 * PSI / 3, abs=3)
    assert states(PSI, 3, 3) == pytest.approx(16 * PSI / 3, abs=3)
    # the source articles' "physics": 112 GB on one GPU, ~46.7 GB per GPU on three with ZeRO-2
    assert states(PSI, 1, 0) / GB == pytest.approx(112)
    assert states(PSI, 3, 2) / GB == pytest.approx(46.67, abs=0.01)
    assert states(PSI, 3, 2, precision="bf16") == states(PSI, 3, 2)


def test_fp32_constants_follow_deepspeed():
    assert states(PSI, 4, 0, "fp32") == 16 * PSI
    assert states(PSI, 4, 1, "fp32") == pytest.approx(8 * PSI + 12 * PSI / 4, abs=3)
    assert states(PSI, 4, 2, "fp32") == pytest.approx(4 * PSI + 16 * PSI / 4, abs=3)
    assert states(PSI, 4, 3, "fp32") == pytest.approx(16 * PSI / 4, abs=3)


def test_offload_moves_the_optimizer_part_to_the_host():
    s = model_state_bytes(PSI, 3, 2, "fp16", offload_optimizer="cpu")
    assert s["optimizer"] == 0 and s["grads"] == 0 and s["params"] == 2 * PSI  # ~2Ψ = 14 GB stays on the GPU
    # 12Ψ/N Adam + master, 4Ψ/N fp32 gradients and the 2Ψ/N 16-bit parameter buffer
    assert s["host"] == pytest.approx(18 * PSI / 3, abs=5)
    s3 = model_state_bytes(PSI, 3, 3, "fp16", offload_optimizer="cpu", offload_param="cpu")
    assert s3["params"] == s3["grads"] == s3["optimizer"] == 0
    assert "host RAM" in s3["formula"]


def test_offload_host_terms_follow_deepspeed_line_by_line():
    largest = 102_400 * 4_096  # DeepSeek-7B's LM head
    terms = memory_model.offload_host_terms(PSI, 3, "fp16", largest)
    expected = {"master": 4 * PSI / 3, "adam": 8 * PSI / 3, "grads": 4 * PSI / 3, "param_buffer": 2 * PSI / 3,
                "grad_staging": 2 * largest}
    assert {k: v for k, (v, _) in terms.items()} == pytest.approx(expected, abs=1)
    assert all("stage_1_and_2.py" in source or "CPUAdam" in source for _, source in terms.values())
    # with torch's power-of-two rounding of pinned blocks (what the launcher's allocator option avoids)
    rounded = memory_model.offload_host_terms(PSI, 3, "fp16", largest, pinned_rounding=True)
    pow2 = memory_model.pow2ceil
    excess = sum(pow2(terms[t][0]) - terms[t][0] for t in ("master", "grads", "param_buffer", "grad_staging"))
    assert rounded["pinned_rounding"][0] == pytest.approx(excess, abs=4)
    assert pow2(int(4 * PSI / 3)) == 2**34  # 9.3 GB → 16 GiB
    # 7B ZeRO-2 + CPU offload on 3 ranks: ~124 GiB of host RAM with exact pinning (more than a 128 GB box has free)
    est = estimate(memory_model.RunShape(
        parameters=6_910_365_696, layers=30, hidden_size=4096, kv_size=4096, ffn_size=11008, vocab_size=102_400,
        seq_len=128, micro_batch_size=8, ranks=3, zero_stage=2, precision="fp16", offload_optimizer="cpu"))
    assert 3 * (est.host_states + memory_model.CUDA_RANK_HOST_BYTES) / GIB == pytest.approx(124.2, abs=0.1)


def test_stage3_offload_host_terms_follow_deepspeed_line_by_line():
    largest = 102_400 * 4_096  # DeepSeek-7B's LM head
    terms = memory_model.stage3_offload_host_terms(PSI, 3, "fp16", largest)
    part = PSI / 3
    expected = {"master": 4 * part, "adam": 8 * part, "grads": 4 * part, "grad_partition_buffer": 2 * part,
                "transient": 3 * part}  # fp16: the overflow check's isinf (16-bit abs + bool) outweighs the cast
    assert {k: v for k, (v, _) in terms.items()} == pytest.approx(expected, abs=1)
    assert all("stage3.py" in source or "CPUAdam" in source for _, source in terms.values())
    assert "isinf" in terms["transient"][1]
    # bf16 has no overflow check: the largest transient is one gradient partition cast to fp32
    bf16 = memory_model.stage3_offload_host_terms(PSI, 3, "bf16", largest)
    assert bf16["transient"][0] == pytest.approx(4 * largest / 3, abs=1) and "stage3.py:1456" in bf16["transient"][1]
    # fp32 keeps its gradient buffer in fp32; parameter offload adds the pinned 16-bit partition
    assert memory_model.stage3_offload_host_terms(PSI, 3, "fp32", largest)["grad_partition_buffer"][0] == int(4 * part)
    with_params = memory_model.stage3_offload_host_terms(PSI, 3, "fp16", largest, offload_param="cpu")
    assert with_params["param_buffer"][0] == int(2 * part) and "stage3.py:906" in with_params["param_buffer"][1]
    # pinned rounding: each 1e9-element sub-group's fp32 .grad and the flat 16-bit buffer round up to a power of two
    rounded = memory_model.stage3_offload_host_terms(PSI, 3, "fp16", largest, pinned_rounding=True)
    pow2 = memory_model.pow2ceil
    full, rest = divmod(int(part), memory_model.SUB_GROUP_ELEMENTS)
    excess = 4 * (full * (pow2(10**9) - 10**9) + pow2(rest) - rest) + pow2(int(2 * part)) - int(2 * part)
    assert rounded["pinned_rounding"][0] == pytest.approx(excess, abs=8)
    # ZeRO-Infinity: master and moments on NVMe; the host keeps one fp32 buffer of the largest sub-group's whole
    # parameters (N × its partition) as every sub-group's .grad, 4 fp32 swap buffers of a sub-group, the flat
    # gradient buffer, up to 1e9 parameters plus the parameter swap buffers, and the same transients
    nvme = memory_model.stage3_offload_host_terms(PSI, 3, "fp16", largest, offload_param="nvme",
                                                  offload_optimizer="nvme")
    group = 10**9 + largest / 3  # a sub-group closes past 1e9 elements: at most one parameter's partition more
    assert {k: v for k, (v, _) in nvme.items()} == pytest.approx({
        "grads": 4 * 3 * group, "swap_buffers": 4 * group * 4, "grad_partition_buffer": 2 * part,
        "param_buffer": 2 * 10**9 + 2 * 5 * 10**8, "transient": 3 * part}, abs=4)
    assert "stage3.py:1306" in nvme["grads"][1] and "optimizer_utils.py:187" in nvme["swap_buffers"][1]
    # the model's host figure is their sum, and the state formula says 18Ψ/N
    states = model_state_bytes(PSI, 3, 3, "fp16", offload_optimizer="cpu", largest=largest)
    assert states["host"] == sum(v for v, _ in terms.values()) and "18Ψ/N in host RAM" in states["formula"]


def test_zero3_buffers_count_the_reduce_scatter_copy():
    shape = dict(parameters=6_910_365_696, layers=30, hidden_size=4096, kv_size=4096, ffn_size=11008,
                 vocab_size=102_400, seq_len=128, micro_batch_size=8, ranks=3, zero_stage=3, precision="fp16")
    terms = memory_model.buffer_terms(memory_model.RunShape(**shape))
    assert terms["reduce_scatter_copy"][0] == 2 * memory_model.REDUCE_BUCKET_ELEMENTS
    small = memory_model.buffer_terms(memory_model.RunShape(**{**shape, "parameters": 10**6}, device="cpu"))
    assert small["reduce_scatter_copy"][0] == 2 * 10**6 and "coalesced_collectives.py:122" in small[
        "reduce_scatter_copy"][1]


def test_gpu_buffers_count_the_norm_copies_of_the_largest_gradient():
    shape = dict(parameters=6_910_365_696, layers=30, hidden_size=4096, kv_size=4096, ffn_size=11008,
                 vocab_size=102_400, seq_len=128, micro_batch_size=8, ranks=3, zero_stage=2, precision="fp16")
    largest = 102_400 * 4_096
    offload = memory_model.buffer_terms(memory_model.RunShape(**shape, offload_optimizer="cpu"))
    assert offload["norm_copies"][0] == 12 * largest  # fp64 (3.1 GiB) + fp32 (1.6 GiB) copies of the LM head
    assert offload["offload_staging"][0] == 2 * largest and offload["buckets"][0] == 2 * 500_000_000 * 2
    plain = memory_model.buffer_terms(memory_model.RunShape(**shape))
    assert plain["norm_copies"][0] == 8 * largest and "offload_staging" not in plain
    total, formula = memory_model.buffer_bytes(memory_model.RunShape(**shape, offload_optimizer="cpu"))
    assert total == sum(v for v, _ in offload.values()) and "stage_1_and_2.py:1886" in formula


def test_cpu_norm_copy_counts_only_beyond_the_freed_bucket():
    # on CPU the backward's bucket is freed (its pages leave the RSS) before the step's fp64 norm copy is made, so
    # the copy adds only what it exceeds the bucket by; CUDA keeps both (the caching allocator's reserve)
    shape = dict(layers=4, hidden_size=256, kv_size=256, ffn_size=688, vocab_size=4096, seq_len=128,
                 micro_batch_size=8, ranks=1, zero_stage=2, precision="fp32", device="cpu")
    small = memory_model.buffer_terms(memory_model.RunShape(parameters=10_000_000, **shape))
    assert small["buckets"][0] == 4 * 10_000_000 and small["norm_copies"][0] == 0  # 8 × 1.05M < 40 MB
    # a bucket capped at 5e8 elements under a larger fp64 piece: the excess counts
    big = memory_model.RunShape(parameters=3 * 10**9, **{**shape, "vocab_size": 300_000, "hidden_size": 4096})
    terms = memory_model.buffer_terms(big)
    assert terms["buckets"][0] == 4 * 500_000_000
    assert terms["norm_copies"][0] == 8 * big.largest_parameter - 4 * 500_000_000 > 0
    assert "beyond the bucket" in terms["norm_copies"][1]
    gpu = memory_model.buffer_terms(replace(big, device="cuda"))
    assert gpu["norm_copies"][0] == 8 * big.largest_parameter


def run(**kw):
    base = dict(parameters=10_000_000, layers=4, hidden_size=256, kv_size=256, ffn_size=688, vocab_size=4096,
                seq_len=128, micro_batch_size=8, ranks=2, zero_stage=2, precision="fp32", device="cpu")
    return memory_model.RunShape(**{**base, **kw})


def test_activations_scale_with_tokens_and_checkpointing_saves():
    one = memory_model.activation_bytes(run(micro_batch_size=1))
    assert memory_model.activation_bytes(run(micro_batch_size=4)) == 4 * one
    assert memory_model.activation_bytes(run(activation_checkpointing=True)) < memory_model.activation_bytes(run())
    assert memory_model.activation_bytes(run(precision="bf16")) < memory_model.activation_bytes(run())


def test_cpu_ranks_share_host_ram():
    est = estimate(run(ranks=3))
    budget = Budget("cpu", 4 * GIB, "test", 4 * GIB, "test")
    verdict = judge(est, run(ranks=3), budget)
    assert verdict.need_bytes == 3 * est.per_rank and verdict.fits
    small = Budget("cpu", GIB, "test", GIB, "test")
    assert not judge(est, run(ranks=3), small).fits


def default_config():
    return load_config(ROOT / "config.yaml")


def check_fits(config, settings, what="the training run"):
    """The pre-flight as train.memory_fit: strict runs it: the record, or ConfigError."""
    return fit_run(plan_config(config), replace(settings, memory_fit="strict"), what=what)[1]


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(devices, "nvidia_smi_memory", lambda: [])


def test_default_config_is_stopped_in_seconds_with_what_would_fit(no_gpu):
    config = default_config()
    started = time.perf_counter()
    with pytest.raises(ConfigError) as error:
        check_fits(config, TrainSettings.from_config(config["train"]), what="the main run")
    assert time.perf_counter() - started < 2
    message = str(error.value)
    # DeepSeek-7B's 6.91e9 parameters: 2Ψ + 14Ψ/3 = 46.1 GB of model states per GPU
    assert "model states alone need 46.1 GB" in message and "2Ψ + 14Ψ/N" in message
    assert "has 24.0 GiB" in message and "benchmark.device_memory_gib" in message
    assert "train.offload_optimizer: cpu" in message and "host RAM" in message
    assert "train.zero_stage: 3" in message
    assert "num_hidden_layers" in message
    # ZeRO-2 with the optimizer offloaded still holds 2Ψ, the LM head's norm copies and activations on the GPU
    offload = next(line for line in message.splitlines() if "- optimizer offload:" in line)
    assert "needs 27.5 GiB per GPU" in offload and offload.endswith("[does not fit]")
    # ZeRO-3 + CPU offload holds 18Ψ/N on the host per rank, and fp16's overflow check 3Ψ/N more while it runs:
    # (21Ψ/3 + 2 GiB per rank process) × 3 ranks is more than the box's 128 GiB
    zero3_offload = next(line for line in message.splitlines() if "- ZeRO-3 with optimizer offload:" in line)
    assert "host RAM 141.2 GiB for 3 ranks, has 128.0 GiB" in zero3_offload
    assert zero3_offload.endswith("[does not fit]")
    zero3 = next(line for line in message.splitlines() if "- ZeRO-3: " in line)
    assert zero3.endswith("[does not fit]")


def test_guard_passes_on_big_gpus_and_with_force(monkeypatch):
    config = default_config()
    settings = TrainSettings.from_config({**config["train"], "memory_fit": "strict"})
    monkeypatch.setattr(devices, "nvidia_smi_memory", lambda: [141 * GIB] * 3)
    # GPUs detected: this machine's RAM counts (benchmark.host_memory_gib describes a machine without them here)
    monkeypatch.setattr(memory_model, "host_memory_bytes", lambda: 4 * GIB)
    with pytest.raises(ConfigError, match="host RAM 6.0 GiB for 3 ranks, has 4.0 GiB"):
        check_fits(config, settings)  # 2 GiB per CUDA rank process; the model is built on the GPU, not here
    monkeypatch.setattr(memory_model, "host_memory_bytes", lambda: 512 * GIB)
    assert check_fits(config, settings)["fits"]
    monkeypatch.setattr(devices, "nvidia_smi_memory", lambda: [])
    config["benchmark"]["force"] = True
    assert check_fits(config, settings)["fits"] is False  # reported, not raised


def test_make_plan_runs_the_guard_before_anything_else(tmp_path, no_gpu):
    config = default_config()
    config["train"]["memory_fit"] = "strict"
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"vocab_size": 102400, "splits": {"val": {"shards": [{"tokens": 10**7}]}}}))
    with pytest.raises(ConfigError, match="pre-flight: the pretrain run is predicted not to fit"):
        make_plan(plan_config(config), index=index, tokenizer=tmp_path, out_dir=tmp_path / "out",
                  state_dir=tmp_path / "state")
    # in bf16 (no overflow check over the host's gradient buffer) ZeRO-3 + CPU offload fits the 128 GiB box
    config["train"].update(zero_stage=3, offload_optimizer="cpu", precision="bf16")
    fits = make_plan(plan_config(config), index=index, tokenizer=tmp_path, out_dir=tmp_path / "o",
                     state_dir=tmp_path / "s")
    assert fits.memory_fit["fits"] and fits.memory_fit["estimate"]["optimizer"] == 0


def test_tiny_config_fits_on_this_machine():
    config = default_config()
    tiny = yaml.safe_load((ROOT / "config" / "tiny-cpu.yaml").read_text())
    for key, value in tiny.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    result = check_fits(config, TrainSettings.from_config(config["train"]))
    assert result["fits"] and result["budget"]["device"] == "cpu"
    assert result["estimate"]["per_rank"] < 2 * GIB


def test_fewer_layers_advice_fits_and_more_would_not(no_gpu):
    config = default_config()
    settings = TrainSettings.from_config(config["train"])
    shape = memory_model.run_shape(plan_config(config), settings, "cuda")
    budget = memory_model.detect_budget("cuda", BenchSettings.from_config(config))
    layers = memory_model._max_layers(shape, budget)
    per_layer = memory_model._per_layer_params(shape)

    def fits(n):
        smaller = replace(shape, layers=n, parameters=shape.parameters - (shape.layers - n) * per_layer)
        return judge(estimate(smaller), smaller, budget).fits
    assert 1 <= layers < shape.layers and fits(layers) and not fits(layers + 1)


def test_nvidia_smi_runs_once_for_names_and_memory(monkeypatch, tmp_path):
    calls = tmp_path / "calls"
    fake = tmp_path / "nvidia-smi"  # two GPUs, one with a comma in its name
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n"
                    "printf 'NVIDIA H200, SXM, 143771, 140000\\nNVIDIA L4, 23034, 1000\\n'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    devices._nvidia_smi_table.cache_clear()
    try:
        assert devices.gpu_names() == ["NVIDIA H200, SXM", "NVIDIA L4"]
        assert devices.nvidia_smi_memory() == [143771 * 1024**2, 23034 * 1024**2]
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # read at each call, not cached
        assert devices.gpu_names() == ["NVIDIA L4"]
        assert devices.resolve_device_cheaply("auto") == "cuda"
        assert devices.nvidia_smi_free_memory() == [1000 * 1024**2]
        assert calls.read_text().splitlines() == [
            "--query-gpu=name,memory.total,memory.free --format=csv,noheader,nounits"]
    finally:
        devices._nvidia_smi_table.cache_clear()


def test_the_pre_flight_budgets_the_free_memory_of_the_gpus(monkeypatch, tmp_path):
    from test_gpu_smoke import fake_nvidia_smi

    # two RTX 4090s with 24,564 MiB each, 23,012 MiB free (a display and its desktop hold the rest)
    monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path)}:/usr/bin:/bin")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    devices._nvidia_smi_table.cache_clear()
    try:
        budget = memory_model.detect_budget("cuda", BenchSettings.from_config(default_config()))
    finally:
        devices._nvidia_smi_table.cache_clear()
    assert budget.device_bytes == 23012 * 1024**2 and budget.gpu_count == 2
    assert budget.device_source == "nvidia-smi memory.free: smallest of 2 GPU(s) (22.5 of 24.0 GiB free)"
