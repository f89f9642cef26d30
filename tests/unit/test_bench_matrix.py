"""The benchmark matrix: cells, device filtering with reasons, predicted OOM, and plans for cells."""
import json
import re
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from pretrain_bench.bench import matrix as bench_matrix
from pretrain_bench.bench.matrix import BenchSettings, Cell, cells, runnable, time_estimate
from pretrain_bench.config.schema import ModelSettings, ReportSettings
from pretrain_bench.core import devices
from pretrain_bench.train.memory.model import GIB, Budget
from pretrain_bench.train.plan import cell_settings, make_plan
from pretrain_bench.train.settings import ConfigError, TrainSettings
from pretrain_bench.workflow.experiment import load_config, plan_config

ROOT = Path(__file__).resolve().parents[2]


def plan_matrix(config: dict, **kwargs) -> dict:
    """bench.matrix.plan_matrix of a validated config, as the workflow calls it."""
    return bench_matrix.plan_matrix(plan_config(config), BenchSettings.from_config(config), **kwargs)


def main_train(config: dict) -> TrainSettings:
    return TrainSettings.from_config(config["train"])


def merged(*overlays):
    config = load_config(ROOT / "config.yaml")
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
    names = [c.name(main_train(config)) for c in cells(bench)]
    assert len(names) == 3 * 2 * 1 * 2 and len(set(names)) == len(names)
    assert "ranks3-zero2-fp32-gloo" in names
    assert Cell(1, 2, "fp32", "gloo", 64, "cpu").name(main_train(config)) == "ranks1-zero2-fp32-gloo-mb64-offload"


def test_cpu_leaves_out_nccl_and_fp16_with_the_reason():
    config = tiny(matrix={"precision": ["fp32", "fp16"]})
    matrix = plan_matrix(config, budget=CPU_BUDGET)
    by_name = {e["cell"]: e for e in matrix["cells"]}
    assert matrix["device"] == "cpu"
    assert by_name["ranks2-zero1-fp32-nccl"]["status"] == "unsupported"
    assert "nccl needs CUDA" in by_name["ranks2-zero1-fp32-nccl"]["reason"]
    assert "fp16 is not supported on a CPU run" in by_name["ranks2-zero1-fp16-gloo"]["reason"]
    # the plain single-device baseline of each precision, fp16's left out like the other fp16 cells
    assert "fp16 is not supported on a CPU run" in by_name["ddp-ranks1-fp16-gloo"]["reason"]
    assert sorted(runnable(matrix)) == sorted([f"ranks{g}-zero{z}-fp32-gloo" for g in (1, 2, 3) for z in (1, 2)]
                                              + ["ddp-ranks1-fp32-gloo"])
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


def articles_box_matrix(monkeypatch, **bench):
    """The default config's matrix planned on a machine without GPUs: for the source articles' box."""
    monkeypatch.setattr(devices, "nvidia_smi_memory", lambda: [])
    return plan_matrix(merged({"benchmark": bench}), available_ranks=3)


