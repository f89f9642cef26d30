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
    assert (run["status"], run["reason"]) == ("fail", "not run: ConfigError: train.zero_stage 2 means nothing under "
                                                      "train.engine ddp")
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
    monkeypatch.setattr(smoke, "run_or_record", lambda name, preset, train, *args, **kwargs: ran.append(name) or {
        "name": name, "precision": train["precision"], "zero_stage": train["zero_stage"], "engine": train["engine"],
        "comm_backend": train["comm_backend"], "exit_code": 0, "error": "not launched in this test", "status": "pass"})
    monkeypatch.setattr(smoke, "checkpoint_or_record", lambda name, train, *args: ran.append(name) or {
        "name": name, "kind": "checkpoint", **train, "steps": 2, "resumed_at": 1, "status": "pass"})
    out = tmp_path / "smoke.json"
    assert smoke.smoke(out, "cpu", smoke.SIZES["tiny"], tmp_path / "work") == 1, "the default's setup did not run"
    assert ran == [name for name, _, _ in smoke.RUNS] + ["zero2-2-ranks", "checkpoint-zero3", "checkpoint-fsdp"]
    report = json.loads(out.read_text())
    assert report["default_setup"] == {"layout": None, "pre_flight": "pre-flight: the default config's main run is "
                                                                     "predicted not to fit"}
    assert report["passed"] is False and report["failed_sections"] == ["default-setup"]
    assert report["sections"][0]["reason"] == ("config.yaml's pre-flight refused it: pre-flight: the default config's "
                                               "main run is predicted not to fit")


# --- item 9: host memory, the status of each section, save → resume → export, 2 ranks, gloo on CUDA -------------------
def _figures(name, **changes):
    """What run_one returns for a run that finished (its figures), with `changes`."""
    return {"name": name, "preset": "tiny", "engine": "deepspeed", "zero_stage": 2, "precision": "bf16",
            "comm_backend": "nccl", "device": "cuda", "world_size": 1, "offload_optimizer": "none", "exit_code": 0,
            "tokens_per_s": 1000.0, "mfu": 0.3, "mfu_note": None, "peak_memory_bytes": 3 * 2**30,
            "predicted_memory_bytes": 4 * 2**30, "measured_over_predicted": 0.75, "peak_host_memory_bytes": 5 * 2**30,
            "predicted_host_memory_bytes": 4 * 2**30, "host_measured_over_predicted": 1.25, "resumed_from_step": None,
            "step_time_s": {"median": 0.5}, "compile_time_s": 1.0, **changes}


def test_a_run_passes_only_when_it_ran_and_reported_its_throughput_and_host_memory():
    smoke = _smoke_module()
    assert smoke.run_status(_figures("ddp")) == {"status": "pass", "reason": None}
    assert smoke.run_status(_figures("ddp", exit_code=1, log="work/ddp/train.log")) == {
        "status": "fail", "reason": "exit 1, see work/ddp/train.log"}
    assert smoke.run_status(_figures("ddp", exit_code=None, error="ConfigError: no")) == {
        "status": "fail", "reason": "not run: ConfigError: no"}
    assert smoke.run_status(_figures("ddp", tokens_per_s=None))["status"] == "fail"
    assert smoke.run_status(_figures("ddp", peak_host_memory_bytes=None)) == {
        "status": "fail", "reason": "no peak host memory (peak_host_bytes) in its metrics.jsonl"}


def test_cuda_predicts_host_rss_from_the_offloaded_states_and_a_ranks_host_baseline():
    from pretrain_bench.train.memory.model import CUDA_RANK_HOST_BYTES

    smoke = _smoke_module()
    estimate = {"per_rank": 10, "runtime": 3, "host_states": 5}
    assert smoke.predicted_host_bytes(estimate, "cuda") == 5 + CUDA_RANK_HOST_BYTES
    assert smoke.predicted_host_bytes(estimate, "cpu") == 15 == smoke.predicted_memory_bytes(estimate, "cpu")
    assert "CUDA_RANK_HOST_BYTES" in smoke.HOST_PREDICTION["cuda"]


def test_the_multi_rank_section_does_not_apply_on_one_gpu_and_gloo_on_cuda_not_on_cpu():
    smoke = _smoke_module()
    assert smoke.multi_rank_reason("cuda", 1, 2) == "1 GPU (a 2-rank nccl run needs 2)"
    assert smoke.multi_rank_reason("cuda", 0, 2).startswith("0 GPUs")
    assert smoke.multi_rank_reason("cuda", 2, 2) is None and smoke.multi_rank_reason("cpu", 0, 2) is None
    assert smoke.gloo_on_cuda_reason("cuda") is None
    assert smoke.gloo_on_cuda_reason("cpu").startswith("covered by the other runs")


