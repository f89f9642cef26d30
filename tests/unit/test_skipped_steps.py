"""fp16 steps skipped for a loss-scale overflow are no training: a fake overflow (an engine whose optimizer step
is skipped at one step, and faster for it) is left out of the steady-state time, tokens/s and MFU, counted as
summary.json's skipped_steps, and named in the report."""
import json
import types
from pathlib import Path

import pytest

from pretrain_bench.report.render import build_report
from pretrain_bench.train.checkpoints.checkpointer import Checkpointer
from pretrain_bench.train.metrics import summarise_steps
from pretrain_bench.train.settings import TrainSettings
from pretrain_bench.train.trainer import Trainer

TOKENS_PER_STEP = 1000


class OverflowingEngine:
    """The engine interface the trainer's record reads, with a loss-scale overflow at the steps in `overflows`."""

    def __init__(self, overflows):
        self.overflows, self.skipped_steps, self.scale = set(overflows), 0, 65536.0

    def step(self, step: int) -> None:
        if step in self.overflows:
            self.skipped_steps += 1
            self.scale /= 2

    def lr(self) -> float:
        return 1e-3

    def loss_scale(self) -> float:
        return self.scale


def recorded_run(overflows, step_times):
    """metrics.jsonl records of a run of len(step_times) steps through Trainer.record, and the trainer."""
    settings = TrainSettings(precision="fp16", warmup_timing_steps=1)
    engine = OverflowingEngine(overflows)
    trainer = Trainer.__new__(Trainer)
    trainer.__dict__.update(
        engine=engine, settings=settings, rank=0, world=1, device="cpu", start_step=0, comm_steady_ms=0.0,
        all_to_all_steady_ms=0.0, steady_time_s=0.0,
        tokens_per_step=TOKENS_PER_STEP, heldout=None, flops_token=6.0e6,
        peak={"flops_per_rank": 1.0e12, "source": "test"},
        checkpointer=Checkpointer(Path("state/checkpoints"), settings, seq_len=8, rank=0, world=1, run_device="cpu",
                                  fingerprint={}, saves=False, log=print))
    records = []
    for step, step_time in enumerate(step_times, start=1):
        skipped_before = engine.skipped_steps
        engine.step(step)
        gathered = [types.SimpleNamespace(loss=5.0, grad_norm=1.0, peak_mem_bytes=2**20, peak_allocated_bytes=0,
                                          peak_host_bytes=2**20)]
        records.append(trainer.record(step, gathered, step_time, dict.fromkeys(("forward", "backward", "optimizer")),
                                      None, skipped_before))
    return records, trainer


def test_an_overflow_step_is_counted_and_left_out_of_the_timing():
    # step 1 warm-up; step 3 overflows and, skipping the optimizer, takes 0.2 s against the others' 1 s
    records, trainer = recorded_run({3}, [5.0, 1.0, 0.2, 1.0, 1.0])
    assert [r["overflow"] for r in records] == [False, False, True, False, False]
    assert records[-1]["skipped_steps"] == 1
    assert trainer.steady_time_s == pytest.approx(3.0), "the communication share divides by trained steps' time"
    steady = summarise_steps(records, 1, TOKENS_PER_STEP)
    assert steady["steady_steps"] == 3  # steps 2, 4 and 5
    assert steady["tokens_per_s"] == pytest.approx(3 * TOKENS_PER_STEP / 3.0)
    assert steady["step_time_s"]["min"] == 1.0


def test_the_report_says_how_many_steps_were_skipped(tmp_path):
    from test_report import summary

    records, _ = recorded_run({3, 6}, [5.0, 1.0, 0.2, 1.0, 1.0, 0.2, 1.0, 1.0])
    steady = summarise_steps(records, 1, TOKENS_PER_STEP)
    main = {**summary(1), "precision": "fp16", "warmup_timing_steps": 1, "skipped_steps": records[-1]["skipped_steps"],
            "steady_steps": steady["steady_steps"], "tokens_per_s": steady["tokens_per_s"],
            "step_time_s": steady["step_time_s"], "memory_fit": None}
    (tmp_path / "summary.json").write_text(json.dumps(main))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "report"
    build_report(tmp_path / "summary.json", tmp_path / "metrics.jsonl", [], out / "report.md", out / "report.html",
                 out / "plots", target_corpus_tokens=1e12)
    for text in ((out / "report.md").read_text(), (out / "report.html").read_text()):
        assert "less the steps skipped for fp16 loss-scale overflow; 5 steps." in text
        assert ("Skipped steps: 2 optimizer step(s) skipped for fp16 loss-scale overflow (no update of the "
                "parameters), left out of tokens/s, step time and MFU.") in text
