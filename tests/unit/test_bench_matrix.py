"""The benchmark matrix: cells, device filtering with reasons, predicted OOM, and plans for cells."""
import json
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

from pretrain_bench import devices  # noqa: E402
from pretrain_bench.bench_matrix import BenchSettings, Cell, cells, plan_matrix, runnable, time_estimate  # noqa: E402
from pretrain_bench.memory_model import GIB, Budget  # noqa: E402
from pretrain_bench.plan import cell_train, make_plan, plan_config  # noqa: E402
from pretrain_bench.settings import ConfigError, TrainSettings  # noqa: E402


def merged(*overlays):
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    for overlay in overlays:
        _merge(config, overlay)
    return config


def _merge(base, overlay):
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def tiny(**bench):
    """The tiny config with ZeRO 1 and 2 in its matrix (the demo keeps to ZeRO-2; these tests need both axes)."""
    overlay = yaml.safe_load((ROOT / "config" / "tiny-cpu.yaml").read_text())
    bench = {**bench, "matrix": {"zero_stage": [1, 2], **bench.get("matrix", {})}}
    return merged(overlay, {"benchmark": bench})


CPU_BUDGET = Budget("cpu", 16 * GIB, "test", 16 * GIB, "test")


def test_cells_are_the_product_of_the_axes_and_named_readably():
    config = tiny()
    bench = BenchSettings.from_config(config)
    names = [c.name(config["train"]) for c in cells(bench)]
    assert len(names) == 3 * 2 * 1 * 2 and len(set(names)) == len(names)
    assert "ranks3-zero2-fp32-gloo" in names
    assert Cell(1, 2, "fp32", "gloo", 64, "cpu").name(config["train"]) == "ranks1-zero2-fp32-gloo-mb64-offload"


def test_cpu_leaves_out_nccl_and_fp16_with_the_reason():
    config = tiny(matrix={"precision": ["fp32", "fp16"]})
    matrix = plan_matrix(config, budget=CPU_BUDGET)
    by_name = {e["cell"]: e for e in matrix["cells"]}
    assert matrix["device"] == "cpu"
    assert by_name["ranks2-zero1-fp32-nccl"]["status"] == "unsupported"
    assert "nccl needs CUDA" in by_name["ranks2-zero1-fp32-nccl"]["reason"]
    assert "fp16 is not supported on a CPU run" in by_name["ranks2-zero1-fp16-gloo"]["reason"]
    assert sorted(runnable(matrix)) == sorted(f"ranks{g}-zero{z}-fp32-gloo" for g in (1, 2, 3) for z in (1, 2))
    for entry in matrix["cells"]:
        assert (entry["estimate"] is not None) == (entry["status"] == "run")


def test_more_ranks_than_resources_or_gpus_are_left_out():
    matrix = plan_matrix(tiny(), available_ranks=2, budget=CPU_BUDGET)
    three = [e for e in matrix["cells"] if e["gpus"] == 3 and e["comm_backend"] == "gloo"]
    assert all(e["status"] == "unsupported" and "--resources gpu=2" in e["reason"] for e in three)
    config = tiny(matrix={"gpus": [1, 4], "precision": ["bf16"]})
    config["train"]["device"] = "cuda"
    gpus = Budget("cuda", 24 * GIB, "test", 128 * GIB, "test", gpu_count=3)
    by_name = {e["cell"]: e for e in plan_matrix(config, budget=gpus)["cells"]}
    assert by_name["ranks4-zero1-bf16-nccl"]["reason"] == "needs 4 GPUs, 3 detected"
    assert by_name["ranks1-zero1-bf16-nccl"]["status"] == "run"


def test_a_cell_predicted_not_to_fit_is_left_out_unless_forced():
    config = tiny(matrix={"micro_batch_size": [8, 100000]})
    matrix = plan_matrix(config, budget=CPU_BUDGET)
    oom = [e for e in matrix["cells"] if e["micro_batch_size"] == 100000 and e["comm_backend"] == "gloo"]
    assert len(oom) == 6
    for entry in oom:
        assert entry["status"] == "predicted_oom"
        assert entry["reason"].startswith("predicted OOM: needs ") and "has 16.0 GiB host RAM" in entry["reason"]
        assert entry["need_bytes"] > entry["have_bytes"]
    forced = plan_matrix(tiny(matrix={"micro_batch_size": [8, 100000]}, force=True), budget=CPU_BUDGET)
    assert all(e["status"] == "run" and e["forced"] for e in forced["cells"]
               if e["micro_batch_size"] == 100000 and e["comm_backend"] == "gloo")


