"""The wall-time prediction's offload terms: host Adam, PCIe copies and NVMe swaps per optimizer step."""
import pytest

from pretrain_bench.bench.matrix import (
    PREVIEW_STARTUP_S,
    RECOMPUTE_FACTOR,
    cost_preview,
    model_flops_per_token,
    preview_text,
)
from pretrain_bench.config.schema import ModelSettings
from pretrain_bench.train.memory import offload as offload_time
from pretrain_bench.train.memory.model import GIB
from pretrain_bench.train.memory.offload import FORMULA, OffloadStep, offload_seconds, planned_cores, usable_cores
from pretrain_bench.train.models.llama import count_parameters
from pretrain_bench.train.models.registry import model_shape
from pretrain_bench.train.settings import TrainSettings

PSI = 6_910_365_696  # DeepSeek-7B
RATE, CORES, PCIE, NVME = 2e8, 16, 25e9, 3e9
BUDGET = {"device": "cuda", "device_bytes": 24 * GIB, "host_bytes": 128 * GIB}


def empty_matrix(cores=CORES):
    """A planned matrix without cells (bench_matrix.plan_matrix's keys the preview reads)."""
    return {"device": "cuda", "cells": [], "steps": 5, "repeats": 1, "budget": BUDGET, "force": False,
            "host_cores": cores, "host_cores_source": "benchmark.host_cores, no GPU detected here"}


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
    model = ModelSettings(preset="deepseek-7b", seq_len=128)
    main = TrainSettings(gpus=3, device="cuda", zero_stage=3, precision="fp16", micro_batch_size=8,
                         offload_optimizer="cpu", max_steps=10)
    matrix = empty_matrix()
    preview = cost_preview(matrix, main, model, 102_400, 165e12, "test")
    psi = count_parameters(model_shape(model, 102_400))["total"]
    offload = offload_seconds(OffloadStep(psi, 3, "fp16", "cpu"), cores=CORES)
    compute = 24 * 128 * model_flops_per_token(model, 102_400) / (165e12 * 3)
    assert preview["main"]["min_s"] == pytest.approx(10 * (compute + offload["total_s"]) + PREVIEW_STARTUP_S["cuda"])
    assert offload["adam_s"] > compute  # host Adam over Ψ/N per rank dominates an offloaded step
    text = preview_text(preview)
    assert FORMULA in text and "DeepSpeedCPUAdam measured" in text and "GB/s" in text
    assert "× 16 cores (assumed: benchmark.host_cores, no GPU detected here)" in text
    assert "main run (rule pretrain): ~ " in text and f"offload {offload['total_s']:,.1f} s per step" in text
    # without offload the 100 % MFU figure stays a hard lower bound and no offload formula is printed
    plain = preview_text(cost_preview(matrix, TrainSettings(gpus=3, device="cuda", zero_stage=3, precision="fp16",
                                                            micro_batch_size=8, max_steps=10),
                                      model, 102_400, 165e12, "test"))
    assert "main run (rule pretrain): ≥ " in plain and FORMULA not in plain


def test_activation_checkpointing_adds_a_forward_to_the_compute_time():
    model = ModelSettings(preset="deepseek-7b", seq_len=128)
    matrix = empty_matrix()
    settings = dict(gpus=3, device="cuda", zero_stage=2, precision="fp16", micro_batch_size=8, max_steps=10)
    plain = cost_preview(matrix, TrainSettings(**settings), model, 102_400, 165e12, "test")
    checkpointed = cost_preview(matrix, TrainSettings(**settings, activation_checkpointing=True), model, 102_400,
                                165e12, "test")
    startup = PREVIEW_STARTUP_S["cuda"]
    assert checkpointed["main"]["min_s"] - startup == pytest.approx((plain["main"]["min_s"] - startup) * 4 / 3)
    assert RECOMPUTE_FACTOR == pytest.approx(8 / 6)
    assert "× 1.33 (activation checkpointing's second forward)" in preview_text(checkpointed)
    assert "second forward" not in preview_text(plain)


def test_host_adam_divides_by_the_planned_machines_cores_not_this_ones(monkeypatch):
    monkeypatch.setattr(offload_time, "usable_cores", lambda: 2)  # a small planning machine
    # planning the articles' box (no GPU here): benchmark.host_cores
    assert planned_cores("cuda", gpu_detected=False, host_cores=16) == (16, "benchmark.host_cores, no GPU detected "
                                                                             "here")
    cores, source = planned_cores("cuda", gpu_detected=False, host_cores=None)
    assert cores == 2 and "set benchmark.host_cores" in source
    # GPUs here, or a CPU run: this machine's own usable cores, whatever benchmark.host_cores says
    assert planned_cores("cuda", gpu_detected=True, host_cores=16) == (2, "this machine's usable cores")
    assert planned_cores("cpu", gpu_detected=False, host_cores=16) == (2, "this machine's usable cores")
    model = ModelSettings(preset="deepseek-7b", seq_len=128)
    main = TrainSettings(gpus=3, device="cuda", zero_stage=2, precision="fp16", micro_batch_size=8,
                         offload_optimizer="cpu", max_steps=10)
    on_16 = cost_preview(empty_matrix(16), main, model, 102_400, 165e12, "test")["main_offload"]
    on_2 = cost_preview(empty_matrix(2), main, model, 102_400, 165e12, "test")["main_offload"]
    assert on_16["adam_s"] == pytest.approx(PSI / (RATE * 16)) and on_2["adam_s"] == pytest.approx(8 * on_16["adam_s"])


def test_usable_cores_are_the_affinity_mask():
    import os

    assert usable_cores() == len(os.sched_getaffinity(0))
