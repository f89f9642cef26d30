"""`make gpu-smoke` on a machine without CUDA (a clear skip, exit 0, the reason in its JSON; exit 1 where nvidia-smi
lists GPUs torch cannot use), its result lines, its CPU twin's settings, and the GPU peak table its MFU divides by."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_smoke_skips_with_the_reason_without_cuda(tmp_path):
    out = tmp_path / "gpu-smoke.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_smoke.py"), str(out), "--work",
                           str(tmp_path / "work")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "gpu-smoke: skipped: no CUDA device visible" in proc.stdout
    assert "torch.cuda.is_available() is False" in json.loads(out.read_text())["skipped"]
    assert not (tmp_path / "work").exists(), "nothing is built when there is no GPU"


FAKE_NVIDIA_SMI = """#!/bin/sh
# nvidia-smi on a box with two RTX 4090s: answers --query-gpu=<fields> --format=csv,noheader,nounits
fields=$(printf '%s\\n' "$@" | sed -n 's/^--query-gpu=//p')
for gpu in 0 1; do
  line=""
  for field in $(echo "$fields" | tr ',' ' '); do
    case $field in
      name) value="NVIDIA GeForce RTX 4090" ;;
      memory.total) value=24564 ;;
      memory.free) value=23012 ;;
      *) value="[N/A]" ;;
    esac
    line="${line:+$line, }$value"
  done
  echo "$line"
done
"""


def fake_nvidia_smi(folder: Path) -> Path:
    """A folder holding an executable `nvidia-smi` that lists two GPUs (FAKE_NVIDIA_SMI), for the front of PATH."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nvidia-smi"
    script.write_text(FAKE_NVIDIA_SMI)
    script.chmod(0o755)
    return folder


def test_gpu_smoke_fails_loudly_where_nvidia_smi_lists_gpus_that_torch_cannot_use(tmp_path):
    out = tmp_path / "gpu-smoke.json"
    env = {**os.environ, "PATH": f"{fake_nvidia_smi(tmp_path / 'bin')}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_smoke.py"), str(out), "--work",
                           str(tmp_path / "work")], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "skipped" not in proc.stdout
    assert ("gpu-smoke: FAILED: nvidia-smi lists 2 GPU(s) (NVIDIA GeForce RTX 4090) but torch" in proc.stderr
            and "torch.cuda.is_available() is False" in proc.stderr and "install torch's CUDA build" in proc.stderr)
    assert "cannot use them" in json.loads(out.read_text())["failed"]


def _smoke_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_smoke_script", ROOT / "bench" / "gpu_smoke.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def _finished_run(**figures):
    return {"name": "zero2-large", "precision": "bf16", "zero_stage": 2, "engine": "deepspeed", "comm_backend": "nccl",
            "exit_code": 0, "tokens_per_s": 12345.6, "mfu": 0.421, "mfu_note": None,
            "peak_memory_bytes": 3 * 2**30, "predicted_memory_bytes": 4 * 2**30, "measured_over_predicted": 0.75,
            **figures}


def test_result_line_prints_a_run_without_mfu_with_the_reason():
    smoke = _smoke_module()
    line = smoke.result_line(_finished_run(mfu=None, mfu_note="no throughput or no peak to divide by"))
    assert "MFU n/a (no throughput or no peak to divide by)" in line
    assert "12,346 tokens/s" in line and "peak 3.00 GiB vs predicted 4.00 GiB (×0.75)" in line
    assert "MFU 42.1%" in smoke.result_line(_finished_run())
    failed = smoke.result_line({**_finished_run(), "exit_code": 1})
    assert failed.endswith("exit 1, see zero2-large/train.log")


def test_cpu_twin_runs_fp16_sections_in_bf16_over_gloo_and_cuda_keeps_them():
    smoke = _smoke_module()
    fp16 = {"engine": "ddp", "zero_stage": 0, "precision": "fp16"}
    assert smoke.device_settings(fp16, "cpu", native_bf16=True) == {**fp16, "precision": "bf16",
                                                                    "comm_backend": "gloo"}
    assert smoke.device_settings(fp16, "cuda") == {**fp16, "comm_backend": "nccl"}
    fp32 = {**fp16, "precision": "fp32"}
    assert smoke.device_settings(fp32, "cpu")["precision"] == "fp32"


