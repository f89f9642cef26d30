"""The report's tables recomputed from synthetic summaries, the claims computed (never typed), the files valid."""
import json
import re
import statistics
from pathlib import Path

import pytest

from pretrain_bench.report import claims
from pretrain_bench.report.render import (
    GIB,
    build_report,
    build_tables,
    fmt,
)
from pretrain_bench.report.tables import fmt_duration, spread
from pretrain_bench.train.metrics import OTHER_CPU_METHOD
from pretrain_bench.train.run_summary import SUMMARY_VERSION, RunSummary, SummaryError

ROOT = Path(__file__).resolve().parents[2]

PNG = b"\x89PNG\r\n\x1a\n"


def summary(ranks=1, zero=2, tokens_per_s=1000.0, mem_gib=1.0, comm=None, mfu=0.2, backend="gloo", device="cpu"):
    """A summary.json as Trainer.summarise writes it (a dict: what the file holds)."""
    return {
        "version": SUMMARY_VERSION, "name": "unit", "role": "bench", "engine": "deepspeed", "world_size": ranks,
        "nodes": 1, "device": device, "zero_stage": zero, "offload_optimizer": "none", "offload_param": "none",
        "precision": "fp32", "precision_note": None, "comm_backend": backend, "micro_batch_size": 8,
        "grad_accum_steps": 1,
        "global_batch_size": 8 * ranks, "seq_len": 128, "deepspeed_overrides": {}, "steps": 8,
        "tokens_per_step": 1024 * ranks,
        "tokens": 8192 * ranks, "tokens_per_s": tokens_per_s,
        "step_time_s": {"median": 1024 * ranks / tokens_per_s, "min": 0.1, "max": 2.0, "mean": 1.0},
        "phase_time_s": {"forward": 0.1, "backward": 0.2, "optimizer": 0.05}, "steady_steps": 6,
        "warmup_timing_steps": 2, "peak_mem_bytes": [int(mem_gib * GIB) - i * 1000 for i in range(ranks)],
        "peak_mem_allocated_bytes": None, "peak_mem_kind": "peak RSS of the rank process (getrusage)",
        "model": {"preset": "tiny", "parameters": 2_557_632, "non_embedding_parameters": 1_771_200,
                  "matmul_parameters": 1_771_200, "layers": 4, "hidden_size": 192, "heads": 6, "vocab_size": 4096,
                  "attn_implementation": "sdpa"},
        "flops_per_token": 1.2e7, "flops_formula": "6N + 12*L*H*Q*T", "peak_flops_per_rank": 5e10,
        "peak_flops_source": "measured: test", "mfu": mfu, "mfu_note": None,
        "comm_fraction": comm if ranks > 1 else None,
        "comm_method": "test comms", "expert_parallel": 1, "all_to_all_fraction": None,
        "loss": {"first": 8.0, "last": 6.0, "min": 5.9}, "skipped_steps": 0,
        "oversubscribed": ranks > 2, "threads_per_rank": 1, "resumed_from_step": None,
        "memory_fit": {"mode": "strict", "asked": "ZeRO-2", "chosen": "ZeRO-2", "changed": False,
                       "summary": "fits as asked"},
        "checkpoints": [4, 8], "checkpoint_dir": "x", "init_from": None, "init_seed": 1234, "lr_schedule": "cosine",
        "compile": None,
        "eval_during_training": None,
        "provenance": {"git_commit": "abc123", "config_sha256": "f" * 64, "versions": {"torch": "2.13.0"},
                       "hardware": {"device": device, "cpu_count": 2, "processor": "test"}, "slurm_job_id": None,
                       "load_before": [0.5, 0.5, 0.5], "load_after": [0.5, 0.5, 0.5], "other_cpu": other_cpu(1.0)},
    }


def other_cpu(share_pct: float, cores: int = 2, wall_s: float = 10.0) -> dict:
    """summary.json provenance `other_cpu` (metrics.OtherCpu) of a loop in which other processes used `share_pct` %
    of `cores` cores."""
    others = share_pct / 100 * cores * wall_s
    return {"share_pct": share_pct, "cpus": list(range(cores)), "wall_s": wall_s, "busy_cpu_s": others + 5.0,
            "job_cpu_s": 5.0, "method": OTHER_CPU_METHOD}


def typed(*args, **kwargs) -> RunSummary:
    """`summary(...)` as the report reads it."""
    return RunSummary.from_dict(summary(*args, **kwargs))


def entry(ranks, zero, backend="gloo", status="run", reason=None):
    est = {"params": 100, "grads": 100, "optimizer": 100, "activations": 50, "buffers": 10, "runtime": 600,
           "init": 0, "host_states": 0, "state_formula": "4Ψ + 16Ψ/N", "buffer_formula": "b",
           "model_states": 300, "per_rank": 960}
    return {"cell": f"ranks{ranks}-zero{zero}-fp32-{backend}", "engine": "deepspeed", "gpus": ranks, "zero_stage": zero,
            "precision": "fp32", "comm_backend": backend, "micro_batch_size": 8, "offload_optimizer": "none",
            "status": status, "reason": reason, "forced": False, "origin": "declared",
            "estimate": est if status == "run" else None,
            "time_estimate": {"min_step_time_s": 0.01, "min_cell_time_s": 0.08} if status == "run" else None}


MATRIX = {
    "device": "cpu", "steps": 8, "warmup_steps": 2, "repeats": 2, "force": False, "allow_concurrent": False,
    "budget": {"device": "cpu", "device_bytes": 16 * GIB, "device_source": "test", "host_bytes": 16 * GIB,
               "host_source": "test", "gpu_count": None},
    "peak": {"device": "cpu", "peak_flops": 1.5e11, "peak_source": "measured: test", "hardware": {"cpu_count": 2}},
    "cells": [entry(1, 2), entry(2, 2), entry(3, 2), entry(1, 1),
              entry(2, 2, "nccl", "unsupported", "comm_backend nccl needs CUDA GPUs"),
              entry(3, 1, "gloo", "predicted_oom",
                    "predicted OOM: needs 40.0 GiB (3 ranks × 13.3 GiB), has 16.0 GiB")],
}
RUNS = {
    "ranks1-zero2-fp32-gloo": [typed(1, tokens_per_s=1000, mem_gib=0.8), typed(1, tokens_per_s=1100, mem_gib=0.9)],
    "ranks2-zero2-fp32-gloo": [typed(2, tokens_per_s=1500, comm=0.3), typed(2, tokens_per_s=1700, comm=0.4)],
    "ranks3-zero2-fp32-gloo": [typed(3, tokens_per_s=1800, comm=0.5), typed(3, tokens_per_s=2000, comm=0.45)],
    "ranks1-zero1-fp32-gloo": [typed(1, zero=1, tokens_per_s=900), typed(1, zero=1, tokens_per_s=950)],
}


