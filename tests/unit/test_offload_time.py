"""The wall-time prediction's offload terms: host Adam, PCIe copies and NVMe swaps per optimizer step."""
import pytest

from pretrain_bench.bench_matrix import (PREVIEW_STARTUP_S, RECOMPUTE_FACTOR, cost_preview, model_flops_per_token,
                                         preview_text)
from pretrain_bench.model import count_parameters, model_shape
from pretrain_bench.offload_time import FORMULA, OffloadStep, offload_seconds
from pretrain_bench.settings import TrainSettings

PSI = 6_910_365_696  # DeepSeek-7B
RATE, CORES, PCIE, NVME = 2e8, 16, 25e9, 3e9


def seconds(**step):
    return offload_seconds(OffloadStep(**{"parameters": PSI, "ranks": 3, "precision": "fp16", **step}), cores=CORES,
                           adam_rate=RATE, pcie=PCIE, nvme=NVME)


def test_nothing_offloaded_costs_nothing():
    assert seconds(offload_optimizer="none") == {"adam_s": 0, "pcie_s": 0, "nvme_s": 0, "total_s": 0}


def test_cpu_offload_is_host_adam_plus_pcie():
    step = seconds(offload_optimizer="cpu", grad_accum_steps=4)
    assert step["adam_s"] == pytest.approx(PSI / (RATE * CORES))  # every partition updated at once on the host
    # per rank: 16-bit gradients down on each of 4 micro-steps, updated parameters up once
    assert step["pcie_s"] == pytest.approx(2 * PSI / 3 * 5 / PCIE)
    assert step["nvme_s"] == 0 and step["total_s"] == pytest.approx(step["adam_s"] + step["pcie_s"])
    # fp32 moves 4 bytes an element; parameter offload fetches the partition for each forward and backward
    assert seconds(offload_optimizer="cpu", precision="fp32")["pcie_s"] == pytest.approx(4 * PSI / 3 * 2 / PCIE)
    params = seconds(offload_optimizer="cpu", offload_param="cpu")
    assert params["pcie_s"] == pytest.approx(2 * PSI / 3 * (2 + 2) / PCIE)
    # a CPU run's device is the host: no PCIe
    assert seconds(offload_optimizer="cpu", device="cpu")["pcie_s"] == 0


def test_nvme_offload_swaps_the_fp32_states_through_one_disk():
    step = seconds(offload_optimizer="nvme", offload_param="nvme")
    assert step["nvme_s"] == pytest.approx((32 * PSI + 2 * PSI * 3) / NVME)
    assert step["total_s"] == pytest.approx(step["adam_s"] + step["pcie_s"] + step["nvme_s"])


def test_the_preview_adds_the_offload_terms_and_prints_the_formula():
    model = {"preset": "deepseek-7b", "seq_len": 128, "overrides": {}}
    main = TrainSettings(gpus=3, device="cuda", zero_stage=3, precision="fp16", micro_batch_size=8,
                         offload_optimizer="cpu", max_steps=10)
    matrix = {"device": "cuda", "cells": [], "steps": 5, "repeats": 1}
    preview = cost_preview(matrix, main, model, 102_400, 165e12, "test")
    psi = count_parameters(model_shape(model, 102_400))["total"]
    offload = offload_seconds(OffloadStep(psi, 3, "fp16", "cpu"))
    compute = 24 * 128 * model_flops_per_token(model, 102_400) / (165e12 * 3)
    assert preview["main"]["min_s"] == pytest.approx(10 * (compute + offload["total_s"]) + PREVIEW_STARTUP_S["cuda"])
    assert offload["adam_s"] > compute  # host Adam over Ψ/N per rank dominates an offloaded step
    text = preview_text(preview)
    assert FORMULA in text and "DeepSpeedCPUAdam measured" in text and "GB/s" in text
    assert "main run (rule pretrain): ~ " in text and f"offload {offload['total_s']:,.1f} s per step" in text
    # without offload the 100 % MFU figure stays a hard lower bound and no offload formula is printed
    plain = preview_text(cost_preview(matrix, TrainSettings(gpus=3, device="cuda", zero_stage=3, precision="fp16",
                                                            micro_batch_size=8, max_steps=10),
                                      model, 102_400, 165e12, "test"))
    assert "main run (rule pretrain): ≥ " in plain and FORMULA not in plain


def test_activation_checkpointing_adds_a_forward_to_the_compute_time():
    model = {"preset": "deepseek-7b", "seq_len": 128, "overrides": {}}
    matrix = {"device": "cuda", "cells": [], "steps": 5, "repeats": 1}
    settings = dict(gpus=3, device="cuda", zero_stage=2, precision="fp16", micro_batch_size=8, max_steps=10)
    plain = cost_preview(matrix, TrainSettings(**settings), model, 102_400, 165e12, "test")
    checkpointed = cost_preview(matrix, TrainSettings(**settings, activation_checkpointing=True), model, 102_400,
                                165e12, "test")
    startup = PREVIEW_STARTUP_S["cuda"]
    assert checkpointed["main"]["min_s"] - startup == pytest.approx((plain["main"]["min_s"] - startup) * 4 / 3)
    assert RECOMPUTE_FACTOR == pytest.approx(8 / 6)
    assert "× 1.33 (activation checkpointing's second forward)" in preview_text(checkpointed)
    assert "second forward" not in preview_text(plain)