def test_cpu_twin_runs_fp32_where_the_cpu_only_emulates_bf16():
    smoke = _smoke_module()
    for precision in ("fp16", "bf16"):
        train = {"engine": "fsdp", "zero_stage": 3, "precision": precision}
        assert smoke.device_settings(train, "cpu", native_bf16=False)["precision"] == "fp32"
        assert smoke.device_settings(train, "cuda", native_bf16=False)["precision"] == precision
    import torch

    emulated = not torch.ops.mkldnn._is_mkldnn_bf16_supported()  # this machine's CPU, as oneDNN reports it
    bf16 = {"engine": "ddp", "zero_stage": 0, "precision": "bf16"}
    assert smoke.device_settings(bf16, "cpu")["precision"] == ("fp32" if emulated else "bf16")


def test_cpu_twin_predicts_rss_with_offloaded_states_and_cuda_the_allocator_peak():
    smoke = _smoke_module()
    estimate = {"per_rank": 10, "runtime": 3, "host_states": 5}
    assert smoke.predicted_memory_bytes(estimate, "cpu") == 15
    assert smoke.predicted_memory_bytes(estimate, "cuda") == 7


# torch.cuda.get_device_name() as real cards report it, and the table's figure for each (None: not tabulated, so the
# peak is measured, never guessed from a look-alike: the RTX A1000 is no A100, the L4 no L40, the GH200 no H200)
DEVICE_NAMES = [
    ("NVIDIA H200", 989.5), ("NVIDIA H200 NVL", 835.5), ("NVIDIA H100 80GB HBM3", 989.5), ("NVIDIA H100 PCIe", 756.5),
    ("NVIDIA H100 NVL", 835.5), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0),
    ("NVIDIA A100-PCIE-40GB", 312.0), ("NVIDIA L40S", 362.05), ("NVIDIA L40", 181.05), ("NVIDIA L4", 121.0),
    ("NVIDIA GeForce RTX 4090", 165.2), ("NVIDIA GeForce RTX 4090 D", 147.0), ("NVIDIA GeForce RTX 3090", 71.0),
    ("NVIDIA GeForce RTX 3090 Ti", 80.0),
    ("NVIDIA RTX A1000", None), ("Tesla T4", None), ("NVIDIA A10G", None), ("NVIDIA RTX 6000 Ada Generation", None),
    ("Tesla V100-SXM2-16GB", None), ("NVIDIA A40", None), ("NVIDIA GH200 480GB", None),
]


@pytest.mark.parametrize("name, tflops", DEVICE_NAMES)
def test_gpu_peak_table_names_the_datasheet_figure_of_each_gpu_torch_reports(name, tflops):
    from pretrain_bench.train.models.flops import gpu_table_peak

    for precision in ("fp16", "bf16"):
        found = gpu_table_peak(name, precision)
        if tflops is None:
            assert found is None, (name, found)
            continue
        peak, source = found
        assert peak == tflops * 1e12 and source.startswith("datasheet table: ") and f"{tflops} TFLOP/s" in source
    assert gpu_table_peak(name, "fp32") is None


def test_a_failed_peak_measurement_stops_the_smoke_with_the_childs_error(tmp_path):
    smoke = _smoke_module()
    with pytest.raises(SystemExit, match=r"(?s)measuring the cuda's peak failed:.*no CUDA device is visible"):
        smoke.machine_facts("cuda", tmp_path)
    # where the measurement succeeds (on CPU): tests/integration/test_gpu_smoke_cpu.py, whose smoke measures it


