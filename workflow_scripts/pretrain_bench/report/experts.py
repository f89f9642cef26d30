"""The report's mixture-of-experts section, for a main run whose model routes tokens to experts (the DeepSeek family):
its total and active parameters, how evenly each MoE layer's router spread the tokens over the run (MaxVio and the
coefficient of variation of the per-expert load, from metrics.jsonl's `expert_load`), the balance loss and the
router biases, and the training costs DeepSeek published for V2 and V3 read as MFU on active parameters, beside
this run's.

Everything here is read from the run's own records (summary.json, metrics.jsonl) or computed from a published
figure with the formula printed next to it.
"""
from __future__ import annotations

import statistics

from pretrain_bench.core.formats import fmt
from pretrain_bench.report.tables import spread
from pretrain_bench.train.memory.model import GIB
from pretrain_bench.train.models.flops import GPU_PEAK_TFLOPS_16BIT
from pretrain_bench.train.models.registry import preset_family

# DeepSeek's published training costs (H800 GPU-hours), typed once here with their source. The sequence length is
# the pre-training one each report states (4K); the FLOPs per token come from the family's own formula for the
# preset of that model, so the implied MFU uses the same convention as this run's.
DEEPSEEK_COSTS = (
    {"model": "DeepSeek-V3", "preset": "deepseek-v3", "gpu": "H800", "gpu_hours": 2.664e6, "tokens": 14.8e12,
     "seq_len": 4096, "precision": "FP8 mixed precision",
     "claimed": "2.664M H800 GPU-hours of pre-training on 14.8T tokens (2.788M with context extension and "
                "post-training)",
     "source": "DeepSeek-V3 Technical Report (arXiv:2412.19437), Table 1"},
    {"model": "DeepSeek-V2", "preset": "deepseek-v2", "gpu": "H800", "gpu_hours": 172.8e3, "tokens": 1e12,
     "seq_len": 4096, "precision": None,
     "claimed": "172.8K H800 GPU-hours per trillion training tokens (8.1T tokens in all)",
     "source": "DeepSeek-V2 paper (arXiv:2405.04434), 'Training and Inference Efficiency'"},
)
# NVIDIA H800 datasheet, SXM5: FP8 3,958* TFLOPS (2:4 sparse; halved for dense, as GPU_PEAK_TFLOPS_16BIT)
H800_FP8_DENSE_TFLOPS = 1979.0

EARLY_LATE_STEPS = 10  # MaxVio and CV compared over the run's first and last this many steps


def is_moe(summary) -> bool:
    """Whether the main run's model routes tokens to experts (its summary names active parameters)."""
    return bool(summary.model.get("active_parameters"))


def load_records(records: list[dict]) -> list[dict]:
    """The metrics.jsonl records that carry an expert load (every training step of a MoE model)."""
    return [r for r in records if r.get("expert_load")]


def coefficient_of_variation(layer: list[int]) -> float:
    """Standard deviation ÷ mean of one layer's tokens per expert (population form); 0 for a layer without tokens."""
    mean = statistics.fmean(layer)
    return statistics.pstdev(layer) / mean if mean > 0 else 0.0


def parameter_rows(summary) -> list[dict]:
    """Total, active, routed-expert and non-expert parameters of the main run's model."""
    model = summary.model
    total = model["parameters"]
    rows = [("total", total, "every parameter: what memory holds"),
            ("active per token", model["active_parameters"],
             "what one token passes through (DeepSeek's \"activated\"): all but the routed experts it is not sent to; "
             "compute, FLOPs and MFU follow this"),
            ("routed experts", model["expert_parameters"],
             f"{model['moe_layers']} MoE layers × {model['routed_experts']} experts, {model['experts_per_token']} "
             "per token"),
            ("everything else", total - model["expert_parameters"],
             "attention, shared experts, dense layers, routers, embeddings and norms")]
    return [{"part": part, "parameters": fmt(count), "share_pct": fmt(100 * count / total, 1), "what": what}
            for part, count, what in rows]


