"""`make gpu-smoke-cpu` in its short form: every section of the GPU smoke run on CPU (gloo, bf16 for fp16, fp32 where
the CPU emulates bf16), with tiny sizes and 2 steps a run (the tiny size leaves 1 out of the timing: the other is the
steady state its tokens/s, MFU and compile comparison come from), through the launcher as on a GPU; its JSON holds
each run's figures and the smoke's own wall time."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_smoke_cpu_twin_runs_every_section_and_reports_each(tmp_path):
    out = tmp_path / "gpu-smoke-cpu.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_smoke.py"), str(out), "--device", "cpu",
                           "--size", "tiny", "--steps", "2", "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=900)
    report = json.loads(out.read_text())
    failed = {run["name"]: run["log_tail"] for run in report["runs"] if run["exit_code"]}
    assert proc.returncode == 0 and not failed, (proc.stdout[-3000:], proc.stderr[-3000:], failed)
    assert report["device"] == "cpu" and report["hardware"]["device"] == "cpu"  # machine_facts, measured in a child
    # the machine's peak, whatever precision the runs train in: fp32 where bf16 is emulated, else the faster of both
    emulated = not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert report["peak"]["peak_source"].startswith("measured: best fp32 square matmul x @ wᵀ (" if emulated else
                                                    "measured: best ")
    assert ("bf16 not measured: this CPU has no native bf16 matmuls" in report["peak"]["peak_source"]) == emulated
    runs = {run["name"]: run for run in report["runs"]}
    assert list(runs) == ["default-setup", "zero3-offload", "zero2-large", "zero2-loss-scaling", "ddp", "fsdp",
                          "zero2-large-compile", "zero2-2-ranks", "gloo-on-cuda"]
    # every section's verdict: all pass here but gloo on CUDA tensors, which needs a GPU (neither pass nor fail)
    statuses = {section["name"]: section["status"] for section in report["sections"]}
    assert statuses == {**{name: "pass" for name in runs}, "gloo-on-cuda": "not_applicable",
                        "checkpoint-zero3": "pass", "checkpoint-fsdp": "pass"}, report["sections"]
    assert report["passed"] is True and report["failed_sections"] == []
    assert "gpu-smoke: passed: 10 sections passed, 1 not applicable here" in proc.stdout
    na = runs.pop("gloo-on-cuda")
    assert na["reason"].startswith("covered by the other runs") and na["exit_code"] is None
    # NCCL's twin: 2 gloo ranks, each rank's peak measured
    two = runs["zero2-2-ranks"]
    assert two["world_size"] == 2 and len(two["peak_memory_bytes_per_rank"]) == 2
    # host RAM, measured per rank on every run (on CPU the host is the device: the same prediction)
    for name, run in runs.items():
        assert run["peak_host_memory_bytes"] > 0 and run["predicted_host_memory_bytes"] > 0, name
        assert run["predicted_host_memory_bytes"] == run["predicted_memory_bytes"], name
    # save → resume → export: the resumed run retraces the uninterrupted one bit for bit on CPU, and the export
    # loaded with transformers gives the trained model's logits and the engine's held-out loss
    for section in report["checkpoint"]:
        assert section["steps"] == 2 and section["resumed_at"] == 1, section["name"]
        assert section["losses_resumed"] == section["losses_uninterrupted"], section["name"]
        assert section["loss_max_abs_difference"] == 0.0, section["name"]
        assert section["logits_max_abs_difference"] <= section["logits_tolerance"], section["name"]
        assert abs(section["heldout_loss_engine"] - section["heldout_loss_export"]) <= section["heldout_tolerance"]
        assert [run["role"] for run in section["runs"]] == ["uninterrupted", "first-half", "resumed"]
        assert section["runs"][2]["resumed_from_step"] == 1 and "config.json" in section["export"]["files"]
    layouts = {name: (run["engine"], run["zero_stage"], run["offload_optimizer"], run["activation_checkpointing"])
               for name, run in runs.items()}
    # default-setup: config.yaml's pre-flight choice for the source articles' box (ZeRO-2 + CPU optimizer offload
    # + activation checkpointing), as the JSON records it
    assert report["default_setup"]["layout"]["zero_stage"] == 2 and "ran ZeRO-2 + CPU optimizer offload + " \
        "activation checkpointing" in report["default_setup"]["pre_flight"]
    assert layouts == {"default-setup": ("deepspeed", 2, "cpu", True), "zero3-offload": ("deepspeed", 3, "cpu", False),
                       "zero2-large": ("deepspeed", 2, "none", False),
                       "zero2-loss-scaling": ("deepspeed", 2, "none", False), "ddp": ("ddp", 0, "none", False),
                       "fsdp": ("fsdp", 3, "none", False), "zero2-large-compile": ("deepspeed", 2, "none", False),
                       "zero2-2-ranks": ("deepspeed", 2, "none", False)}
    # tokens/s with train.compile off and on, the same run otherwise; the compile time apart
    assert [run["compile"] for run in runs.values()] == [False] * 6 + [True, False]
    assert runs["zero2-large-compile"]["compile_time_s"] > 0 and runs["zero2-large"]["compile_time_s"] is None
    compiled = report["compile"]
    assert compiled["runs"] == ["zero2-large", "zero2-large-compile"]
    assert compiled["tokens_per_s_on"] == runs["zero2-large-compile"]["tokens_per_s"]
    assert compiled["speedup"] == compiled["tokens_per_s_on"] / compiled["tokens_per_s_off"]
    assert "gpu-smoke compile: " in proc.stdout
    # the smoke's own time, written with every run
    assert 0 < sum(run["wall_s"] for run in runs.values()) < report["wall_s"]
    assert f"gpu-smoke: {report['wall_s']:.0f} s in all" in proc.stdout
    for name, run in runs.items():
        # fp16 is CUDA's: on CPU every run is bf16 over gloo at world size 1, fp32 where this CPU emulates bf16
        assert (run["device"], run["precision"], run["comm_backend"]) == ("cpu", "fp32" if emulated else "bf16",
                                                                           "gloo"), name
        assert run["tokens_per_s"] > 0, name
        assert 0 < run["mfu"] < 1, name
        # CPU ranks share the machine's one peak
        assert run["peak_flops_per_rank"] == pytest.approx(report["peak"]["peak_flops"] / run["world_size"]), name
        assert run["peak_memory_kind"] == "peak RSS of the rank process (getrusage)", name
        # the memory model's prediction of the rank's RSS (offloaded states included) against the measured peak
        assert 0.5 < run["peak_memory_bytes"] / run["predicted_memory_bytes"] < 1.5, (name, run["memory_terms"])
    for name in ("default-setup", "zero3-offload"):
        assert runs[name]["memory_terms"]["host_states"] > 0, (name, "the optimizer states were offloaded")
    # bf16 on a CPU without bf16 matmuls would be emulated: the twin runs fp32 there, so no run carries the note
    assert all(run["precision_note"] is None for run in runs.values())
    assert "gpu-smoke note: train.precision bf16 on a CPU without native bf16" not in proc.stdout
    printed = [line for line in proc.stdout.splitlines() if line.startswith(tuple(runs))]
    assert len(printed) == len(runs) and all("tokens/s, MFU " in line for line in printed), proc.stdout