def test_default_matrix_runs_zero2_offload_with_checkpointing_on_the_articles_box(monkeypatch):
    matrix = articles_box_matrix(monkeypatch)
    assert matrix["budget"]["device_bytes"] == 24 * GIB and matrix["budget"]["host_bytes"] == 128 * GIB
    # 1/3 GPUs × ZeRO-2/3 × nccl/gloo × offload or not, all checkpointed, and the plain single-device baseline
    assert len(matrix["cells"]) == 16 + 1
    baseline = matrix["cells"][16]
    assert (baseline["cell"], baseline["origin"], baseline["status"]) == ("ddp-ranks1-fp16-nccl-ckpt", "baseline",
                                                                          "predicted_oom")
    # what the main run's memory_fit: auto chooses (ZeRO-2 + CPU optimizer offload + activation checkpointing),
    # compared on 1 vs 3 cards and over NCCL vs Gloo
    assert sorted(runnable(matrix)) == sorted(f"ranks{g}-zero2-fp16-{b}-offload-ckpt" for g in (1, 3)
                                              for b in ("nccl", "gloo"))
    for entry in matrix["cells"]:
        assert entry["activation_checkpointing"] is True
        if entry["status"] == "run":
            assert entry["need_bytes"] <= entry["have_bytes"] and entry["short_of"] == []
            continue
        assert entry["status"] == "predicted_oom"
        if entry["offload_optimizer"] == "none":  # 7B's states on the GPUs: 38.7 GiB and up per GPU
            assert entry["short_of"] == ["GPU memory"] and "GiB per GPU, has 24.0 GiB" in entry["reason"]
        else:
            # ZeRO-3 + CPU offload fits the GPUs but its host states (18Ψ/N + fp16's overflow check, 3Ψ/N) do not
            # fit 128 GiB on 1 or 3 ranks
            host = {1: "host RAM 137.2 GiB for 1 rank", 3: "host RAM 141.2 GiB for 3 ranks"}[entry["gpus"]]
            assert entry["zero_stage"] == 3 and entry["short_of"] == ["host RAM"]
            assert host + ", has 128.0 GiB" in entry["reason"]
    assert matrix["host_cores"] == 16 and matrix["host_cores_source"] == "benchmark.host_cores, no GPU detected here"


def test_without_checkpointing_no_7b_cell_fits_the_articles_box(monkeypatch):
    matrix = articles_box_matrix(monkeypatch, matrix={"activation_checkpointing": [False]})
    assert not runnable(matrix) and all(e["status"] == "predicted_oom" for e in matrix["cells"])
    # ZeRO-2 + offload keeps 16-bit parameters and gradients and the activations of micro-batch 8 on each GPU
    offload2 = [e for e in matrix["cells"] if e["zero_stage"] == 2 and e["offload_optimizer"] == "cpu"]
    assert offload2 and all(e["short_of"] == ["GPU memory"] for e in offload2)


def dry_run_matrix_line(matrix, config):
    from pretrain_bench.bench.matrix import cost_preview, preview_text

    main = TrainSettings.from_config(config["train"])
    text = preview_text(cost_preview(matrix, main, ModelSettings.from_config(config["model"]), 102_400, 165e12, "test"))
    return next(line for line in text.splitlines() if "benchmark matrix" in line)


def test_the_dry_run_says_how_many_cells_fit_and_why_the_others_do_not(monkeypatch):
    config = merged()
    line = dry_run_matrix_line(articles_box_matrix(monkeypatch), config)
    assert "benchmark matrix (12 launches): ~ " in line  # 4 cells × 3 repeats
    assert line.endswith("; 4 of 17 cells run, left out: 13 predicted not to fit 24.0 GiB per GPU (assumed) / 128.0 "
                         "GiB host RAM (assumed) (9 short of GPU memory, 4 short of host RAM) (each with its reason in "
                         "bench/matrix.json)")
    # nothing fits: never "off", but how many were declared, why none runs and how to launch them anyway
    nothing = articles_box_matrix(monkeypatch, matrix={"activation_checkpointing": [False]})
    line = dry_run_matrix_line(nothing, config)
    assert "off" not in line
    assert line.endswith("benchmark matrix (0 launches): 0 of 17 cells run: 17 predicted not to fit 24.0 GiB per "
                         "GPU (assumed) / 128.0 GiB host RAM (assumed) (13 short of GPU memory, 4 short of host "
                         "RAM), set benchmark.force: true to launch them anyway (each with its reason in "
                         "bench/matrix.json)")
    off = articles_box_matrix(monkeypatch, enabled=False)
    assert dry_run_matrix_line(off, config).endswith(
        "(0 launches): off (benchmark.enabled: false, or an empty benchmark.matrix axis)")


