"""The report's mixture-of-experts section: parameters from the family's count, the expert balance recomputed from
metrics.jsonl, the plots drawn, DeepSeek's published costs read as MFU by hand, nothing of it for a dense model; and
the native model's balance-loss record the trainer writes to metrics.jsonl."""
import copy
import json
import statistics

import pytest
import torch
from test_report import MATRIX, PNG, RUNS, summary, write_bench

from pretrain_bench.report import experts
from pretrain_bench.report.render import build_report
from pretrain_bench.train.models.deepseek import PRESETS, count_parameters, resolve_shape
from pretrain_bench.train.models.native_deepseek import NativeDeepseekForCausalLM, max_violation
from pretrain_bench.train.models.registry import preset_family
from pretrain_bench.train.run_summary import RunSummary

VOCAB = 512


def tiny_moe_summary() -> dict:
    """summary(...) with the model block Trainer.summarise writes for tiny-moe (the family's describe)."""
    family = preset_family("tiny-moe")
    shape = resolve_shape("tiny-moe", None, VOCAB)
    counts = count_parameters(shape)
    main = summary(3)
    main["model"] = {"preset": "tiny-moe", "parameters": counts["total"], "non_embedding_parameters":
                     counts["non_embedding"], "matmul_parameters": counts["matmul"], **family.describe(shape),
                     "attn_implementation": "sdpa", "implementation": "native"}
    return main


def load_records(steps: int = 24, layers: int = 3, experts_: int = 8) -> list[dict]:
    """metrics.jsonl records whose load starts skewed (expert 0 takes half of each layer's tokens) and evens out."""
    records = []
    for step in range(1, steps + 1):
        skew = 1.0 - (step - 1) / (steps - 1)
        load = [[int(1024 * ((skew * 4 + 1) if e == 0 else 1)) for e in range(experts_)] for _ in range(layers)]
        records.append({"step": step, "loss": 7.0, "tokens_per_s": 900.0, "step_time_s": 1.0, "after_resume": False,
                        "expert_load": load, "max_violation": max_violation(torch.tensor(load)).tolist(),
                        "aux_loss": 1e-4 * (2 - skew), "router_bias_norm": [0.001 * step] * layers})
    return records


def moe_matrix() -> dict:
    """MATRIX with each estimate's model states (300 bytes) two thirds routed experts, as memory.model splits them."""
    matrix = copy.deepcopy(MATRIX)
    for entry in matrix["cells"]:
        if entry["estimate"]:
            entry["estimate"]["expert_states"] = 200
    return matrix


def render(tmp_path, main: dict, records: list[dict], extra_runs: dict | None = None) -> tuple[str, str, dict]:
    (tmp_path / "summary.json").write_text(json.dumps(main))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "matrix.json").write_text(json.dumps(moe_matrix()))
    out = tmp_path / "report"
    build_report(tmp_path / "summary.json", tmp_path / "metrics.jsonl", [], out / "report.md", out / "report.html",
                 out / "plots", target_corpus_tokens=1e12, matrix_path=tmp_path / "matrix.json",
                 bench_paths=write_bench(tmp_path, {**RUNS, **(extra_runs or {})}))
    return (out / "report.md").read_text(), (out / "report.html").read_text(), out


