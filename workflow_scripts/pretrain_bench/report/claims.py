"""The source articles' claimed figures, as data, and what the memory model and this run say about each.

The figures are typed exactly once, here, with their source; the report's "Claims checked" section is computed
from them (physics: the ZeRO memory model and PaLM FLOPs for the articles' 7B model on 24 GB cards; measured: this
run's benchmark cells, read as numbers from the report's frames). Nothing in the report's text repeats a claimed
number by hand, nor a formula: their text comes from the memory model's tables (`formula_texts`).
"""
from __future__ import annotations

from pretrain_bench.core.formats import fmt, fmt_duration
from pretrain_bench.report.physical_checks import untrusted
from pretrain_bench.report.tables import (
    BACKEND_COLUMNS,
    COMMUNICATION_COLUMNS,
    MEMORY_COLUMNS,
    SCALING_COLUMNS,
    ReportFrames,
    format_row,
    records,
)
from pretrain_bench.train.engines.spec import ENGINE_SPECS, engine_spec
from pretrain_bench.train.memory.model import (
    GIB,
    STATE_FORMULAS,
    Budget,
    RunShape,
    estimate,
    judge,
    model_state_bytes,
    torch_state_bytes,
)
from pretrain_bench.train.models.flops import GPU_PEAK_TFLOPS_16BIT
from pretrain_bench.train.models.registry import preset_family

SOURCE = "the source articles (docs/reference-experiment.md)"

# The setup the articles describe (one box): what the physics column assumes.
SETUP = {
    "gpu": "RTX 4090", "gpus": 3, "gpu_memory_gib": 24, "host_ram_gb": 128, "model": "deepseek-7b",
    "seq_len": 128, "micro_batch_size": 8, "precision": "fp16", "corpus": "1 TB text corpus",
    "source": SOURCE + ", 'The setup they describe'",
}

CLAIMS = {
    "one_gpu": {"gpus": 1, "batch": 8, "tokens_per_s": 1200, "memory_gb": 22, "epoch_days": 14,
                "source": SOURCE + ": table, 1 GPU column"},
    "three_gpus": {"gpus": 3, "zero_stage": 2, "batch": 24, "tokens_per_s": 3400, "speedup": 2.8, "memory_gb": 18,
                   "epoch_days": 5, "source": SOURCE + ": table, 3 GPUs (ZeRO-2) column"},
    "zero2_memory_cut": {"cut_pct": 20, "source": SOURCE + ": 'ZeRO-2 cut per-card memory by 20%'"},
    "nccl_vs_gloo": {"nccl_faster_pct": 30, "source": SOURCE + ": 'NCCL is 30% faster than Gloo'"},
    "eight_nodes": {"nodes": 8, "gpu": "RTX 4090 D", "gpu_memory_gib": 24, "engine": "DDP", "train_engine": "ddp",
                    "parameters": 70e9, "tokens_per_s": (512, 3584), "speedup": 7, "comm_pct": 12, "scale_4_to_8": 1.9,
                    "source": SOURCE + ": the 8-server article"},
}


def articles_run(gpus: int, zero_stage: int, offload: bool = False) -> RunShape:
    """The articles' 7B model (DeepSeek-LLM-7B shape) at their batch and sequence length, on CUDA."""
    family = preset_family(SETUP["model"])
    shape = family.presets[SETUP["model"]]
    return RunShape(parameters=family.count_parameters(shape)["total"], **family.memory_dims(shape),
                    seq_len=SETUP["seq_len"],
                    micro_batch_size=SETUP["micro_batch_size"], ranks=gpus, zero_stage=zero_stage,
                    precision=SETUP["precision"], offload_optimizer="cpu" if offload else "none", device="cuda")


def articles_budget() -> Budget:
    return Budget("cuda", SETUP["gpu_memory_gib"] * GIB, f"{SETUP['gpu']} {SETUP['gpu_memory_gib']} GB",
                  int(SETUP["host_ram_gb"] * 1e9), f"{SETUP['host_ram_gb']} GB host RAM", SETUP["gpus"])


def _mem(run: RunShape) -> tuple[float, bool, str]:
    est = estimate(run)
    verdict = judge(est, run, articles_budget())
    return est.per_rank / GIB, verdict.fits, verdict.text


def _flops_share(tokens_per_s: float, gpus: int) -> float:
    family = preset_family(SETUP["model"])
    per_token = family.flops_per_token(family.presets[SETUP["model"]], SETUP["seq_len"])
    return tokens_per_s * per_token / (gpus * GPU_PEAK_TFLOPS_16BIT[SETUP["gpu"]] * 1e12)


def _states(states: dict) -> int:
    return states["params"] + states["grads"] + states["optimizer"]


def short_formula(text: str) -> str:
    """A model-state formula without its breakdown: '16Ψ (2Ψ params + 2Ψ grads + 12Ψ Adam/master)' → '16Ψ'."""
    return text.split(" (")[0]


