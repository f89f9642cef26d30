"""bench/bench_trainer.py's rounds: every round runs the reference and each variant once, in the order given in even
rounds and the other way round in odd ones, and each ratio pairs a variant with its own round's reference."""
import importlib.util
import statistics
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]


def bench_trainer():
    spec = importlib.util.spec_from_file_location("bench_trainer_script", ROOT / "bench" / "bench_trainer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rounds_alternate_their_order_and_pair_each_variant_with_its_rounds_reference(monkeypatch, tmp_path):
    bench = bench_trainer()
    ran = []
    # tokens/s that fall run after run: a drift that a fixed order would charge to the runs placed last
    speeds = iter(range(1000, 0, -10))

    def run(name):
        ran.append(name)
        return {"tokens_per_s": float(next(speeds)), "first_step_s": 1.0, "parameters": 7, "engine": "deepspeed",
                "zero_stage": 0, "compile": None, "rank_startup_s": 1.0, "phase_time_s": {}, "denormals_flushed": True}

    flushes = []  # run_reference's `flush` argument, run by run
    monkeypatch.setattr(bench, "run_reference", lambda *args: (flushes.append(args[5]), run("reference"))[1])
    monkeypatch.setattr(bench, "run_trainer", lambda config, data, steps, warmup, variant, *rest: run(variant))
    args = SimpleNamespace(repeats=4, steps=3, warmup=1, variants=["zero0", "ddp"], loop_denormals="flush")
    result = bench.side({}, (tmp_path, tmp_path), args, False, tmp_path)

    forward, backward = ["reference", "zero0", "ddp"], ["ddp", "zero0", "reference"]
    assert ran == forward + backward + forward + backward
    assert result["order_per_round"] == [forward, backward, forward, backward]
    assert flushes == [True] * 4 and result["reference_denormals_flushed"] == [True] * 4
    reference = result["reference_tokens_per_s"]
    assert reference == [1000.0, 950.0, 940.0, 890.0]  # first in even rounds, last in odd ones
    zero0 = result["trainer"]["zero0"]
    assert zero0["tokens_per_s"] == [990.0, 960.0, 930.0, 900.0]
    assert zero0["ratio_to_reference_per_round"] == [z / r for z, r in zip(zero0["tokens_per_s"], reference)]
    assert zero0["ratio_to_reference"] == statistics.median(zero0["ratio_to_reference_per_round"])
    # placed after the reference in even rounds and before it in odd ones, the variant is not always the one the
    # drift makes slower
    assert min(zero0["ratio_to_reference_per_round"]) < 1 < max(zero0["ratio_to_reference_per_round"])
    ddp = result["trainer"]["ddp"]
    assert ddp["ratio_to_ddp_per_round"] == [1.0] * 4 and zero0["ratio_to_ddp"] == statistics.median(
        [z / d for z, d in zip(zero0["tokens_per_s"], ddp["tokens_per_s"])])