def test_a_moe_run_reports_its_parameters_balance_and_plots(tmp_path):
    main, records = tiny_moe_summary(), load_records()
    md, html, out = render(tmp_path, main, records)
    counts = count_parameters(resolve_shape("tiny-moe", None, VOCAB))
    assert "## 6b. Mixture of experts" in md and 'id="experts"' in html
    assert f"| active per token | {experts.fmt(counts['active'])} |" in md
    share = experts.fmt(100 * counts["expert"] / counts["total"], 1)
    assert f"| routed experts | {experts.fmt(counts['expert'])} | {share} |" in md
    # MaxVio over the first and last 10 steps, recomputed: expert 0 had 5× the others at step 1, 1× at the end
    early = statistics.fmean(r["max_violation"][0] for r in records[:10])
    late = statistics.fmean(r["max_violation"][0] for r in records[-10:])
    assert early > 1.0 and late < 0.7 and late < early / 3
    first = main["model"]["first_moe_layer"]
    assert f"| {first} | {experts.fmt(early, 3)} | {experts.fmt(late, 3)} |" in md
    assert "steps 1–10 and over steps 15–24" in md
    assert "All-to-all: none in this run" in md
    # expert vs non-expert model states per cell: 200 and 100 of the 300 predicted bytes
    gib = experts.GIB
    assert (f"| ranks1-zero2-fp32-gloo | 1 | {experts.fmt(300 / gib, 3)} | {experts.fmt(200 / gib, 3)} | "
            f"{experts.fmt(100 / gib, 3)} | 66.7 |") in md
    for name in ("expert_load", "balance"):
        assert (out / "plots" / f"{name}.png").read_bytes()[:8] == PNG
        assert f"](plots/{name}.png)" in md
    assert html.count("data:image/png;base64,") == 7  # the dense report's five (no evaluation here) + two


def test_a_dense_run_has_no_experts_section(tmp_path):
    md, html, out = render(tmp_path, summary(3), [{"step": 1, "loss": 8.0, "tokens_per_s": 900.0,
                                                   "step_time_s": 1.0, "after_resume": False}])
    assert "Mixture of experts" not in md and "DeepSeek-V3 training cost" not in md
    assert not (out / "plots" / "expert_load.png").exists()


def test_deepseeks_published_costs_read_as_mfu_on_active_parameters_by_hand():
    """DeepSeek-V3: 14.8T tokens in 2.664M H800 GPU-hours; FLOPs per token = 6 × active matmul parameters + 6 × L ×
    heads × (Dqk + Dv) × T at T = 4096 (the report's formula, written out); ÷ 989.5 TFLOP/s."""
    v3 = PRESETS["deepseek-v3"]
    per_token = 6 * count_parameters(v3)["active_matmul"] + 6 * 61 * 128 * (128 + 64 + 128) * 4096
    by_hand = 14.8e12 * per_token / (2.664e6 * 3600) / 989.5e12
    implied = experts.implied_mfu(experts.DEEPSEEK_COSTS[0])
    assert implied["mfu_16bit"] == pytest.approx(by_hand, rel=1e-9)
    # the 6N bound alone (37B active) is 35 %; with attention about 44 %: possible, and half that against FP8
    assert 0.40 < implied["mfu_16bit"] < 0.46 and implied["mfu_fp8"] == pytest.approx(by_hand / 2, rel=1e-9)
    v2 = experts.implied_mfu(experts.DEEPSEEK_COSTS[1])
    assert 0.28 < v2["mfu_16bit"] < 0.32  # 172.8K GPU-hours per trillion tokens, 21B active
    rows = experts.cost_rows(RunSummary.from_dict(tiny_moe_summary()))
    assert [r["verdict"].split(":")[0] for r in rows] == ["physically possible"] * 2
    assert "MFU on active parameters 20.0%" in rows[0]["measured"]