def test_a_cell_names_its_checkpointing_where_it_differs_from_the_main_run():
    train = TrainSettings(micro_batch_size=8, activation_checkpointing=False)
    assert Cell(3, 2, "fp16", "nccl", 8, "cpu", activation_checkpointing=True).name(train) == (
        "ranks3-zero2-fp16-nccl-offload-ckpt")
    assert Cell(3, 2, "fp16", "nccl", 8, "cpu").name(train) == "ranks3-zero2-fp16-nccl-offload"
    checkpointed = replace(train, activation_checkpointing=True)
    assert Cell(3, 2, "fp16", "nccl", 8, "none").name(checkpointed) == "ranks3-zero2-fp16-nccl-no-ckpt"
    # the cell's plan runs it as named: memory_fit never changes a cell's settings
    config = tiny()
    bench = BenchSettings.from_config(config)
    overrides = Cell(1, 2, "fp32", "gloo", 8, "none", activation_checkpointing=True).train_overrides(bench)
    assert cell_settings(main_train(config), overrides).activation_checkpointing is True


def test_a_gpu_machine_plans_with_its_own_cores(monkeypatch):
    from pretrain_bench.train.memory import offload as offload_time

    monkeypatch.setattr(devices, "nvidia_smi_memory", lambda: [24 * GIB] * 3)
    monkeypatch.setattr(offload_time, "usable_cores", lambda: 7)
    matrix = plan_matrix(merged(), available_ranks=3)
    assert (matrix["host_cores"], matrix["host_cores_source"]) == (7, "this machine's usable cores")


def test_warmup_must_leave_timed_steps():
    with pytest.raises(ConfigError, match="benchmark.warmup_steps 8 leaves no timed step"):
        BenchSettings.from_config(tiny(steps=8, warmup_steps=8))


def test_forty_eight_cells_are_planned_in_milliseconds():
    config = tiny(matrix={"gpus": [1, 2, 3], "zero_stage": [0, 1, 2, 3], "precision": ["fp32", "bf16"],
                          "comm_backend": ["gloo", "nccl"]})
    started = time.perf_counter()
    matrix = plan_matrix(config, budget=CPU_BUDGET)
    # 48 declared and a plain single-device baseline per precision
    assert len(matrix["cells"]) == 48 + 2 and time.perf_counter() - started < 0.5


def test_cell_plan_rederives_the_batch_and_keeps_no_state(tmp_path):
    config = tiny()
    bench = BenchSettings.from_config(config)
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"vocab_size": 4096}))
    cell = Cell(2, 1, "fp32", "gloo", 8, "none")
    cell_config = plan_config(config).for_cell(cell_settings(main_train(config), cell.train_overrides(bench)))
    plan = make_plan(cell_config, index=index, tokenizer=tmp_path, out_dir=tmp_path / "rep1",
                     state_dir=tmp_path / "s", role="bench", resume=False, save_checkpoints=False)
    assert plan.train.gpus == 2 and plan.train.zero_stage == 1
    # 8 per rank × 2 ranks, not the main run's 24
    assert plan.train.derived_global_batch == 16
    assert plan.train.max_steps == bench.steps and plan.train.warmup_timing_steps == bench.warmup_steps
    assert plan.train.max_tokens is None
    assert plan.role == "bench" and not plan.resume and not plan.save_checkpoints
    # a cell measures its own settings: memory_fit never changes them, and checkpoint keys are not its business
    assert plan.train.memory_fit == "strict" and "checkpoint_every" not in cell_config.as_dict()["train"]
    assert set(plan.config.as_dict()) == {"name", "model", "train", "tokenizer", "benchmark", "report"}


def test_time_estimate_is_a_lower_bound_from_the_peak():
    config = tiny()
    entry = {"status": "run", "gpus": 2, "micro_batch_size": 8}
    model = ModelSettings.from_config(config["model"])
    cpu = time_estimate(entry, model, 4096, 1, {"device": "cpu", "peak_flops": 1e11}, steps=8)
    gpu = time_estimate(entry, model, 4096, 1, {"device": "cuda", "peak_flops": 1e11}, steps=8)
    assert cpu["min_step_time_s"] == pytest.approx(2 * gpu["min_step_time_s"])  # CPU ranks share one peak
    assert cpu["min_cell_time_s"] == pytest.approx(8 * cpu["min_step_time_s"])
    assert time_estimate({"status": "predicted_oom"}, model, 4096, 1, {"peak_flops": 1e11}, 8) is None