def zero_formula(stage: int, precision: str = "mixed", ranks: int | None = None) -> str:
    """The ZeRO paper's bytes of model states per rank (memory_model.STATE_FORMULAS), N replaced by `ranks`."""
    text = short_formula(STATE_FORMULAS[precision][stage])
    return text if ranks is None else text.replace("/N", f"/{ranks}")


def formula_texts() -> dict[str, str]:
    """The model-state formulas as the report's notes print them: per ZeRO stage in mixed precision and in fp32,
    and per torch engine."""
    stages = {kind: ", ".join(f"{stage}: {zero_formula(stage, kind)}" for stage in sorted(STATE_FORMULAS[kind]))
              for kind in STATE_FORMULAS}
    torch_engines = {name: short_formula(spec.state_formula)
                     for name, spec in ENGINE_SPECS.items() if spec.state_formula}
    return {**stages, **torch_engines}


def scaling_flags(scaling: list[dict], cell: str) -> list[str]:
    """The physical checks' flags of a cell's row in the scaling table (none when it has no row)."""
    return next((r["flags"] for r in scaling if r["cell"] == cell), [])


UNTRUSTED_VERDICT = "this run's figure failed a physical check: it neither supports nor refutes the claim"


def check_claims(frames: ReportFrames) -> list[dict]:
    """Rows: claim, claimed figures, what physics allows (7B on 24 GB cards), what this run measured, verdict. A row
    whose measured figure failed a physical check (its `flags`) quotes it as not trustworthy, and its verdict says
    that figure decides nothing."""
    scaling, memory = records(frames.scaling), records(frames.memory)
    rows = [
        claim_one_gpu(scaling),
        claim_three_gpu_memory(memory),
        claim_three_gpu_speedup(scaling),
        claim_zero2_memory_cut(memory),
        claim_nccl_vs_gloo(records(frames.backends), frames.device),
        claim_epoch_time(scaling, frames.target_corpus_tokens),
        claim_eight_nodes(records(frames.communication)),
    ]
    return [{**row, "verdict": f"{row['verdict']}; {UNTRUSTED_VERDICT}"} if row["flags"] else row for row in rows]


def claim_one_gpu(scaling: list[dict]) -> dict:
    """Row 1: the 1-GPU column's throughput and memory."""
    one = CLAIMS["one_gpu"]
    need, fits, _ = _mem(articles_run(1, 0))
    need_off, fits_off, text_off = _mem(articles_run(1, 2, offload=True))
    share = _flops_share(one["tokens_per_s"], 1)
    base = [format_row(r, SCALING_COLUMNS) for r in scaling if r["ranks"] == 1]
    return {
        "claim": "1 GPU: throughput and memory",
        "claimed": f"{fmt(one['tokens_per_s'])} tokens/s at {fmt(one['memory_gb'])} GB, batch {one['batch']}",
        "physics": (f"7B, fp16, no offload: {fmt(need)} GiB needed vs {SETUP['gpu_memory_gib']} GiB; with ZeRO-2 "
                    f"optimizer offload: {text_off}. Compute: {fmt(share * 100)}% of the {SETUP['gpu']}'s "
                    f"{GPU_PEAK_TFLOPS_16BIT[SETUP['gpu']]} TFLOP/s peak"),
        "measured": "; ".join(untrusted(f"{r['series']}: {r['tokens_per_s']} tokens/s, {r['mem_gib']} GiB",
                                        scaling_flags(scaling, r["cell"])) for r in base)
        or "no 1-rank cell ran",
        "flags": [flag for r in base for flag in scaling_flags(scaling, r["cell"])],
        "verdict": ("memory impossible without offload" if not fits else "possible")
        + ("; possible only with optimizer offload" if fits_off and not fits else "")
        + ("; compute plausible" if share < 0.6 else "; compute implausible"),
    }


def claim_three_gpu_memory(memory: list[dict]) -> dict:
    """Row 2: the 3-GPU ZeRO-2 column's memory per GPU."""
    three = CLAIMS["three_gpus"]
    need3, _, _ = _mem(articles_run(3, 2))
    need3_off, _, _ = _mem(articles_run(3, 2, offload=True))
    zero2 = [format_row(r, MEMORY_COLUMNS) for r in memory if r["zero_stage"] == 2]
    return {
        "claim": "3 GPUs, ZeRO-2: memory per GPU",
        "claimed": f"{fmt(three['memory_gb'])} GB per GPU",
        "physics": (f"ZeRO-2 ({zero_formula(2)}): {fmt(need3)} GiB per GPU; with optimizer offload "
                    f"{fmt(need3_off)} GiB (16-bit parameters stay replicated)"),
        "measured": "; ".join(f"{r['cell']}: {r['measured_gib']} GiB (predicted {r['predicted_gib']})"
                              for r in zero2) or "no ZeRO-2 cell ran",
        "flags": [],  # peak memory: what the run allocated, whatever else ran beside it
        "verdict": ("below what ZeRO-2 can reach for 7B even with offload"
                    if three["memory_gb"] < min(need3, need3_off) else "possible"),
    }