def early_and_late(loads: list[dict]) -> tuple[list[dict], list[dict]]:
    """The first and the last EARLY_LATE_STEPS of the records with an expert load (half of them each, when fewer)."""
    span = min(EARLY_LATE_STEPS, max(1, len(loads) // 2))
    return loads[:span], loads[-span:]


def balance_rows(loads: list[dict], first_moe_layer: int = 0) -> list[dict]:
    """Per MoE layer of the records with an expert load (numbered as decoder layers from 0, the first MoE one
    `first_moe_layer`): MaxVio and CV of the load, mean over the first and over the last steps (early_and_late), and
    the router bias's norm at the end."""
    if not loads:
        return []
    parts = dict(zip(("early", "late"), early_and_late(loads)))
    bias = loads[-1].get("router_bias_norm")
    rows = []
    for layer in range(len(loads[0]["expert_load"])):
        maxvio = {part: statistics.fmean(r["max_violation"][layer] for r in steps) for part, steps in parts.items()}
        cv = {part: statistics.fmean(coefficient_of_variation(r["expert_load"][layer]) for r in steps)
              for part, steps in parts.items()}
        rows.append({"layer": first_moe_layer + layer,
                     "maxvio_early": fmt(maxvio["early"], 3), "maxvio_late": fmt(maxvio["late"], 3),
                     "cv_early": fmt(cv["early"], 3), "cv_late": fmt(cv["late"], 3),
                     "bias_norm": fmt(bias[layer], 4) if bias else "no bias (softmax router)"})
    return rows


def balance_steps(loads: list[dict]) -> dict:
    """The step ranges balance_rows compares, for the table's caption."""
    if not loads:
        return {}
    early, late = early_and_late(loads)
    return {"early": f"{early[0]['step']}–{early[-1]['step']}", "late": f"{late[0]['step']}–{late[-1]['step']}",
            "steps": len(loads)}


def implied_mfu(cost: dict) -> dict:
    """What a published training cost implies: FLOPs = tokens × FLOPs per token of the preset (its family's formula at
    the published sequence length); achieved FLOP/s per GPU = FLOPs ÷ (GPU-hours × 3600); MFU = that ÷ the GPU's
    dense 16-bit peak (and ÷ its FP8 peak)."""
    family = preset_family(cost["preset"])
    shape = family.presets[cost["preset"]]
    per_token = family.flops_per_token(shape, cost["seq_len"])
    achieved = cost["tokens"] * per_token / (cost["gpu_hours"] * 3600)
    counts = family.count_parameters(shape)
    return {"flops_per_token": per_token, "achieved_tflops": achieved / 1e12, "active": counts["active"],
            "total": counts["total"], "mfu_16bit": achieved / (GPU_PEAK_TFLOPS_16BIT["H800"] * 1e12),
            "mfu_fp8": achieved / (H800_FP8_DENSE_TFLOPS * 1e12)}


def cost_rows(summary) -> list[dict]:
    """DeepSeek's published costs beside this run's measured MFU on active parameters."""
    measured = (f"MFU on active parameters {fmt(100 * summary.mfu, 1)}% ({summary.world_size} rank(s), "
                f"{summary.device}, {summary.precision})" if summary.mfu is not None
                else f"no MFU: {summary.mfu_note}")
    rows = []
    for cost in DEEPSEEK_COSTS:
        implied = implied_mfu(cost)
        rows.append({
            "claim": f"{cost['model']} training cost ({cost['source']})",
            "claimed": cost["claimed"],
            "physics": (f"{fmt(cost['tokens'] / 1e12)}T tokens × {fmt(implied['flops_per_token'] / 1e9, 1)} GFLOP "
                        "per token "
                        f"({cost['preset']}: {fmt(implied['active'] / 1e9, 1)}B active of "
                        f"{fmt(implied['total'] / 1e9, 1)}B, sequence {cost['seq_len']}) ÷ "
                        f"({fmt(cost['gpu_hours'] / 1e3)}K GPU-hours × 3600 s) = {fmt(implied['achieved_tflops'], 0)} "
                        f"TFLOP/s per GPU: MFU {fmt(100 * implied['mfu_16bit'], 1)}% of the H800's "
                        f"{fmt(GPU_PEAK_TFLOPS_16BIT['H800'], 1)} dense BF16 TFLOP/s, "
                        f"{fmt(100 * implied['mfu_fp8'], 1)}% of its {fmt(H800_FP8_DENSE_TFLOPS, 0)} FP8"),
            "measured": measured, "flags": [],
            "verdict": ("physically possible: below the H800's peak"
                        + (f" ({cost['precision']} training)" if cost["precision"] else "")
                        if implied["mfu_16bit"] <= 1 else
                        f"impossible as stated: {fmt(100 * implied['mfu_16bit'], 0)}% of the BF16 peak"),
        })
    return rows


def memory_rows(memory: list[dict]) -> list[dict]:
    """Per benchmark cell the memory table shows: the predicted model states per rank split into the routed
    experts' and the rest's (memory.model: each part by the cell's own state formula), beside the measured peak."""
    return [{"cell": r["cell"], "ranks": str(r["ranks"]), "states_gib": fmt(r["states_bytes"] / GIB, 3),
             "expert_gib": fmt(r["expert_states_bytes"] / GIB, 3),
             "non_expert_gib": fmt((r["states_bytes"] - r["expert_states_bytes"]) / GIB, 3),
             "expert_pct": fmt(100 * r["expert_states_bytes"] / r["states_bytes"], 1) if r["states_bytes"] else "n/a",
             "measured_gib": fmt(r["measured_bytes"] / GIB, 3) if r["measured_bytes"] is not None else "n/a"}
            for r in memory]


def all_to_all_rows(runs_by_cell: dict, memory: list[dict] = ()) -> list[dict]:
    """Per benchmark cell that split its experts (expert_parallel above 1): the all-to-alls' share of the step time
    beside the gradient collectives', median (min–max) over the cell's repeats; the bytes a rank sends by all-to-all
    per step, *predicted* (memory.model RunShape.all_to_all_bytes per micro-batch × grad_accum_steps, a balanced
    load), and that ÷ the measured all-to-all time per step (its share × the median step time): an effective rate,
    waiting for the slowest rank included."""
    sent = {r["cell"]: r.get("all_to_all_bytes") or 0 for r in memory}
    rows = []
    for cell, runs in sorted(runs_by_cell.items()):
        if runs[0].expert_parallel <= 1:
            continue
        a2a = [r.all_to_all_fraction for r in runs if r.all_to_all_fraction is not None]
        comm = [r.comm_fraction for r in runs if r.comm_fraction is not None]
        per_step = sent.get(cell, 0) * runs[0].grad_accum_steps
        rates = [per_step / (r.all_to_all_fraction * r.step_time_s["median"]) for r in runs
                 if per_step and r.all_to_all_fraction and r.step_time_s.get("median")]
        rows.append({"cell": cell, "ranks": str(runs[0].world_size), "expert_parallel": str(runs[0].expert_parallel),
                     "all_to_all_pct": spread(a2a, 1, 100) if a2a else "not measured",
                     "comm_pct": spread(comm, 1, 100) if comm else "not measured",
                     "sent_mib": fmt(per_step / 2**20, 2) if per_step else "n/a",
                     "rate_mb_s": spread(rates, 0, 1e-6) if rates else "not measured"})
    return rows


def moe_section(summary, records: list[dict], memory: list[dict] = (), runs_by_cell: dict | None = None
                ) -> dict | None:
    """The section's tables and captions, or None for a dense model; `memory`: the memory table's rows;
    `runs_by_cell`: the benchmark's summaries by cell."""
    if not is_moe(summary):
        return None
    loads = load_records(records)
    aux = [r["aux_loss"] for r in loads if "aux_loss" in r]
    return {"parameters": parameter_rows(summary), "memory": memory_rows(memory),
            "all_to_all": all_to_all_rows(runs_by_cell or {}, memory),
            "balance": balance_rows(loads, summary.model["first_moe_layer"]),
            "balance_steps": balance_steps(loads), "costs": cost_rows(summary),
            "aux_first": fmt(aux[0], 4) if aux else None, "aux_last": fmt(aux[-1], 4) if aux else None,
            "all_to_all_pct": (fmt(100 * summary.all_to_all_fraction, 1) if summary.all_to_all_fraction is not None
                               else None),
            "bias_update_rate": summary.model.get("bias_update_rate"),
            "aux_loss_alpha": summary.model.get("aux_loss_alpha"),
            "flops_formula": summary.flops_formula}