def test_search_adds_the_setups_predicted_to_fit_up_to_the_micro_batch_limit():
    from pretrain_bench.bench.matrix import SEARCH_MICRO_BATCH_FACTOR, judge_cell

    config = tiny(search=True, matrix={"comm_backend": ["gloo"]})
    bench = BenchSettings.from_config(config)
    budget = Budget("cpu", int(1.9 * GIB), "test", int(1.9 * GIB), "test")
    matrix = plan_matrix(config, budget=budget)
    declared = [e for e in matrix["cells"] if e["origin"] == "declared"]
    found = [e for e in matrix["cells"] if e["origin"] == "search"]
    unsearched = plan_matrix(tiny(matrix={"comm_backend": ["gloo"]}), budget=budget)["cells"]
    assert len(declared) == len([e for e in unsearched if e["origin"] == "declared"])
    assert found and not {e["cell"] for e in found} & {e["cell"] for e in declared}
    assert {e["engine"] for e in found} == {"deepspeed", "ddp", "fsdp"}
    assert {e["zero_stage"] for e in found if e["engine"] == "deepspeed"} == {0, 1, 2, 3}
    for entry in found:  # each fits, as the pre-flight predicts
        assert entry["status"] == "run" and entry["need_bytes"] <= entry["have_bytes"]
    main_mb = config["train"]["micro_batch_size"]
    # per layout: the largest fitting micro-batch is there, and the next power of two would not fit
    layouts = {}
    for entry in found:
        key = (entry["gpus"], entry["engine"], entry["zero_stage"], entry["activation_checkpointing"])
        layouts[key] = max(layouts.get(key, 0), entry["micro_batch_size"])
    assert {mb for mb in layouts.values()} - {main_mb} and all(mb <= SEARCH_MICRO_BATCH_FACTOR * main_mb
                                                                 for mb in layouts.values())
    for (ranks, engine, stage, checkpointing), limit in layouts.items():
        if 2 * limit <= SEARCH_MICRO_BATCH_FACTOR * main_mb:
            bigger = Cell(ranks, stage, "fp32", "gloo", 2 * limit, "none", engine, checkpointing)
            judged = judge_cell(plan_config(config), bigger, bench, "cpu", budget, 4096, None)
            assert judged["status"] == "predicted_oom"
        if checkpointing:  # checkpointing only where it lets a larger micro-batch fit
            assert limit > layouts.get((ranks, engine, stage, False), 0)
    # 3 ranks at the main run's micro-batch do not fit 1.9 GiB: what the search keeps there is smaller or checkpointed
    assert all(e["status"] == "predicted_oom" for e in declared if e["gpus"] == 3)
    assert all(e["micro_batch_size"] < main_mb or e["activation_checkpointing"] for e in found if e["gpus"] == 3)
    # off by default: the matrix is the declared cells (and the plain single-device baseline) only
    assert all(e["origin"] != "search" for e in plan_matrix(tiny(), budget=budget)["cells"])