def test_default_matrix_shows_every_7b_cell_as_predicted_oom_on_the_articles_box(monkeypatch):
    monkeypatch.setattr(devices, "nvidia_smi_memory", lambda: [])
    config = merged({"benchmark": {"host_memory_gib": 128}})
    matrix = plan_matrix(config, available_ranks=3)
    assert matrix["budget"]["device_bytes"] == 24 * GIB
    assert len(matrix["cells"]) == 16  # 1/3 GPUs × ZeRO-2/3 × nccl/gloo × offload or not
    for entry in matrix["cells"]:
        assert entry["status"] == "predicted_oom"
        if entry["offload_optimizer"] == "none" or entry["zero_stage"] == 2:
            # 7B without offload, and ZeRO-2 even with it (2Ψ + the LM head's norm copies on the GPU)
            assert "GiB per GPU, has 24.0 GiB" in entry["reason"]
        else:
            # ZeRO-3 + CPU offload fits the GPUs but its host states (18Ψ/N + fp16's overflow check, 3Ψ/N) do not
            # fit 128 GiB on 1 or 3 ranks
            host = {1: "host RAM 137.2 GiB for 1 rank", 3: "host RAM 141.2 GiB for 3 ranks"}[entry["gpus"]]
            assert "GiB per GPU, has 24.0 GiB; " + host + ", has 128.0 GiB" in entry["reason"]


def test_warmup_must_leave_timed_steps():
    with pytest.raises(ConfigError, match="benchmark.warmup_steps 8 leaves no timed step"):
        BenchSettings.from_config(tiny(steps=8, warmup_steps=8))


def test_forty_eight_cells_are_planned_in_milliseconds():
    config = tiny(matrix={"gpus": [1, 2, 3], "zero_stage": [0, 1, 2, 3], "precision": ["fp32", "bf16"],
                          "comm_backend": ["gloo", "nccl"]})
    started = time.perf_counter()
    matrix = plan_matrix(config, budget=CPU_BUDGET)
    assert len(matrix["cells"]) == 48 and time.perf_counter() - started < 0.5


def test_cell_plan_rederives_the_batch_and_keeps_no_state(tmp_path):
    config = tiny()
    bench = BenchSettings.from_config(config)
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"vocab_size": 4096}))
    cell = Cell(2, 1, "fp32", "gloo", 8, "none")
    cell_config = plan_config(config, train=cell_train(config, cell.train_overrides(bench)))
    plan = make_plan(cell_config, index=index, tokenizer=tmp_path, out_dir=tmp_path / "rep1",
                     state_dir=tmp_path / "s", role="bench", resume=False, save_checkpoints=False)
    assert plan.train["gpus"] == 2 and plan.train["zero_stage"] == 1
    # 8 per rank × 2 ranks, not the main run's 24
    assert TrainSettings.from_config(plan.train).derived_global_batch == 16
    assert plan.train["max_steps"] == bench.steps and plan.train["warmup_timing_steps"] == bench.warmup_steps
    assert plan.train["max_tokens"] is None
    assert plan.role == "bench" and not plan.resume and not plan.save_checkpoints
    # a cell measures its own settings: memory_fit never changes them, and checkpoint keys are not its business
    assert plan.train["memory_fit"] == "strict" and "checkpoint_every" not in cell_config["train"]
    assert set(plan.config) == {"name", "model", "train", "tokenizer", "benchmark", "report"}


def test_time_estimate_is_a_lower_bound_from_the_peak():
    config = tiny()
    entry = {"status": "run", "gpus": 2, "micro_batch_size": 8}
    model = config["model"]
    cpu = time_estimate(entry, model, 4096, 1, {"device": "cpu", "peak_flops": 1e11}, steps=8)
    gpu = time_estimate(entry, model, 4096, 1, {"device": "cuda", "peak_flops": 1e11}, steps=8)
    assert cpu["min_step_time_s"] == pytest.approx(2 * gpu["min_step_time_s"])  # CPU ranks share one peak
    assert cpu["min_cell_time_s"] == pytest.approx(8 * cpu["min_step_time_s"])
    assert time_estimate({"status": "predicted_oom"}, model, 4096, 1, {"peak_flops": 1e11}, 8) is None