def test_seeds_table_equals_a_recomputation():
    tables = build_tables(typed(3), [], 1e12, MATRIX, RUNS)
    rows = {r["cell"]: r for r in tables["scaling"]}
    assert set(rows) == set(RUNS)
    base = statistics.median([1000, 1100])
    for ranks, tps in ((2, [1500, 1700]), (3, [1800, 2000])):
        row = rows[f"ranks{ranks}-zero2-fp32-gloo"]
        med = statistics.median(tps)
        assert row["tokens_per_s"] == f"{fmt(med, 0)} ({fmt(min(tps), 0)}–{fmt(max(tps), 0)})"
        assert row["speedup"] == f"{fmt(med / base, 2)}×"
        assert row["efficiency_pct"] == fmt(med / base / ranks * 100, 0)
        assert row["epoch"] == fmt_duration(1e12 / med)
        mem = [max(s.peak_mem_bytes) for s in RUNS[row["cell"]]]
        assert row["mem_gib"] == spread(mem, 2, 1 / GIB)
    assert rows["ranks1-zero1-fp32-gloo"]["speedup"] == "1.00×"  # its own baseline: a separate series
    assert rows["ranks3-zero2-fp32-gloo"]["oversubscribed"] == "yes"
    assert tables["headline"]["noisy"] == {} and tables["headline"]["superlinear"] == []
    assert tables["headline"]["lines"][0] == (f"ZeRO-2, fp32, gloo, micro batch 8: 1 → 3 ranks, {fmt(base, 0)} → "
                                              f"{fmt(1900.0, 0)} tokens/s ({fmt(1900 / base, 2)}×, "
                                              f"{fmt(1900 / base / 3 * 100, 0)}% scaling efficiency over its "
                                              "1-rank cell)")
    assert "1 cell(s): comm_backend nccl needs CUDA GPUs" in tables["headline"]["lines"][-1]


def test_noisy_and_superlinear_timings_are_flagged():
    runs = {**RUNS, "ranks1-zero2-fp32-gloo": [typed(1, tokens_per_s=300), typed(1, tokens_per_s=1000)],
            "ranks2-zero2-fp32-gloo": [typed(2, tokens_per_s=1500, comm=0.3), typed(2, tokens_per_s=1520, comm=0.3)]}
    headline = build_tables(typed(3), [], 1e12, MATRIX, runs)["headline"]
    assert headline["noisy"] == {"ranks1-zero2-fp32-gloo": pytest.approx(700 / 650)}
    assert "ranks2-zero2-fp32-gloo" in headline["superlinear"]  # 1510 / 650 / 2 ranks = 116%


def test_matrix_memory_communication_and_mfu_tables():
    tables = build_tables(typed(3), [], 1e12, MATRIX, RUNS)
    status = {r["cell"]: r for r in tables["matrix"]}
    assert status["ranks2-zero2-fp32-nccl"]["status"] == "left out: not supported here"
    assert status["ranks3-zero1-fp32-gloo"]["status"] == "predicted OOM"
    assert status["ranks3-zero1-fp32-gloo"]["reason"].startswith("predicted OOM: needs 40.0 GiB")
    assert status["ranks3-zero1-fp32-gloo"]["repeats"] == "0"
    memory = {r["cell"]: r for r in tables["memory"]}
    # CPU: peak RSS counts everything, so the prediction compared is the whole per-rank figure
    assert memory["ranks2-zero2-fp32-gloo"]["predicted_gib"] == fmt(960 / GIB, 3)
    comm = {r["cell"]: r for r in tables["communication"]}
    assert "ranks1-zero2-fp32-gloo" not in comm
    assert comm["ranks3-zero2-fp32-gloo"]["comm_pct"] == f"{fmt(47.5)} ({fmt(45.0)}–{fmt(50.0)})"
    assert tables["backends"] == []  # no cell ran with both backends
    mfu = {r["cell"]: r for r in tables["mfu"]}
    assert mfu["ranks2-zero2-fp32-gloo"]["mfu_pct"] == f"{fmt(20.0, 2)} ({fmt(20.0, 2)}–{fmt(20.0, 2)})"
    prov = tables["provenance"]["bench"]
    assert prov["files"] == 8 and prov["git_commit"] == "abc123" and prov["oversubscribed"] == "2 of 8 runs"


def test_claims_are_computed_from_the_claims_data(monkeypatch):
    rows = build_tables(typed(3), [], 1e12, MATRIX, RUNS)["claims"]
    by_claim = {r["claim"]: r for r in rows}
    one = by_claim["1 GPU: throughput and memory"]
    assert fmt(claims.CLAIMS["one_gpu"]["tokens_per_s"]) in one["claimed"]
    assert "memory impossible without offload" in one["verdict"]
    assert "below what ZeRO-2 can reach" in by_claim["3 GPUs, ZeRO-2: memory per GPU"]["verdict"]
    assert "not testable" in by_claim["NCCL vs Gloo"]["verdict"]
    assert "impossible as described" in by_claim["8 × RTX 4090 D, DDP, 70B"]["verdict"]
    # change a claimed figure: the row follows, so nothing is typed into the report by hand
    monkeypatch.setitem(claims.CLAIMS, "one_gpu", {**claims.CLAIMS["one_gpu"], "tokens_per_s": 4321})
    again = {r["claim"]: r for r in build_tables(typed(3), [], 1e12, MATRIX, RUNS)["claims"]}
    assert "4,321 tokens/s" in again["1 GPU: throughput and memory"]["claimed"]


def test_templates_type_no_claimed_figure():
    text = "".join(p.read_text() for p in (ROOT / "workflow_scripts/pretrain_bench/report/templates").glob("*.j2"))
    for figure in ("1,200", "1200", "3,400", "3400", "2.8", "22 GB", "18 GB", "30%", "14 days", "3,584"):
        assert figure not in text