def test_the_dry_run_lists_every_declared_cell_with_its_fate_and_reason(monkeypatch):
    from pretrain_bench.bench.matrix import cells_text, planning_peak

    matrix = articles_box_matrix(monkeypatch)
    lines = cells_text(matrix).splitlines()
    assert lines[0] == ("benchmark cells: 16 declared + 1 plain single-device baseline (DDP on one rank), judged "
                        "against 24.0 GiB per GPU (assumed) / 128.0 GiB host RAM (assumed) (assumed: "
                        "benchmark.device_memory_gib, no GPU detected here; host RAM: assumed: "
                        "benchmark.host_memory_gib, no GPU detected here):")
    listed = dict(line.strip().split(": ", 1) for line in lines[1:])
    baseline = "ddp-ranks1-fp16-nccl-ckpt [plain single-device baseline]"
    assert list(listed) == [e["cell"] for e in matrix["cells"][:-1]] + [baseline]
    listed[matrix["cells"][-1]["cell"]] = listed.pop(baseline)
    for entry in matrix["cells"]:
        text = listed[entry["cell"]]
        if entry["status"] == "run":
            assert text == f"runs: predicted to fit: {entry['memory_text']}"
        else:
            assert text == "predicted not to fit: " + entry["reason"].removeprefix("predicted OOM: ")
    # every figure of the articles' box a cell's line quotes (GPU memory, host RAM) is assumed, and says so there
    figures = re.findall(r"has ([\d.,]+) GiB( \(assumed\))?", "\n".join(lines[1:]))
    assert len(figures) >= len(matrix["cells"]) and all(assumed for _, assumed in figures), figures
    assert {size for size, _ in figures} == {"24.0", "128.0"}  # the GPU's memory and the host's RAM
    # a budget measured on this machine is not marked
    here = Budget("cpu", 16 * GIB, "physical RAM of this machine", 16 * GIB, "physical RAM of this machine")
    measured = cells_text(plan_matrix(tiny(), budget=here))
    assert "has 16.0 GiB host RAM" in measured and "assumed" not in measured
    nccl = plan_matrix(tiny(), budget=CPU_BUDGET)
    assert "ranks2-zero1-fp32-nccl: not supported here: comm_backend nccl needs CUDA GPUs" in cells_text(nccl)
    searched = cells_text(plan_matrix(tiny(search=True), budget=CPU_BUDGET))
    assert "found by benchmark.search" in searched.splitlines()[0]
    assert "fsdp-ranks1-fp32-gloo [benchmark.search]: runs: predicted to fit: " in searched
    # the search adds no second copy of the plain single-device baseline
    assert "ddp-ranks1-fp32-gloo [plain single-device baseline]: runs: predicted to fit: " in searched
    assert searched.count("ddp-ranks1-fp32-gloo ") == 1
    # the peak of a GPU that is not here is a datasheet figure for benchmark.assumed_gpu: labelled assumed
    monkeypatch.setattr(devices, "gpu_names", lambda: [])
    config = merged()
    def peak_of(config):
        return planning_peak(ReportSettings.from_config(config["report"]), BenchSettings.from_config(config), "cuda",
                             "x")

    flops, source = peak_of(config)
    assert flops and source.endswith("(benchmark.assumed_gpu, no GPU detected here)")
    # one peak per machine, as rule measure_peak takes it: the 16-bit datasheet figure for an fp32 run too
    fp32 = {**config, "train": {**config["train"], "precision": "fp32"}}
    assert peak_of(fp32) == (flops, source)
    from pretrain_bench.bench.matrix import cost_preview, preview_text

    text = preview_text(cost_preview(matrix, TrainSettings.from_config(config["train"]),
                                     ModelSettings.from_config(config["model"]), 102_400, flops, source))
    assert f"TFLOP/s per rank (assumed: {source})" in text
    assert "not estimated: the corpus download, tokenizer training and sharding" in text


def test_a_matrix_that_measures_scaling_gets_a_plain_single_device_baseline(monkeypatch):
    # the tiny matrix (1-3 ranks, DeepSpeed only): DDP on one rank, at its precision, micro-batch and checkpointing
    matrix = plan_matrix(tiny(), budget=CPU_BUDGET)
    baselines = [e for e in matrix["cells"] if e["origin"] == "baseline"]
    assert [(e["cell"], e["engine"], e["gpus"], e["zero_stage"], e["status"]) for e in baselines] == [
        ("ddp-ranks1-fp32-gloo", "ddp", 1, 0, "run")]
    assert "ddp-ranks1-fp32-gloo" in runnable(matrix)
    # none where the matrix declares one (any backend or micro-batch), or measures no scaling (one rank only)
    declared = plan_matrix(tiny(matrix={"engine": ["deepspeed", "ddp"], "comm_backend": ["gloo"]}), budget=CPU_BUDGET)
    assert all(e["origin"] == "declared" for e in declared["cells"])
    assert all(e["origin"] == "declared" for e in plan_matrix(tiny(matrix={"gpus": [1]}), budget=CPU_BUDGET)["cells"])
    # only many-rank cells: the baseline is the only 1-rank cell; on CUDA over the matrix's first backend
    config = tiny(matrix={"gpus": [2], "precision": ["bf16"], "comm_backend": ["nccl", "gloo"]})
    config["train"]["device"] = "cuda"
    gpus = Budget("cuda", 24 * GIB, "test", 128 * GIB, "test", gpu_count=3)
    cuda = plan_matrix(config, budget=gpus)
    assert [e["cell"] for e in cuda["cells"] if e["origin"] == "baseline"] == ["ddp-ranks1-bf16-nccl"]
    # the articles' box: 7B's replicated 16Ψ does not fit one 24 GiB card, and the dry run says so
    box = articles_box_matrix(monkeypatch)
    (plain,) = [e for e in box["cells"] if e["origin"] == "baseline"]
    assert plain["status"] == "predicted_oom" and plain["short_of"] == ["GPU memory"]
    from pretrain_bench.bench.matrix import cells_text

    assert (f"  {plain['cell']} [plain single-device baseline]: predicted not to fit: needs "
            in cells_text(box))