def _fake_sections(monkeypatch, tmp_path, smoke, *, failing=(), gpus=1):
    """smoke.smoke without launching: every run and checkpoint section passes but those named in `failing`; the
    machine has `gpus` GPUs. Returns the names run_one was called with (and their ranks)."""
    launched = []

    def run_one(name, preset, train, size, device, *args, ranks=1, **kwargs):
        launched.append((name, ranks, train["comm_backend"]))
        return _figures(name, **train, world_size=ranks, exit_code=1 if name in failing else 0)

    monkeypatch.setattr(smoke, "default_setup", lambda config: ({"engine": "deepspeed", "zero_stage": 2,
                                                                 "offload_optimizer": "cpu", "offload_param": "none",
                                                                 "activation_checkpointing": True,
                                                                 "precision": "fp16"}, "test"))
    monkeypatch.setattr(smoke, "build_data", lambda work, size: (tmp_path / "index.json", tmp_path))
    monkeypatch.setattr(smoke, "machine_facts", lambda device, work: {
        "peak": {"peak_flops": 1e15, "peak_source": "test"}, "hardware": {"device": device}, "gpu_count": gpus})
    monkeypatch.setattr(smoke, "run_one", run_one)
    monkeypatch.setattr(smoke, "checkpoint_section", lambda name, train, *args: {
        "name": name, "kind": "checkpoint", **train, "steps": 8, "resumed_at": 4,
        **({"status": "fail", "reason": "resumed losses differ"} if name in failing else
           {"status": "pass", "reason": None})})
    return launched


def test_a_failed_section_fails_the_smoke_and_is_listed(monkeypatch, tmp_path, capsys):
    smoke = _smoke_module()
    _fake_sections(monkeypatch, tmp_path, smoke, failing=("ddp", "checkpoint-fsdp"))
    out = tmp_path / "smoke.json"
    assert smoke.smoke(out, "cuda", smoke.SIZES["tiny"], tmp_path / "work") == 1
    report = json.loads(out.read_text())
    assert report["passed"] is False and report["failed_sections"] == ["ddp", "checkpoint-fsdp"]
    sections = {section["name"]: section for section in report["sections"]}
    assert sections["ddp"]["reason"].startswith("exit 1, see ") and sections["checkpoint-fsdp"]["reason"] == \
        "resumed losses differ"
    assert "gpu-smoke: FAILED: ddp, checkpoint-fsdp" in capsys.readouterr().out


def test_a_section_that_does_not_apply_neither_passes_nor_fails_the_smoke(monkeypatch, tmp_path, capsys):
    smoke = _smoke_module()
    launched = _fake_sections(monkeypatch, tmp_path, smoke, gpus=1)
    out = tmp_path / "smoke.json"
    assert smoke.smoke(out, "cuda", smoke.SIZES["tiny"], tmp_path / "work") == 0
    report = json.loads(out.read_text())
    assert report["passed"] is True and report["failed_sections"] == []
    sections = {section["name"]: section for section in report["sections"]}
    assert list(sections) == ["default-setup", *(name for name, _, _ in smoke.RUNS), "zero2-2-ranks", "gloo-on-cuda",
                              "checkpoint-zero3", "checkpoint-fsdp"]
    assert sections["zero2-2-ranks"] == {**dict.fromkeys(smoke.SECTION_FIGURES), "name": "zero2-2-ranks",
                                         "kind": "run", "status": "not_applicable", "world_size": 2,
                                         "reason": "1 GPU (a 2-rank nccl run needs 2)"}
    assert [status for status in (s["status"] for s in report["sections"]) if status != "pass"] == ["not_applicable"]
    # every section's figures: tokens/s, MFU, device and host memory against the prediction
    assert sections["ddp"]["peak_host_memory_bytes"] == 5 * 2**30 and sections["ddp"]["mfu"] == 0.3
    # gloo on CUDA tensors runs on a GPU machine; the 2-rank section was not launched on its one GPU
    assert ("gloo-on-cuda", 1, "gloo") in launched and "zero2-2-ranks" not in [name for name, _, _ in launched]
    printed = capsys.readouterr().out
    assert "zero2-2-ranks (bf16, ZeRO-2, deepspeed, nccl, 2 ranks): not applicable: 1 GPU" in printed
    assert "gpu-smoke: passed: 10 sections passed, 1 not applicable here" in printed
    # with two GPUs it runs, 2 ranks over nccl
    launched = _fake_sections(monkeypatch, tmp_path, smoke, gpus=2)
    assert smoke.smoke(out, "cuda", smoke.SIZES["tiny"], tmp_path / "work") == 0
    assert ("zero2-2-ranks", 2, "nccl") in launched
    assert json.loads(out.read_text())["sections"][8]["status"] == "pass"