def test_report_files_render_from_json(tmp_path):
    main = summary(3)
    (tmp_path / "summary.json").write_text(json.dumps(main))
    metrics = [{"step": s, "loss": 8 - s * 0.1, "tokens_per_s": 900 + s, "step_time_s": 1.0,
                "after_resume": False} for s in range(1, 9)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    evals = []
    for step in (4, 8):
        path = tmp_path / f"step{step}.json"
        path.write_text(json.dumps({"step": step, "train_tokens": step * 3072, "loss": 7.0 - step / 10,
                                    "perplexity": 900.0 / step, "bits_per_byte": 3.0 - step / 100, "tokens": 4096,
                                    "eval_tokens_per_s": 5000.0, "generations": [
                                        {"prompt": "def f(x):\n", "mode": "greedy", "text": "return x | 1\n"},
                                        {"prompt": "def f(x):\n", "mode": "sampled", "text": "<b>pass</b>"}]}))
        evals.append(path)
    (tmp_path / "matrix.json").write_text(json.dumps(MATRIX))
    bench = write_bench(tmp_path, RUNS)
    lm_eval = []
    for step, acc in ((4, 0.25), (8, 0.5)):  # lm_eval/step<N>.json as harness.run_harness writes it
        path = tmp_path / f"lm_eval-step{step}.json"
        path.write_text(json.dumps({"step": step, "samples": {"last_word": 8}, "tasks": {"last_word": {
            "name": "last_word", "sample_len": 8, "acc": acc, "acc_stderr": 0.125, "perplexity": 90.0 / step,
            "perplexity_stderr": None}}}))
        lm_eval.append(path)
    out = tmp_path / "report"
    tables = build_report(tmp_path / "summary.json", tmp_path / "metrics.jsonl", evals, out / "report.md",
                          out / "report.html", out / "plots", target_corpus_tokens=1e12,
                          matrix_path=tmp_path / "matrix.json", bench_paths=bench, lm_eval_paths=lm_eval)
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    # lm-eval's scores: every checkpoint × metric, with stderr where lm-eval gave one
    assert "| 4 | last_word | acc | 0.2500 | 0.1250 | 8 |" in md
    assert "| 8 | last_word | acc | 0.5000 | 0.1250 | 8 |" in md
    assert "| 8 | last_word | perplexity | 11.2500 | n/a | 8 |" in md
    assert "<td>8</td><td class=\"text\">last_word</td><td class=\"text\">acc</td><td>0.5000</td>" in html
    assert len(tables["lm_eval"]) == 4
    for row in tables["scaling"]:
        assert f"| {row['tokens_per_s']} | {row['speedup']} | {row['efficiency_pct']} |" in md
        assert f"<td>{row['tokens_per_s']}</td><td>{row['speedup']}</td>" in html
    assert "predicted OOM: needs 40.0 GiB" in md and "predicted OOM: needs 40.0 GiB" in html
    assert "` return x \\| 1⏎ `" in md  # a pipe or a line break in a generation does not break the table
    assert "&lt;b&gt;pass&lt;/b&gt;" in html and "<b>pass</b>" not in html
    assert "extrapolated" in md and "predicted" in md and "Oversubscribed" in md
    assert md.count("Provenance:") >= 6
    for name in ("throughput", "loss", "eval", "scaling", "memory", "communication"):
        assert (out / "plots" / f"{name}.png").read_bytes()[:8] == PNG
        assert f"](plots/{name}.png)" in md
    assert html.count("data:image/png;base64,") == 6
    assert not re.search(r"""(src|href)=["'](?!data:)""", html), "the HTML loads nothing from outside"


def test_no_benchmark_cell_still_renders(tmp_path):
    tables = build_tables(typed(3), [], 1e12, {**MATRIX, "cells": [MATRIX["cells"][-1]]}, {})
    assert tables["scaling"] == [] and tables["memory"] == [] and tables["provenance"]["bench"] is None
    assert {r["claim"] for r in tables["claims"]} >= {"NCCL vs Gloo", "time per epoch"}


@pytest.mark.parametrize("seconds,text", [(45, "45.0 s"), (90, "1.5 min"), (7200, "2.0 h"), (86400 * 5, "5.0 days"),
                                          (86400 * 365.25 * 26, "26.0 years")])
def test_durations_read_naturally(seconds, text):
    assert fmt_duration(seconds) == text


def test_an_mfu_above_100_percent_is_refused_with_the_reason():
    from pretrain_bench.report.tables import mfu_text
    from pretrain_bench.train.models.flops import model_flops_utilisation

    # a 1-rank run measured at 47.5 GFLOP/s of peak that achieved 80 GFLOP/s: 169 %, impossible
    mfu, note = model_flops_utilisation(8000.0, 1e7, 47.5e9, 1, "measured: 512² matmul")
    assert mfu is None and "MFU would be 168%" in note and "not reported" in note
    assert model_flops_utilisation(1000.0, 1e7, 47.5e9, 1, "x") == (pytest.approx(1e10 / 47.5e9), None)
    # the report says why instead of printing a figure; a summary holding 169 % is refused, never printed
    assert mfu_text([RunSummary.from_dict(summary(mfu=None) | {"mfu_note": note})]) == "not reported: " + note
    with pytest.raises(SummaryError, match="mfu 1.69 is above 1"):
        RunSummary.from_dict(summary(mfu=1.69))
    assert mfu_text([typed(mfu=0.2)]) == fmt(20.0, 2)


def test_report_says_where_the_weights_came_from_and_what_validation_took(tmp_path):
    main = {**summary(1), "memory_fit": None,
            "init_from": {"uri": "hf://org/base@v2", "revision": "abc123", "path": "/cache/abc123"},
            "eval_during_training": {"every": 4, "samples": 12, "tokens": 1536, "evaluations": 2, "time_s": 95.0,
                                     "last": {"step": 8, "loss": 2.5, "perplexity": 12.18}}}
    (tmp_path / "summary.json").write_text(json.dumps(main))
    metrics = [{"step": s, "loss": 8 - s * 0.1, "tokens_per_s": 900.0, "step_time_s": 1.0, "after_resume": False,
                **({"val_loss": 3.0 - s / 8, "val_perplexity": 20.0 - s, "eval_time_s": 47.5} if s % 4 == 0 else {})}
               for s in range(1, 9)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    evals = [tmp_path / "step8.json"]
    evals[0].write_text(json.dumps({"step": 8, "train_tokens": 8 * 3072, "loss": 2.6, "perplexity": 13.5,
                                    "bits_per_byte": 1.1, "tokens": 4096, "eval_tokens_per_s": 5000.0,
                                    "generations": []}))
    out = tmp_path / "report"
    build_report(tmp_path / "summary.json", tmp_path / "metrics.jsonl", evals, out / "report.md", out / "report.html",
                 out / "plots", target_corpus_tokens=1e12)
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    for text in (md, html):
        assert "Weights of the main run: continued from hf://org/base@v2 (model.init_from, revision abc123" in text
        assert "2 evaluation(s) on a fixed slice of 12 val samples" in text and "held-out loss 2.5000" in text
        assert "Evaluation took 1.6 min of wall time in all, kept out of the step timings" in text
    (tmp_path / "summary.json").write_text(json.dumps({**summary(1), "memory_fit": None, "init_seed": 7}))
    build_report(tmp_path / "summary.json", tmp_path / "metrics.jsonl", evals, out / "report.md", out / "report.html",
                 out / "plots", target_corpus_tokens=1e12)
    md = (out / "report.md").read_text()
    assert "Weights of the main run: random initialisation (train.seed 7)" in md and "Validation while" not in md


def test_a_summary_of_another_version_or_layout_is_refused_with_the_command_that_rewrites_it(tmp_path):
    run = tmp_path / "results" / "my-run"
    path = run / "bench" / "ranks1-zero2-fp32-gloo" / "rep1" / "summary.json"
    path.parent.mkdir(parents=True)
    older = {key: value for key, value in summary(1).items() if key not in ("version", "engine")}
    for data, problem in ((older, "it is version None"), ({**summary(1), "version": SUMMARY_VERSION + 1},
                                                          f"version {SUMMARY_VERSION + 1}"),
                          ({**summary(1), "tps": 1.0}, "unknown ['tps']")):
        path.write_text(json.dumps(data))
        with pytest.raises(SummaryError) as refused:
            RunSummary.read(path)
        assert str(path) in str(refused.value) and problem in str(refused.value)
        assert ("snakemake --cores all --configfile <its config files> --config name=my-run --forcerun bench_cell "
                "-- results/my-run/bench/ranks1-zero2-fp32-gloo/rep1/summary.json") in str(refused.value)
    main = run / "train" / "summary.json"
    main.parent.mkdir()
    main.write_text(json.dumps(older))
    with pytest.raises(SummaryError, match="missing|version None") as refused:
        build_report(main, tmp_path / "metrics.jsonl", [], tmp_path / "r.md", tmp_path / "r.html",
                     tmp_path / "plots", target_corpus_tokens=1e12)
    assert "--config name=my-run --forcerun pretrain -- results/my-run/train/summary.json" in str(refused.value)
    # what the trainer writes reads back as the same object, key for key
    assert RunSummary.from_dict(json.loads(json.dumps(summary(2)))).to_dict() == summary(2)


def test_the_frames_equal_a_recomputation_from_the_summaries():
    """Throughput, speedup, scaling efficiency, MFU, memory and communication: the report's numbers (its frames)
    recomputed here from each repeat's own figures, independently of the tables module."""
    from pretrain_bench.report.tables import report_frames

    peak, per_token = 5e10, 1.2e7
    speeds = {1: [1000.0, 1100.0, 1050.0], 2: [1500.0, 1700.0, 1650.0], 3: [1800.0, 2000.0, 1700.0]}
    runs = {f"ranks{ranks}-zero2-fp32-gloo": [typed(ranks, tokens_per_s=tps, mem_gib=0.5 + ranks / 4 + rep / 10,
                                                    comm=0.1 * rep + 0.05 * ranks,
                                                    mfu=tps * per_token / (ranks * peak))
                                              for rep, tps in enumerate(values)]
            for ranks, values in speeds.items()}
    frames = report_frames(typed(3), [], 1e12, MATRIX, runs)

    def recomputed(cell):
        summaries = runs[cell]
        ranks = summaries[0].world_size
        tokens_per_s = statistics.median(s.tokens_per_s for s in summaries)
        mfu = statistics.median(s.tokens_per_s * s.flops_per_token / (ranks * s.peak_flops_per_rank)
                                for s in summaries)
        worst_rank = statistics.median(max(s.peak_mem_bytes) for s in summaries)
        return ranks, tokens_per_s, mfu, worst_rank

    scaling = frames.scaling.set_index("cell")
    memory, mfu_table = frames.memory.set_index("cell"), frames.mfu.set_index("cell")
    communication = frames.communication.set_index("cell")
    _, base, _, _ = recomputed("ranks1-zero2-fp32-gloo")
    assert list(scaling.index) == list(runs)
    for cell in runs:
        ranks, tokens_per_s, mfu, worst_rank = recomputed(cell)
        assert scaling.at[cell, "tokens_per_s"] == pytest.approx(tokens_per_s, rel=1e-12)
        assert scaling.at[cell, "speedup"] == pytest.approx(tokens_per_s / base, rel=1e-12)
        assert scaling.at[cell, "efficiency_pct"] == pytest.approx(tokens_per_s / base / ranks * 100, rel=1e-12)
        assert scaling.at[cell, "epoch_s"] == pytest.approx(1e12 / tokens_per_s, rel=1e-12)
        assert statistics.median(mfu_table.at[cell, "mfu_values"]) == pytest.approx(mfu, rel=1e-12)
        assert memory.at[cell, "measured_bytes"] == pytest.approx(worst_rank, rel=1e-12)
        assert memory.at[cell, "ratio"] == pytest.approx(worst_rank / 960, rel=1e-12)  # CPU: the whole per_rank
        if ranks > 1:
            comm = statistics.median(s.comm_fraction for s in runs[cell])
            assert communication.at[cell, "comm_fraction"] == pytest.approx(comm, rel=1e-12)
    # the main run's row is its own summary's figures, and the epoch its tokens ÷ tokens/s
    main = frames.throughput.iloc[0]
    assert main["tokens_per_s"] == 1000.0 and main["ranks"] == 3 and main["mfu"] == 0.2
    assert frames.epoch_s == 1e12 / 1000.0
    # and the text the template prints is that frame, formatted once
    rows = {r["cell"]: r for r in build_tables(typed(3), [], 1e12, MATRIX, runs)["scaling"]}
    for cell in runs:
        assert rows[cell]["speedup"] == f"{fmt(scaling.at[cell, 'speedup'].item(), 2)}×"


def test_formula_text_comes_from_the_memory_model(monkeypatch):
    from pretrain_bench.train.memory import model as memory_model

    monkeypatch.setitem(memory_model.STATE_FORMULAS["mixed"], 2, "3Ψ + 13Ψ/N (a test's breakdown)")
    assert "2: 3Ψ + 13Ψ/N," in claims.formula_texts()["mixed"]
    by_claim = {r["claim"]: r for r in build_tables(typed(3), [], 1e12, MATRIX, RUNS)["claims"]}
    assert "ZeRO-2 (3Ψ + 13Ψ/N)" in by_claim["3 GPUs, ZeRO-2: memory per GPU"]["physics"]
    assert "model states 16Ψ → 3Ψ + 13Ψ/3" in by_claim["ZeRO-2 cuts per-card memory"]["physics"]
    template = (ROOT / "workflow_scripts/pretrain_bench/report/templates/report.j2").read_text()
    assert "14Ψ" not in template and "16Ψ/N" not in template  # the notes print formula_texts()


def busy(run: RunSummary, others_pct: float, load: tuple[float, float] = (1.0, 1.0),
         peak_source: str | None = None) -> RunSummary:
    """`run` as measured while processes outside it used `others_pct` % of its 2 cores, with the given 1-minute load
    before and after it (and, given, another peak source)."""
    data = run.to_dict()
    data["provenance"] = {**data["provenance"], "load_before": [load[0], 1.0, 1.0], "load_after": [load[1], 1.0, 1.0],
                          "other_cpu": other_cpu(others_pct)}
    if peak_source:
        data["peak_flops_source"] = peak_source
    return RunSummary.from_dict(data)


def test_an_impossible_figure_is_never_quoted_without_its_flag(tmp_path):
    """The issue's busy machine: a 1-rank cell at 223 tokens/s while other processes took 75 % of the 2 cores (a load
    of 7.97), 3 ranks at 2,757 (412 % efficiency) on a machine that was quiet by then, and a peak measured while
    something else ran. The 3 ranks' own load above the 2 cores (oversubscribed, and the cell before them still in
    the 1-minute average) flags nothing: only others' use of the cores does."""
    peak = {**MATRIX["peak"], "load_before": [7.97, 6.0, 5.0], "load_after": [8.1, 6.0, 5.0],
            "hardware": {"cpu_count": 2}, "other_cpu": other_cpu(80.0)}
    measured = "measured: test (rule measure_peak), shared by 1 CPU rank(s)"
    runs = {"ranks1-zero2-fp32-gloo": [busy(typed(1, tokens_per_s=223.0), 75.0, (7.97, 8.1), measured)] * 2,
            "ranks3-zero2-fp32-gloo": [busy(typed(3, tokens_per_s=2757.0, comm=0.3), 2.0, (7.5, 3.4), measured)] * 2}
    matrix = {**MATRIX, "cells": [entry(1, 2), entry(3, 2)]}
    tables = build_tables(busy(typed(3), 1.0, (0.2, 3.1), measured), [], 1e12, matrix, runs, peak=peak)
    line = tables["headline"]["lines"][0]
    assert line.startswith("Not trustworthy (failed a physical check): ZeRO-2") and "412% scaling efficiency" in line
    assert line.count("⚠ efficiency 412 % over its 1-rank cell ranks1-zero2-fp32-gloo is above 100 %: not "
                      "physical") == 1
    assert "over the fastest 1-rank cell ranks1-zero2-fp32-gloo is above" not in line  # the same cell: stated once
    assert line.count("⚠ ranks1-zero2-fp32-gloo, divided by: other processes used 75 % of the 2 cores") == 1
    assert tables["headline"]["superlinear"] == ["ranks3-zero2-fp32-gloo"]
    scaling = {r["cell"]: r for r in tables["scaling"]}
    assert scaling["ranks3-zero2-fp32-gloo"]["load"] == "; ".join(
        ["1-min 7.50 before, 3.40 after, other processes 2 % of the 2 cores"] * 2)
    # the 3-rank row's speedup divides by the busy 1-rank cell: it carries that cell's flag, not one of its own
    assert scaling["ranks3-zero2-fp32-gloo"]["flags"].count("other processes used 75 % of the 2 cores") == 1
    # the 1-rank cell: busy, and the baseline of an efficiency above 100 %
    assert scaling["ranks1-zero2-fp32-gloo"]["flags"] == (
        "other processes used 75 % of the 2 cores; slowed by something else: ranks3-zero2-fp32-gloo's scaling "
        "efficiency over it is 412 % (above 100 %)")
    claims_rows = {r["claim"]: r for r in tables["claims"]}
    for claim in ("1 GPU: throughput and memory", "3 GPUs, ZeRO-2: speedup", "time per epoch"):
        assert "other processes used 75 % of the 2 cores" in claims_rows[claim]["measured"], claim
        assert claims_rows[claim]["measured"].startswith("Not trustworthy (failed a physical check): "), claim
        assert claims_rows[claim]["verdict"].endswith("this run's figure failed a physical check: it neither "
                                                      "supports nor refutes the claim"), claim
    assert "⚠ efficiency 412 %" in claims_rows["3 GPUs, ZeRO-2: speedup"]["measured"]
    assert not claims_rows["3 GPUs, ZeRO-2: memory per GPU"]["flags"]  # memory: what the run allocated
    # no cell heads the recommendation: the 1-rank cell was busy, both took part in a 412 % efficiency, and both MFUs
    # divide by the peak measured while something else ran
    recommendation = tables["recommendation"]["sentence"]
    assert "fastest setup" not in recommendation and not tables["recommendation"]["trusted"]
    assert recommendation.startswith("No trustworthy measurement exists: every one of the 2 measured benchmark cell(s) "
                                     "failed a physical check")
    assert "peak measured while other processes used 80 % of the 2 cores, so this MFU is inflated" in recommendation
    assert tables["peak_flag"] and "⚠" not in tables["recommendation"]["main"]  # it quotes no MFU, others were idle
    assert tables["recommendation"]["main"].endswith("1,000 tokens/s (the main run, measured).")  # no "% of that"
    cost = {r["setup"]: r["flags"] for r in tables["cost"]["rows"]}  # the cost quotes tokens/s, no MFU
    one_rank = cost["ranks1-zero2-fp32-gloo"]
    assert one_rank.startswith("other processes used 75 % of the 2 cores")
    assert cost["ranks3-zero2-fp32-gloo"].startswith("efficiency 412 % over its 1-rank cell")
    assert cost["the main run"] == "—"
    # and the same figures, flags and all, in the rendered report
    (tmp_path / "summary.json").write_text(json.dumps(busy(typed(3), 1.0, (0.2, 3.1), measured).to_dict()))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 8.0, "tokens_per_s": 900.0,
                                                        "step_time_s": 1.0, "after_resume": False}) + "\n")
    (tmp_path / "matrix.json").write_text(json.dumps(matrix))
    (tmp_path / "peak.json").write_text(json.dumps(peak))
    bench = write_bench(tmp_path, runs)
    out = tmp_path / "report"
    build_report(tmp_path / "summary.json", tmp_path / "metrics.jsonl", [], out / "report.md", out / "report.html",
                 out / "plots", target_corpus_tokens=1e12, matrix_path=tmp_path / "matrix.json", bench_paths=bench,
                 peak_path=tmp_path / "peak.json")
    md = (out / "report.md").read_text()
    glance = md[md.index("**At a glance**"):md.index("## The benchmark matrix")]
    assert "412% scaling efficiency" in glance and "⚠ efficiency 412 %" in glance
    assert "- Not trustworthy (failed a physical check): ZeRO-2" in glance
    assert "divided by: other processes used" in glance
    top = md[:md.index("**At a glance**")]
    assert "fastest setup" not in top and "**No trustworthy measurement.** No trustworthy measurement exists" in top
    assert "peak measured while other processes used 80 %" in top
    assert "**Peak measured while something else ran**: peak measured while other processes used 80 % of the 2 " \
           "cores, so this MFU is inflated." in md
    assert "load 1-min 7.97 before, 8.10 after, other processes 80 % of the 2 cores during it" in md
    # the main run: quiet itself (its own 3 ranks above the cores flag nothing), but its MFU divides by that peak
    assert ("Load: 1-min 0.20 before, 3.10 after, other processes 1 % of the 2 cores during the training loop — peak "
            "measured while other processes used 80 % of the 2 cores, so this MFU is inflated.") in md
    assert "One figure for the machine, whatever precision a cell trains in (the faster of the CPU's fp32 and bf16 " \
           "matmuls)" in md