def test_the_expert_parallel_axis_splits_a_moe_models_experts_and_refuses_what_cannot_split():
    """tiny-moe on DDP: the -ep2 cells run where the ranks divide into EP 2, their expert states halved against the
    same cell at EP 1; on 1 rank, under DeepSpeed and for a dense model the cell is unsupported with the reason."""
    moe = yaml.safe_load((ROOT / "config" / "tiny-moe-cpu.yaml").read_text())
    config = merged(yaml.safe_load((ROOT / "config" / "tiny-cpu.yaml").read_text()), moe, {"benchmark": {"matrix": {
        "gpus": [1, 2], "engine": ["ddp", "deepspeed"], "zero_stage": [2], "expert_parallel": [1, 2]}}})
    entries = {e["cell"]: e for e in plan_matrix(config, budget=CPU_BUDGET)["cells"]}
    split, whole = entries["ddp-ranks2-fp32-gloo-ep2"], entries["ddp-ranks2-fp32-gloo"]
    assert split["status"] == whole["status"] == "run" and split["expert_parallel"] == 2
    assert split["estimate"]["expert_states"] == pytest.approx(whole["estimate"]["expert_states"] / 2, rel=0.01)
    assert split["estimate"]["non_expert_states"] == whole["estimate"]["non_expert_states"]
    assert entries["ddp-ranks1-fp32-gloo-ep2"]["status"] == "unsupported"
    assert "does not divide the 1 ranks" in entries["ddp-ranks1-fp32-gloo-ep2"]["reason"]
    # DeepSpeed's AutoEP layer has no balance loss, which tiny-moe trains with
    assert "trains without the sequence-wise balance loss" in entries["ranks2-zero2-fp32-gloo-ep2"]["reason"]
    moe["model"]["overrides"]["aux_loss_alpha"] = 0.0
    config = merged(yaml.safe_load((ROOT / "config" / "tiny-cpu.yaml").read_text()), moe, {"benchmark": {"matrix": {
        "gpus": [2], "engine": ["deepspeed"], "zero_stage": [2], "expert_parallel": [1, 2]}}})
    entries = {e["cell"]: e for e in plan_matrix(config, budget=CPU_BUDGET)["cells"]}
    split, whole = entries["ranks2-zero2-fp32-gloo-ep2"], entries["ranks2-zero2-fp32-gloo"]
    assert split["status"] == whole["status"] == "run"
    # ZeRO-2 fp32 over the experts: 4Ψ_E + 16Ψ_E/2 at EP 1; half the experts on a 1-rank group at EP 2: (4 + 16)Ψ_E/2
    assert split["estimate"]["expert_states"] == pytest.approx(whole["estimate"]["expert_states"] * 10 / 12, rel=0.01)
    assert "EP 2 over N/EP = 1 rank" in split["estimate"]["state_formula"]
    dense = tiny(matrix={"gpus": [2], "engine": ["ddp"], "comm_backend": ["gloo"], "expert_parallel": [2]})
    (entry,) = [e for e in plan_matrix(dense, budget=CPU_BUDGET)["cells"] if e["origin"] == "declared"]
    assert entry["status"] == "unsupported" and "needs a model with routed experts" in entry["reason"]