def _fake_checkpoint_runs(monkeypatch, smoke, losses, *, export=None):
    """run_one for a checkpoint section: writes each run's metrics.jsonl (its losses from `losses`, by role, the
    resumed run's val_loss 5.0 at its last step) and returns its figures; check_export returns `export`."""
    def run_one(name, preset, train, size, device, *args, run_dir, extra, resume=False, **kwargs):
        role = name.rsplit("-", 1)[-1] if not name.endswith("first-half") else "first-half"
        steps = list(range(1, extra["max_steps"] + 1))
        records = [{"step": step, "loss": losses[role][step - 1]} for step in steps]
        if role == "resumed":
            records[-1]["val_loss"] = 5.0
        (run_dir / "out").mkdir(parents=True)
        (run_dir / "out" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return _figures(name, device=device, resumed_from_step=extra["max_steps"] // 2 if resume else None)

    monkeypatch.setattr(smoke, "run_one", run_one)
    monkeypatch.setattr(smoke, "check_export", lambda plan, step, target: export or {
        "logits_max_abs_difference": 0.0, "logits_abs_max": 3.0, "heldout_loss": 5.0})


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_checkpoint_section_passes_when_the_resumed_losses_retrace_the_uninterrupted_run(monkeypatch, tmp_path,
                                                                                          device):
    smoke = _smoke_module()
    size = smoke.Size(**{**vars(smoke.SIZES["tiny"]), "steps": 4})
    curve = [7.0, 6.9, 6.8, 6.7]
    _fake_checkpoint_runs(monkeypatch, smoke, {"uninterrupted": curve, "first-half": curve, "resumed": curve})
    train = {"engine": "deepspeed", "zero_stage": 3, "precision": "bf16", "comm_backend": "gloo"}
    section = smoke.checkpoint_section("checkpoint-zero3", train, size, device, {}, tmp_path, tmp_path, tmp_path)
    assert (section["status"], section["reason"]) == ("pass", None)
    assert section["steps"] == 4 and section["resumed_at"] == 2
    assert [run["role"] for run in section["runs"]] == ["uninterrupted", "first-half", "resumed"]
    assert section["losses_resumed"] == section["losses_uninterrupted"] == curve
    assert section["loss_max_abs_difference"] == 0.0 and section["loss_tolerance"] == smoke.LOSS_TOLERANCE[device]
    assert section["heldout_loss_engine"] == section["heldout_loss_export"] == 5.0
    assert section["peak_host_memory_bytes"] == 5 * 2**30, "the figures of the uninterrupted run"


def test_a_checkpoint_section_fails_on_a_resume_that_does_not_retrace_or_an_export_that_differs(monkeypatch,
                                                                                                tmp_path):
    smoke = _smoke_module()
    size = smoke.Size(**{**vars(smoke.SIZES["tiny"]), "steps": 4})
    train = {"engine": "fsdp", "zero_stage": 3, "precision": "fp32", "comm_backend": "gloo"}
    curve = [7.0, 6.9, 6.8, 6.7]
    # on CPU one ulp is a failure: the resume is bit for bit there
    _fake_checkpoint_runs(monkeypatch, smoke, {"uninterrupted": curve, "first-half": curve,
                                               "resumed": [7.0, 6.9, 6.8, 6.700001]})
    section = smoke.checkpoint_section("checkpoint-fsdp", train, size, "cpu", {}, tmp_path, tmp_path, tmp_path / "a")
    assert section["status"] == "fail" and section["reason"].startswith(
        "resumed losses differ from the uninterrupted run's by up to 1e-06 (tolerance 0.0)")
    # on CUDA that is within the tolerance; export logits that differ, or a held-out loss off, fail it
    _fake_checkpoint_runs(monkeypatch, smoke, {"uninterrupted": curve, "first-half": curve,
                                               "resumed": [7.0, 6.9, 6.8, 6.700001]},
                          export={"logits_max_abs_difference": 0.5, "logits_abs_max": 3.0, "heldout_loss": 5.01})
    section = smoke.checkpoint_section("checkpoint-fsdp", train, size, "cuda", {}, tmp_path, tmp_path, tmp_path / "b")
    assert section["status"] == "fail"
    assert section["reason"] == ("export logits differ from the trained model's by up to 0.5 (tolerance 0.0001); "
                                 "held-out loss of the export 5.01000 vs the engine's 5.00000 (tolerance 0.001)")


def test_checkpoint_sections_run_n_steps_halved_under_a_constant_learning_rate():
    smoke = _smoke_module()
    assert [smoke.checkpoint_steps(smoke.Size(**{**vars(smoke.SIZES["tiny"]), "steps": steps}))
            for steps in (1, 2, 3, 5, 30)] == [2, 2, 2, 4, 8]
    extra = smoke.checkpoint_extra(8, 64)
    assert extra == {"lr_schedule": "constant", "warmup_steps": 0, "checkpoint_every": 4, "keep_checkpoints": None,
                     "eval_every": 8, "eval_tokens": 4 * 64}
    from pretrain_bench.train.settings import TrainSettings, learning_rate

    half, whole = (TrainSettings.from_config({"max_steps": n, **extra}) for n in (4, 8))
    assert [learning_rate(step, half, 4) for step in range(4)] == [learning_rate(step, whole, 8) for step in range(4)]


def test_the_cuda_forms_of_the_new_sections_plan_as_the_gpu_runs_them(tmp_path):
    """Planned here, without a GPU: 2 ranks over nccl, gloo on CUDA, and each checkpoint section's three plans."""
    from pretrain_bench.train.plan import make_plan
    from pretrain_bench.workflow.experiment import plan_config

    smoke = _smoke_module()
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"vocab_size": 32000, "splits": {"val": {"shards": [{"tokens": 1_000_000}]}}}))
    size = smoke.SIZES["gpu"]

    def plan(name, train, ranks=1, **extra):
        config = smoke.smoke_config(name, size.small, train, size, "cuda", ranks)
        config["train"].update(extra)
        return make_plan(plan_config(config), index=index, tokenizer=tmp_path, out_dir=tmp_path / name / "out",
                         state_dir=tmp_path / name / "state", resume=True, save_checkpoints=True, peak=None).train

    name, _, train, ranks = smoke.MULTI_RANK
    two = plan(name, smoke.device_settings(train, "cuda"), ranks)
    assert (two.world_size, two.comm_backend, two.device, two.zero_stage) == (2, "nccl", "cuda", 2)
    name, _, train = smoke.GLOO_ON_CUDA
    gloo = plan(name, {**smoke.device_settings(train, "cuda"), "comm_backend": train["comm_backend"]})
    assert (gloo.world_size, gloo.comm_backend, gloo.device) == (1, "gloo", "cuda")
    for name, train in smoke.CHECKPOINT_SECTIONS:
        for steps in (4, 8):
            settings = plan(name, smoke.device_settings(train, "cuda"), **smoke.checkpoint_extra(8, size.seq_len),
                            max_steps=steps)
            assert settings.checkpoint_steps(size.seq_len) == [4, 8][:steps // 4] and settings.eval_every == 8


def test_the_trainer_records_each_ranks_peak_host_rss_on_cuda_beside_the_device_peak(monkeypatch, tmp_path):
    """Trainer.gather_step and record as on a GPU (torch.cuda's peaks monkeypatched, gathered over gloo): the step's
    record holds the rank's peak RSS (peak_host_bytes), the offloads' host RAM, apart from the device's figures."""
    import resource

    import torch
    import torch.distributed as dist

    from pretrain_bench.train.metrics import peak_memory_per_rank
    from support import bare_cuda_trainer

    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 7 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 6 * 2**30)
    trainer = bare_cuda_trainer(tmp_path, 1.5)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        gathered = trainer.gather_step(1, torch.tensor([2.5]))
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    finally:
        dist.destroy_process_group()
    record = trainer.record(1, gathered, 1.0, dict.fromkeys(("forward", "backward", "optimizer")), None, 0)
    assert record["peak_mem_bytes"] == [7 * 2**30] and record["grad_norm"] == 1.5
    assert 0 < record["peak_host_bytes"][0] <= rss and record["peak_host_bytes"][0] > 50 * 2**20
    assert peak_memory_per_rank([record], 1, "peak_host_bytes") == record["peak_host_bytes"]