def test_the_recommendation_equals_a_recomputation_from_the_summaries():
    main = typed(3, tokens_per_s=1234.0)
    found = build_tables(main, [], 1e12, MATRIX, RUNS)["recommendation"]
    medians = {cell: statistics.median(s.tokens_per_s for s in reps) for cell, reps in RUNS.items()}
    best = max(medians, key=medians.get)
    reps = RUNS[best]
    tps = [s.tokens_per_s for s in reps]
    mem = [max(s.peak_mem_bytes) for s in reps]
    mfu = [s.mfu for s in reps]
    assert best == "ranks3-zero2-fp32-gloo"
    assert found["sentence"] == (
        f"On this hardware the fastest setup that fits is {best} (3 rank(s), DeepSpeed ZeRO-2, fp32, gloo, micro "
        f"batch 8 × 1 accumulation (global batch 24)): {spread(tps, 0)} tokens/s, {spread(mem, 2, 1 / GIB)} GiB per "
        f"rank, MFU {spread(mfu, 2, 100)} %, median (min–max) over 2 repeat(s).")
    assert found["main"] == ("Your configured run uses 3 rank(s), DeepSpeed ZeRO-2, fp32, gloo, micro batch 8 × 1 "
                             f"accumulation (global batch 24): {fmt(1234.0, 0)} tokens/s (the main run, measured), at "
                             f"{fmt(1234.0 / medians[best] * 100, 0)} % of that.")
    assert [r["cell"] for r in found["ranking"]] == sorted(medians, key=medians.get, reverse=True)