def claim_three_gpu_speedup(scaling: list[dict]) -> dict:
    """Row 3: the 3-GPU ZeRO-2 column's throughput against the 1-GPU column's."""
    one, three = CLAIMS["one_gpu"], CLAIMS["three_gpus"]
    _, fits3, _ = _mem(articles_run(3, 2))
    _, fits3_off, _ = _mem(articles_run(3, 2, offload=True))
    deepspeed = [r for r in scaling if r["speedup"] and engine_spec(r["engine"]).zero_partitioned]
    largest = max(deepspeed, key=lambda r: (r["ranks"], r["speedup"]), default=None)
    shown = format_row(largest, SCALING_COLUMNS) if largest else None
    claimed_eff = three["speedup"] / three["gpus"]
    return {
        "claim": "3 GPUs, ZeRO-2: speedup",
        "claimed": f"{fmt(three['tokens_per_s'])} tokens/s, {fmt(three['speedup'])}× "
                   f"({fmt(claimed_eff * 100, 0)}% efficiency; {fmt(three['tokens_per_s'] / one['tokens_per_s'], 2)}"
                   f"× from the two throughputs)",
        "physics": f"at most {three['gpus']}× (weak scaling: batch {one['batch']} → {three['batch']}); "
                   f"{fmt(_flops_share(three['tokens_per_s'], 3) * 100)}% of peak per GPU",
        "measured": untrusted(f"{shown['series']}: {shown['speedup']} on {shown['ranks']} ranks "
                              f"({shown['efficiency_pct']}% efficiency; {shown['speedup_best']} over the fastest "
                              f"1-rank cell, {largest['best_cell']})", largest["flags"])
        if shown else "no 1-rank baseline ran",
        "flags": largest["flags"] if shown else [],
        "verdict": ("ZeRO-2 as described does not fit (row 2): this throughput cannot come from that setup"
                    + (" unless the optimizer was offloaded, which the articles do not mention" if fits3_off else "")
                    if not fits3 else "plausible"),
    }


def claim_zero2_memory_cut(memory: list[dict]) -> dict:
    """Row 4: 'ZeRO-2 cut per-card memory by 20%', against the model states and this run's ZeRO-2 cells."""
    one, three = CLAIMS["one_gpu"], CLAIMS["three_gpus"]
    _, fits, _ = _mem(articles_run(1, 0))
    states_1 = _states(model_state_bytes(articles_run(1, 0).parameters, 1, 0, "fp16"))
    states_3 = _states(model_state_bytes(articles_run(3, 2).parameters, 3, 2, "fp16"))
    cut = 1 - states_3 / states_1
    claimed_cut = 1 - three["memory_gb"] / one["memory_gb"]
    zero2 = {r["ranks"]: r for r in memory if r["zero_stage"] == 2}
    top = zero2[max(zero2)] if zero2 else None
    measured_cut = ((1 - top["measured_bytes"] / zero2[1]["measured_bytes"]) if 1 in zero2 and top["ranks"] != 1
                    else None)
    return {
        "claim": "ZeRO-2 cuts per-card memory",
        "claimed": f"{fmt(CLAIMS['zero2_memory_cut']['cut_pct'])}% "
                   f"({fmt(one['memory_gb'])} → {fmt(three['memory_gb'])} GB is {fmt(claimed_cut * 100)}%)",
        "physics": f"model states {zero_formula(0)} → {zero_formula(2, ranks=three['gpus'])}: {fmt(cut * 100)}% less "
                   f"(activations unchanged)",
        "measured": (f"ZeRO-2, 1 → {top['ranks']} ranks: peak per rank {round(-measured_cut * 100, 1) + 0.0:+,.1f}% "
                     f"({format_row(zero2[1], MEMORY_COLUMNS)['measured_gib']} → "
                     f"{format_row(top, MEMORY_COLUMNS)['measured_gib']} GiB)"
                     if measured_cut is not None else "needs ZeRO-2 cells at 1 and N ranks"),
        "flags": [],  # peak memory, as row 2
        "verdict": (f"the model predicts a {'larger' if cut > claimed_cut else 'smaller'} cut of model states"
                    + ("; the 1-GPU starting point is itself impossible (row 1)" if not fits else "")),
    }