def test_the_native_model_reports_the_mean_balance_loss_of_its_training_passes():
    shape = resolve_shape("tiny-moe", {"num_hidden_layers": 2, "aux_loss_alpha": 0.01}, VOCAB)
    model = NativeDeepseekForCausalLM(shape).train()
    batches = [torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    seen = [float(model(input_ids=b).aux_loss) for b in batches]
    assert model.aux_loss_mean().item() == pytest.approx(statistics.fmean(seen), rel=1e-12)
    model.eval()
    with torch.no_grad():
        model(input_ids=batches[0])  # evaluation passes are not counted
    assert model.aux_loss_mean().item() == pytest.approx(statistics.fmean(seen), rel=1e-12)
    assert model.router_bias_norms() == [0.0]  # one MoE layer, its bias still zero
    model.update_router_biases(torch.tensor([[10, 0, 0, 0, 0, 0, 0, 6]]))
    assert model.aux_loss_mean() is None  # the update restarts the counts and the mean
    assert model.router_bias_norms()[0] > 0
    off = NativeDeepseekForCausalLM(resolve_shape("tiny-moe", {"num_hidden_layers": 2, "aux_loss_alpha": 0.0},
                                                  VOCAB)).train()
    off(input_ids=batches[0])
    assert off.aux_loss_mean() is None


def test_an_expert_parallel_run_reports_its_all_to_all_share(tmp_path):
    main = {**tiny_moe_summary(), "expert_parallel": 3, "all_to_all_fraction": 0.25}
    split = [RunSummary.from_dict({**summary(3, comm=c), "expert_parallel": 3, "all_to_all_fraction": a})
             for c, a in ((0.1, 0.2), (0.12, 0.3))]
    md, html, out = render(tmp_path, main, load_records(), {"ranks3-zero2-fp32-gloo-ep3": split})
    # the cell is not in the matrix: no prediction of its bytes, so no rate
    assert "| ranks3-zero2-fp32-gloo-ep3 | 3 | 3 | 25.0 (20.0–30.0) | 11.0 (10.0–12.0) | n/a | not measured |" in md
    assert "split over 3 ranks (train.expert_parallel)" in md
    assert "by all-to-all: 25.0% of the main run's step time (measured:" in md
    assert "All-to-all: none" not in md and "3 in this run" in md


def test_all_to_all_rows_put_the_predicted_bytes_over_the_measured_time():
    split = [RunSummary.from_dict({**summary(3, comm=0.1), "expert_parallel": 3, "all_to_all_fraction": a})
             for a in (0.2, 0.4)]
    cell = "ranks3-zero2-fp32-gloo-ep3"
    per_micro_batch = 3 * 2**20
    rows = experts.all_to_all_rows({cell: split, "ranks3-dense": [RunSummary.from_dict(summary(3))]},
                                   [{"cell": cell, "all_to_all_bytes": per_micro_batch}])
    assert [r["cell"] for r in rows] == [cell]  # only the cells that split their experts
    run = split[0]
    per_step = per_micro_batch * run.grad_accum_steps
    assert rows[0]["sent_mib"] == f"{per_step / 2**20:.2f}"
    rates = sorted(per_step / (a * run.step_time_s["median"]) / 1e6 for a in (0.2, 0.4))
    assert rows[0]["rate_mb_s"] == f"{statistics.median(rates):.0f} ({rates[0]:.0f}–{rates[1]:.0f})"


def test_an_expert_parallel_cell_is_a_scaling_series_of_its_own_and_says_so():
    # beside EP 1's 1- and 2-rank cells, the 2-rank cell at EP 2 is not a second point of their series: it has no
    # 1-rank cell of its own (one rank cannot split the experts), and its setup names the split
    from pretrain_bench.report.recommendation import scaling_entries, setup_text
    from pretrain_bench.report.tables import cell_table, engine_label, records, scaling_frame

    split = RunSummary.from_dict({**summary(2, tokens_per_s=1500.0), "expert_parallel": 2})
    runs = {"ranks1": [RunSummary.from_dict(summary(1))], "ranks2": [RunSummary.from_dict(summary(2))],
            "ranks2-ep2": [split]}
    matrix = scaling_entries(runs)
    rows = {row["cell"]: row for row in records(scaling_frame(matrix, cell_table(matrix, runs), 1.0))}
    assert rows["ranks2"]["baseline_cell"] == "ranks1" and rows["ranks2"]["speedup"] == pytest.approx(1.0)
    assert rows["ranks2-ep2"]["baseline_cell"] is None and rows["ranks2-ep2"]["speedup"] is None
    assert rows["ranks2-ep2"]["speedup_best"] == pytest.approx(1.5)  # against the fastest 1-rank cell
    assert rows["ranks2-ep2"]["series"].endswith(", expert parallel 2")
    assert rows["ranks2"]["series"] != rows["ranks2-ep2"]["series"]
    assert engine_label(vars(split)) == "DeepSpeed ZeRO-2 + expert parallel 2"
    assert "DeepSpeed ZeRO-2 + expert parallel 2, fp32" in setup_text(split)