def test_the_cost_is_device_hours_times_the_price():
    price = {"amount": 2.5, "currency": "EUR"}
    target = 3e11
    rows = {r["setup"]: r for r in build_tables(typed(3, tokens_per_s=1500.0), [], target, MATRIX, RUNS,
                                                price=price)["cost"]["rows"]}
    # a CPU cell: its ranks share one machine, one machine-hour per hour
    cell = rows["ranks3-zero2-fp32-gloo"]
    hours = 1e9 / 1900.0 / 3600
    assert cell["unit"] == "machine-hours" and cell["devices"] == "1"
    assert cell["hours_per_billion"] == fmt(hours, 2) and cell["cost_per_billion"] == f"{fmt(hours * 2.5, 2)} EUR"
    assert cell["cost_per_epoch"] == f"{fmt(hours * 300 * 2.5, 2)} EUR"
    main = rows["the main run"]
    assert main["hours_per_epoch"] == fmt(target / 1500.0 / 3600, 0)
    # the articles' 3-GPU claim: 3 GPUs at their 3,400 tokens/s
    three = rows[f"3 × {claims.SETUP['gpu']}, ZeRO-2"]
    gpu_hours = 3 * 1e9 / claims.CLAIMS["three_gpus"]["tokens_per_s"] / 3600
    assert three["unit"] == "GPU-hours" and three["hours_per_billion"] == fmt(gpu_hours, 2)
    assert three["cost_per_billion"] == f"{fmt(gpu_hours * 2.5, 2)} EUR"
    assert "claimed by the source articles" in three["source"]
    # without a price: device-hours only
    unpriced = build_tables(typed(3), [], target, MATRIX, RUNS)["cost"]
    assert unpriced["price"] is None and all(r["cost_per_billion"] == "n/a" for r in unpriced["rows"])
    assert all(r["hours_per_billion"] != "n/a" for r in unpriced["rows"])