def test_a_run_that_cannot_be_planned_is_recorded_and_the_smoke_goes_on(monkeypatch, tmp_path):
    from pretrain_bench.train.settings import ConfigError

    smoke = _smoke_module()

    def refused(name, *args):
        raise ConfigError("train.zero_stage 2 means nothing under train.engine ddp")

    monkeypatch.setattr(smoke, "run_one", refused)
    train = {"engine": "ddp", "zero_stage": 2, "precision": "fp16", "comm_backend": "nccl"}
    run = smoke.run_or_record("ddp", "llama-125m", train, smoke.SIZES["tiny"], "cuda", {}, tmp_path, tmp_path,
                              tmp_path)
    assert run["exit_code"] is None
    assert run["error"] == "ConfigError: train.zero_stage 2 means nothing under train.engine ddp"
    assert smoke.result_line(run) == ("ddp (fp16, ZeRO-2, ddp, nccl): not run: ConfigError: train.zero_stage 2 means "
                                      "nothing under train.engine ddp")


def test_default_setup_is_what_the_default_config_chooses_for_the_articles_box(monkeypatch):
    from pretrain_bench.core import devices

    smoke = _smoke_module()
    layout, why = smoke.default_setup(smoke.default_config())
    # config.yaml on 3 × 24 GiB with 128 GiB of host RAM: ZeRO-2 alone needs 55.2 GiB per GPU, ZeRO-3's offloads
    # more than 128 GiB of host RAM in fp16
    assert layout == {"engine": "deepspeed", "zero_stage": 2, "offload_optimizer": "cpu", "offload_param": "none",
                      "activation_checkpointing": True, "precision": "fp16"}
    assert why.startswith("asked ZeRO-2, micro-batch 8 × 1 accumulation; ran ZeRO-2 + CPU optimizer offload + "
                          "activation checkpointing")
    # derived from the config: cards that hold ZeRO-2 run it as asked
    roomy = smoke.default_config()
    roomy["benchmark"]["device_memory_gib"] = 80
    assert smoke.default_setup(roomy)[0] == {**layout, "offload_optimizer": "none", "activation_checkpointing": False}
    # a GPU machine's smoke runs the articles' box's choice, not its own (an H200 would hold plain ZeRO-2)
    monkeypatch.setattr(devices, "nvidia_smi_memory", lambda: [141 * 2**30])
    assert smoke.default_setup(smoke.default_config())[0] == layout


def test_zero3_offload_in_fp16_stays_in_the_smoke_beside_the_default_setup():
    smoke = _smoke_module()
    runs = {name: (model, train) for name, model, train in smoke.RUNS}
    assert "default-setup" not in runs, "derived when the smoke runs, never written down"
    assert runs["zero3-offload"] == ("large", {"engine": "deepspeed", "zero_stage": 3, "offload_optimizer": "cpu",
                                               "precision": "fp16"})


def test_a_default_setup_the_pre_flight_refuses_is_reported_and_the_other_runs_go_on(monkeypatch, tmp_path):
    from pretrain_bench.train.settings import ConfigError

    smoke = _smoke_module()

    def refused(config):
        raise ConfigError("pre-flight: the default config's main run is predicted not to fit")

    ran = []
    monkeypatch.setattr(smoke, "default_setup", refused)
    monkeypatch.setattr(smoke, "build_data", lambda work, size: (tmp_path / "index.json", tmp_path))
    monkeypatch.setattr(smoke, "machine_facts", lambda device, work: {
        "peak": {"peak_flops": 1e12, "peak_source": "test"}, "hardware": {"device": device}})
    monkeypatch.setattr(smoke, "run_or_record", lambda name, preset, train, *args: ran.append(name) or {
        "name": name, "precision": train["precision"], "zero_stage": train["zero_stage"], "engine": train["engine"],
        "comm_backend": train["comm_backend"], "exit_code": 0, "error": "not launched in this test"})
    out = tmp_path / "smoke.json"
    assert smoke.smoke(out, "cpu", smoke.SIZES["tiny"], tmp_path / "work") == 1, "the default's setup did not run"
    assert ran == [name for name, _, _ in smoke.RUNS]
    report = json.loads(out.read_text())
    assert report["default_setup"] == {"layout": None, "pre_flight": "pre-flight: the default config's main run is "
                                                                     "predicted not to fit"}