def claim_nccl_vs_gloo(backends: list[dict], device: str) -> dict:
    """Row 5: 'NCCL is 30% faster than Gloo', against the cells that ran with both backends."""
    nccl = CLAIMS["nccl_vs_gloo"]["nccl_faster_pct"]
    here = f"this run ({device})"
    shown = [format_row(r, BACKEND_COLUMNS) for r in backends]
    return {
        "claim": "NCCL vs Gloo",
        "claimed": f"NCCL {fmt(nccl)}% faster",
        "physics": "NCCL runs collectives on the GPUs, directly between them over NVLink or PCIe P2P where the "
                   "cards have it (RTX 4090s do not: NCCL then stages through host memory too); Gloo always stages "
                   "through host memory and reduces on the CPU — the gap grows with the bytes per step",
        "measured": "; ".join(untrusted(f"{r['ranks']} ranks ZeRO-{r['zero_stage']}: NCCL {r['nccl_faster_pct']}% "
                                        "faster", row["flags"]) for r, row in zip(shown, backends))
        or f"not measured: no cell ran with both backends on {here}",
        "flags": [flag for row in backends for flag in row["flags"]],
        "verdict": "measured here" if backends else "not testable on this machine",
    }


def claim_epoch_time(scaling: list[dict], target_corpus_tokens: float) -> dict:
    """Row 6: the days per epoch, against the claimed throughput and report.target_corpus_tokens."""
    one, three = CLAIMS["one_gpu"], CLAIMS["three_gpus"]
    implied = one["tokens_per_s"] * one["epoch_days"] * 86400
    widest = max((r["ranks"] for r in scaling), default=None)
    shown = [format_row(r, SCALING_COLUMNS) for r in scaling if r["ranks"] in (1, widest)]
    return {
        "claim": "time per epoch",
        "claimed": f"{fmt(one['epoch_days'])} days on 1 GPU, {fmt(three['epoch_days'])} days on 3, "
                   f"for a {SETUP['corpus']}",
        "physics": (f"{fmt(one['epoch_days'])} days at {fmt(one['tokens_per_s'])} tokens/s is {fmt(implied)} tokens; "
                    f"an epoch of {fmt(target_corpus_tokens)} tokens (report.target_corpus_tokens) at that rate takes "
                    f"{fmt_duration(target_corpus_tokens / one['tokens_per_s'])}"),
        "measured": "; ".join(untrusted(f"{r['cell']}: {r['epoch']} (extrapolated)",
                                        scaling_flags(scaling, r["cell"])) for r in shown) or "no cell ran",
        "flags": [flag for r in shown for flag in scaling_flags(scaling, r["cell"])],
        "verdict": f"inconsistent with the claimed throughput by {fmt(target_corpus_tokens / implied, 0)}×",
    }


def claim_eight_nodes(comms: list[dict]) -> dict:
    """Row 7: the 8-server article (DDP, 70B), against the model states and this run's communication share."""
    eight = CLAIMS["eight_nodes"]
    # DDP keeps fp32 parameters, fp32 gradients and AdamW's moments on every card (torch_state_bytes)
    ddp = _states(torch_state_bytes(int(eight["parameters"]), eight["nodes"], eight["train_engine"]))
    zero3 = _states(model_state_bytes(int(eight["parameters"]), eight["nodes"], 3, "fp16"))
    budget = eight["gpu_memory_gib"] * GIB
    # the claim is about DDP: its cells' communication share when any ran, else the widest cell's
    ddp_comms = [r for r in comms if r["engine"] == eight["train_engine"]]
    comm_top = max(ddp_comms or comms, key=lambda r: r["ranks"], default=None)
    shown = format_row(comm_top, COMMUNICATION_COLUMNS) if comm_top else None
    return {
        "claim": f"{eight['nodes']} × {eight['gpu']}, {eight['engine']}, 70B",
        "claimed": f"{fmt(eight['tokens_per_s'][0])} → {fmt(eight['tokens_per_s'][1])} tokens/s "
                   f"({fmt(eight['speedup'])}×), {fmt(eight['comm_pct'])}% communication, 4 → 8 cards "
                   f"{fmt(eight['scale_4_to_8'])}×",
        "physics": (f"DDP replicates the model states "
                    f"({short_formula(engine_spec(eight['train_engine']).state_formula)}: fp32 params, fp32 grads, "
                    f"AdamW moments): {fmt(ddp / GIB, 0)} GiB per GPU; even ZeRO-3 over "
                    f"{eight['nodes']}: {fmt(zero3 / GIB, 0)} GiB vs {eight['gpu_memory_gib']} GiB"),
        "measured": (untrusted(f"communication share at {shown['ranks']} ranks ({shown['cell']}): "
                               f"{shown['comm_pct']}%", comm_top["flags"]) if shown else "no multi-rank cell ran"),
        "flags": comm_top["flags"] if shown else [],
        "verdict": ("impossible as described" if ddp > budget else "possible")
        + ("; impossible with any ZeRO stage without offload" if zero3 > budget else ""),
    }