def test_the_dry_run_recommends_from_an_earlier_benchmark_of_the_same_hardware_and_model(tmp_path):
    from pretrain_bench.report.recommendation import previous_recommendation

    def write(name, cell, rep, run):
        path = tmp_path / name / "bench" / cell / f"rep{rep}" / "summary.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(run))

    for rep, tps in enumerate((1000.0, 1200.0), start=1):
        write("earlier", "ranks1-zero2-fp32-gloo", rep, summary(1, tokens_per_s=tps))
        write("earlier", "ranks3-zero2-fp32-gloo", rep, summary(3, tokens_per_s=tps + 500))
    other_machine = summary(3, tokens_per_s=9000.0)
    other_machine["provenance"]["hardware"] = {**other_machine["provenance"]["hardware"], "cpu_count": 64}
    write("elsewhere", "ranks3-zero2-fp32-gloo", 1, other_machine)
    other_model = summary(3, tokens_per_s=8000.0)
    other_model["model"] = {**other_model["model"], "parameters": 7_000_000_000}
    write("bigger", "ranks3-zero2-fp32-gloo", 1, other_model)
    here = {"device": "cpu", "cpu_count": 2, "processor": "test"}
    model = {"preset": "tiny", "parameters": 2_557_632, "vocab_size": 4096}
    found, names = previous_recommendation(tmp_path, here, model, 128)
    assert names == ["earlier"] and found["cell"] == "earlier/ranks3-zero2-fp32-gloo"
    assert found["sentence"].startswith("On this hardware the fastest setup that fits is "
                                        "earlier/ranks3-zero2-fp32-gloo")
    assert f"{fmt(1600.0, 0)} ({fmt(1500.0, 0)}–{fmt(1700.0, 0)}) tokens/s" in found["sentence"]
    assert previous_recommendation(tmp_path, {**here, "cpu_count": 8}, model, 128) is None
    assert previous_recommendation(tmp_path, here, model, 256) is None  # another sequence length


def test_numbers_read_by_magnitude():
    from pretrain_bench.core.formats import fmt_spread

    assert fmt(1_033_970_070.3378, 4) == "1.034e9" and fmt(12_412_313_741_367_280.0, 4) == "1.241e16"
    assert fmt(1e12, 0) == "1e12" and fmt(2_557_632) == "2.558e6" and fmt(-3.5e7, 1) == "-3.5e7"
    assert fmt(999_999.04, 1) == "999,999.0" and fmt(12_345) == "12,345" and fmt(0.0, 2) == "0.00"
    assert fmt(0.00004, 2) == "4e-5" and fmt(0.004, 2) == "4e-3" and fmt(0.006, 2) == "0.01"
    # a spread: one precision for its three numbers, at most 4 significant digits
    assert fmt_spread([12_345.6, 12_000.0, 13_000.0], 0) == "12,350 (12,000–13,000)"
    assert fmt_spread([2757.3, 2700.1], 1) == "2,729 (2,700–2,757)"
    assert fmt_spread([20.123, 19.5, 21.0], 2) == "20.12 (19.50–21.00)"
    assert fmt_spread([0.91234, 0.9], 3) == "0.906 (0.900–0.912)"
    assert fmt_spread([3.2e9, 3.1e9], 0) == "3.15e9 (3.1e9–3.2e9)"
    for text in (fmt_spread(v, d) for v, d in (([12_345.6, 9_999.9], 1), ([123.456, 99.9], 3), ([1.23456], 4))):
        for number in re.findall(r"[\d,.]+", text):
            digits = number.replace(",", "")
            digits = digits.replace(".", "") if "." in digits else digits.rstrip("0")  # 12,350: 4 significant
            assert len(digits.lstrip("0")) <= 4, text


def test_lm_eval_figures_and_babbling_generations_read_plainly(tmp_path):
    from pretrain_bench.report.tables import BABBLE_PERPLEXITY

    (tmp_path / "summary.json").write_text(json.dumps(summary(1)))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 8.0, "tokens_per_s": 900.0,
                                                        "step_time_s": 1.0, "after_resume": False}) + "\n")
    evals = []
    for step, perplexity in ((4, 580.0), (8, 12.5)):
        path = tmp_path / f"step{step}.json"
        path.write_text(json.dumps({"step": step, "train_tokens": step * 1024, "loss": 6.0, "perplexity": perplexity,
                                    "bits_per_byte": 2.0, "tokens": 4096, "eval_tokens_per_s": 5000.0,
                                    "generations": [{"prompt": "def f(x):\n", "mode": "greedy", "text": " , ,"}]}))
        evals.append(path)
    lm_eval = tmp_path / "lm_eval-step8.json"
    lm_eval.write_text(json.dumps({"step": 8, "samples": {"doc": 4}, "tasks": {"doc": {
        "name": "doc", "perplexity": 1_033_970_070.3378, "perplexity_stderr": 12_412_313_741_367_280.0}}}))
    out = tmp_path / "report"
    build_report(tmp_path / "summary.json", tmp_path / "metrics.jsonl", evals, out / "report.md", out / "report.html",
                 out / "plots", target_corpus_tokens=1e12, lm_eval_paths=[lm_eval])
    md = (out / "report.md").read_text()
    assert "| 8 | doc | perplexity | 1.034e9 | 1.241e16 | 4 |" in md
    assert "1,033,970,070" not in md and "12,412,313" not in md
    note = next(line for line in md.splitlines() if "No structure expected yet" in line)
    assert f"step 4 is at held-out perplexity 580.0, above {fmt(BABBLE_PERPLEXITY, 0)}" in note
    assert "step 8" not in note  # 12.5: structure may be expected
    assert "| 4 | 580.0 | ` def f(x):⏎ ` | `  , , ` |" in md


def test_a_backend_comparison_under_load_is_flagged_at_a_glance():
    matrix = {**MATRIX, "cells": [entry(2, 2, "nccl"), entry(2, 2, "gloo")]}
    runs = {"ranks2-zero2-fp32-nccl": [typed(2, tokens_per_s=1300.0, comm=0.2, backend="nccl")],
            "ranks2-zero2-fp32-gloo": [busy(typed(2, tokens_per_s=1000.0, comm=0.3), 40.0, (0.5, 4.2))]}
    line = next(text for text in build_tables(typed(2), [], 1e12, matrix, runs)["headline"]["lines"]
                if "NCCL vs Gloo" in text)
    assert line == ("Not trustworthy (failed a physical check): NCCL vs Gloo at 2 ranks, ZeRO-2: NCCL 30.0% faster "
                    "[⚠ other processes used 40 % of the 2 cores]")


def test_a_series_slower_at_one_rank_than_the_fastest_1_rank_cell_is_labelled_with_its_overhead():
    """ZeRO-2's 1-rank cell at 1,050 tokens/s against ZeRO-1's at 1,400 (the fastest): the headline names the 25 %
    it runs below and the 1.33× by which that flatters ZeRO-2's speedup over its own 1-rank cell; ZeRO-1's own series
    (the fastest 1-rank cell) carries no such label."""
    runs = {**RUNS, "ranks1-zero1-fp32-gloo": [typed(1, zero=1, tokens_per_s=1400)] * 2}
    lines = build_tables(typed(3), [], 1e12, MATRIX, runs)["headline"]["lines"]
    zero2 = next(line for line in lines if line.startswith("ZeRO-2"))
    base = statistics.median([1000, 1100])
    assert zero2.endswith(f"over the fastest 1-rank cell, ranks1-zero1-fp32-gloo; its 1-rank cell runs "
                          f"{fmt((1 - base / 1400) * 100, 0)}% below the fastest 1-rank cell, which flatters its "
                          f"speedup over its own 1-rank cell by {fmt(1400 / base, 2)}×)")
    assert "runs 25% below" in zero2 and "by 1.33×" in zero2
    assert all("flatters" not in line for line in build_tables(typed(3), [], 1e12, MATRIX, RUNS)["headline"]["lines"])


def test_runs_on_an_emulated_precision_are_named_at_a_glance_with_their_note():
    """bf16 on a CPU without bf16 matmuls: the pretrain run and each cell whose summaries carry the note are named in
    one line per distinct note; a run without the note (fp32, or native bf16) is not named."""
    from pretrain_bench.core.devices import emulated_bf16_note

    note = emulated_bf16_note("cpu", "bf16", native=lambda: False)
    emulated = RunSummary.from_dict(summary(3) | {"precision": "bf16", "precision_note": note})
    runs = {**RUNS, "ranks2-zero2-fp32-gloo": [
        RunSummary.from_dict(summary(2, comm=0.3) | {"precision": "bf16", "precision_note": note if repeat else None})
        for repeat in range(2)]}
    lines = build_tables(emulated, [], 1e12, MATRIX, runs)["headline"]["lines"]
    assert [line for line in lines if "mulated" in line] == [
        f"Emulated precision in the pretrain run, ranks2-zero2-fp32-gloo: {note}"]
    assert "several times slower than fp32" in note and "fp32 is the faster choice" in note
    assert not [line for line in build_tables(typed(3), [], 1e12, MATRIX, RUNS)["headline"]["lines"]
                if "mulated" in line]


def test_the_report_says_whether_the_plain_single_device_run_was_measured():
    from pretrain_bench.report.render import plain_baseline_text

    plain = {**entry(1, 0), "cell": "ddp-ranks1-fp32-gloo", "engine": "ddp", "origin": "baseline"}
    matrix = {**MATRIX, "cells": MATRIX["cells"] + [plain]}
    assert plain_baseline_text(matrix, set(RUNS) | {plain["cell"]}).endswith(
        "is among the measured 1-rank cells: ddp-ranks1-fp32-gloo.")
    left_out = {**plain, "status": "predicted_oom", "reason": "predicted OOM: needs 104.3 GiB per GPU, has 24.0 GiB"}
    text = plain_baseline_text({**MATRIX, "cells": MATRIX["cells"] + [left_out]}, set(RUNS))
    assert text == ("The plain single-device run (DDP on one rank) was not measured (ddp-ranks1-fp32-gloo: predicted "
                    "OOM: needs 104.3 GiB per GPU, has 24.0 GiB): the fastest 1-rank cell is the fastest of the other "
                    "setups.")
    assert plain_baseline_text(MATRIX, set(RUNS)).startswith("No plain single-device run (DDP on one rank)")
    assert plain_baseline_text({**MATRIX, "cells": [entry(1, 2)]}, set(RUNS)) is None  # no scaling measured


def test_a_recommended_cell_without_an_mfu_says_why_without_a_percent_sign():
    unreported = summary(3, tokens_per_s=2000.0)
    unreported.update(mfu=None, mfu_note="MFU would be 290%: the run achieved more than the peak it was given")
    runs = {**RUNS, "ranks3-zero2-fp32-gloo": [RunSummary.from_dict(unreported)] * 2}
    sentence = build_tables(typed(3), [], 1e12, MATRIX, runs)["recommendation"]["sentence"]
    assert ("GiB per rank, MFU not reported: MFU would be 290%: the run achieved more than the peak it was given, "
            "median (min–max) over 2 repeat(s).") in sentence


def test_the_memory_budget_the_pre_flight_assumed_is_labelled_assumed_in_the_report(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps(summary(3)))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 8.0, "tokens_per_s": 900.0,
                                                        "step_time_s": 1.0, "after_resume": False}) + "\n")
    budget = {"device": "cuda", "device_bytes": 24 * GIB, "device_source": "benchmark.device_memory_gib, no GPU "
              "detected here", "host_bytes": 128 * GIB, "host_source": "benchmark.host_memory_gib, no GPU detected "
              "here", "gpu_count": None}
    oom = entry(3, 2, "nccl", "predicted_oom", "predicted OOM: needs 55.2 GiB per GPU, has 24.0 GiB (assumed)")
    (tmp_path / "matrix.json").write_text(json.dumps({**MATRIX, "device": "cuda", "budget": budget, "cells": [oom]}))
    out = tmp_path / "report"
    build_report(tmp_path / "summary.json", tmp_path / "metrics.jsonl", [], out / "report.md", out / "report.html",
                 out / "plots", target_corpus_tokens=1e12, matrix_path=tmp_path / "matrix.json")
    md = (out / "report.md").read_text()
    assert ("Memory budget: 24.0 GiB per GPU (assumed: benchmark.device_memory_gib, no GPU detected here); host RAM "
            "128.0 GiB (assumed: benchmark.host_memory_gib, no GPU detected here).") in md
    assert "has 24.0 GiB (assumed)" in md


def write_bench(folder: Path, runs: dict[str, list[RunSummary]]) -> list[Path]:
    """Each benchmark repeat's summary.json under `folder`/bench/<cell>/rep<r>/, as the bench_cell rule writes it."""
    bench = []
    for cell, reps in runs.items():
        for rep, run in enumerate(reps, start=1):
            path = folder / "bench" / cell / f"rep{rep}" / "summary.json"
            path.parent.mkdir(parents=True)
            path.write_text(json.dumps(run.to_dict()))
            bench.append(path)
    return bench


def write_run(folder: Path, main: RunSummary, matrix: dict, runs: dict[str, list[RunSummary]],
              peak: dict | None = None) -> dict:
    """The JSON files rule report reads, under `folder`, as build_report's keyword arguments."""
    (folder / "summary.json").write_text(json.dumps(main.to_dict()))
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 8.0, "tokens_per_s": 900.0,
                                                      "step_time_s": 1.0, "after_resume": False}) + "\n")
    (folder / "matrix.json").write_text(json.dumps(matrix))
    bench = write_bench(folder, runs)
    if peak:
        (folder / "peak.json").write_text(json.dumps(peak))
    out = folder / "report"
    return {"summary_path": folder / "summary.json", "metrics_path": folder / "metrics.jsonl", "eval_paths": [],
            "out_md": out / "report.md", "out_html": out / "report.html", "plot_dir": out / "plots",
            "target_corpus_tokens": 1e12, "matrix_path": folder / "matrix.json", "bench_paths": bench,
            "peak_path": folder / "peak.json" if peak else None}


def test_a_benchmark_measured_while_other_processes_used_30_percent_of_the_cores_recommends_nothing(tmp_path):
    """Every cell measured while other processes used 28–33 % of the 2 cores: the report names no fastest setup,
    neither at the top nor at a glance, says why no measurement can be trusted (with the figures) and gives the
    command that measures the benchmark again, with the run's own config files."""
    runs = {cell: [busy(run, share) for run, share in zip(reps, (28.0, 33.0))] for cell, reps in RUNS.items()}
    kwargs = write_run(tmp_path, typed(3), MATRIX, runs)
    configfiles = [str(Path.cwd() / "config" / "tiny-cpu.yaml"), "/elsewhere/my overlay.yaml"]
    tables = build_report(**kwargs, configfiles=configfiles)
    command = ("snakemake --cores all --resources gpu=3 --configfile config/tiny-cpu.yaml --configfile "
               "'/elsewhere/my overlay.yaml' --forcerun bench_cell -- results/unit/report/report.md")
    md, html = kwargs["out_md"].read_text(), kwargs["out_html"].read_text()
    top = md[:md.index("### Cost")]
    assert "fastest setup" not in md and "fastest setup" not in html
    assert ("**No trustworthy measurement.** No trustworthy measurement exists: every one of the 4 measured benchmark "
            "cell(s) failed a physical check, so none is recommended. Why: other processes used 28–33 % of the 2 "
            "cores (ranks3-zero2-fp32-gloo, ranks2-zero2-fp32-gloo, ranks1-zero2-fp32-gloo, "
            "ranks1-zero1-fp32-gloo).") in top
    assert f"To measure the benchmark again on a quiet machine (every cell, then this report; training, evaluations " \
           f"and data are kept): `{command}`." in top
    assert f"<code>{command.replace(chr(39), '&#39;')}</code>" in html
    assert tables["recommendation"]["rerun"] == command
    # each cell's flag once, over its two repeats, in the ranking's physical checks column
    assert {row["cell"]: row["flags"] for row in tables["recommendation"]["ranking"]} == {
        cell: "other processes used 28–33 % of the 2 cores" for cell in RUNS}
    # at a glance: the scaling line is there only as not trustworthy
    glance = md[md.index("**At a glance**"):md.index("## The benchmark matrix")]
    assert "- Not trustworthy (failed a physical check): ZeRO-2, fp32, gloo, micro batch 8: 1 → 3 ranks" in glance
    # the claims that quote a timing say their figure decides nothing
    by_claim = {row["claim"]: row for row in tables["claims"]}
    for claim in ("1 GPU: throughput and memory", "3 GPUs, ZeRO-2: speedup", "time per epoch"):
        assert by_claim[claim]["measured"].startswith("Not trustworthy (failed a physical check): "), claim
        assert "it neither supports nor refutes the claim" in by_claim[claim]["verdict"], claim


def test_a_clean_matrix_keeps_its_headline_and_a_busy_fastest_cell_is_passed_over(tmp_path):
    identity = {"device": "cpu", "machine": "x86_64", "cpu_count": 2, "processor": "test", "usable_cpus": 2,
                "torch": "2.13.0"}  # bench.peak.machine_identity, as rule measure_peak records it
    peak = {**MATRIX["peak"], "identity": identity, "measured_at": "2026-01-02T03:04:05+00:00",
            "load_before": [0.1, 0.1, 0.1], "load_after": [0.1, 0.1, 0.1], "other_cpu": other_cpu(1.0)}
    kwargs = write_run(tmp_path, typed(3), MATRIX, RUNS, peak)
    tables = build_report(**kwargs, configfiles=["config/tiny-cpu.yaml"])
    found = tables["recommendation"]
    assert found["trusted"] and found["rerun"] is None
    assert found["sentence"].startswith("On this hardware the fastest setup that fits is ranks3-zero2-fp32-gloo (")
    md = kwargs["out_md"].read_text()
    assert "To measure the benchmark again" not in md
    # the peak: measured, and where it came from
    assert (f"Machine peak, measured once for this machine and software by rule measure_peak ({kwargs['peak_path']}, "
            "2026-01-02T03:04:05+00:00, torch 2.13.0), shared by every run name on it: 0.150 TFLOP/s — measured: "
            "test;") in md
    assert all(not line.startswith("Not trustworthy") for line in tables["headline"]["lines"])
    assert all("neither supports nor refutes" not in row["verdict"] for row in tables["claims"])
    # the fastest cell measured while something else ran: the next one heads, and the busy one is named
    runs = {**RUNS, "ranks3-zero2-fp32-gloo": [busy(run, 30.0) for run in RUNS["ranks3-zero2-fp32-gloo"]]}
    found = build_tables(typed(3), [], 1e12, MATRIX, runs, configfiles=["config/tiny-cpu.yaml"])["recommendation"]
    assert found["sentence"].startswith("On this hardware the fastest setup that fits (of the 3 cell(s) whose "
                                        "measurements passed every physical check) is ranks2-zero2-fp32-gloo (")
    assert found["sentence"].endswith("Passed over, as not trustworthy: ranks3-zero2-fp32-gloo (their flags are in "
                                      "the physical checks column).")
    assert found["rerun"] == ("snakemake --cores all --resources gpu=3 --configfile config/tiny-cpu.yaml --forcerun "
                              "bench_cell -- results/unit/report/report.md")


def test_a_cell_busy_in_some_repeats_or_above_the_peak_is_flagged_once():
    """A flag per cell, not per repeat: a cell busy in one of its two repeats says so once; a cell whose MFU would be
    above 100 % (the summary holds none, only its note) is flagged with the figure and never recommended."""
    noted = "MFU would be 250%: the run achieved more than the peak it was given"
    above = [RunSummary.from_dict(summary(3, tokens_per_s=2000.0) | {"mfu": None, "mfu_note": noted,
                                                                     "peak_flops_per_rank": 2000.0 * 1.2e7 / 2.5 / 3})
             for _ in range(2)]
    runs = {**RUNS, "ranks2-zero2-fp32-gloo": [busy(RUNS["ranks2-zero2-fp32-gloo"][0], 45.0),
                                               RUNS["ranks2-zero2-fp32-gloo"][1]],
            "ranks3-zero2-fp32-gloo": above}
    tables = build_tables(typed(3), [], 1e12, MATRIX, runs)
    ranking = {row["cell"]: row["flags"] for row in tables["recommendation"]["ranking"]}
    assert ranking["ranks2-zero2-fp32-gloo"] == "other processes used 45 % of the 2 cores in 1 of 2 repeats"
    assert ranking["ranks3-zero2-fp32-gloo"] == ("MFU would be 250 % (above 100 %): the timing or the peak it divides "
                                                 "by is wrong")
    mfu = {row["cell"]: row["flags"] for row in tables["mfu"]}
    assert mfu["ranks3-zero2-fp32-gloo"] == ranking["ranks3-zero2-fp32-gloo"]
    assert tables["recommendation"]["sentence"].startswith("On this hardware the fastest setup that fits (of the 2 "
                                                           "cell(s) whose measurements passed every physical check) "
                                                           "is ranks1-zero2-fp32-gloo")
