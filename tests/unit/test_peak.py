"""The CPU peak measurement (rule measure_peak, the GPU smoke's CPU twin): bounded in time on any CPU, and its
method names exactly the matmuls it timed."""
import re

from pretrain_bench.flops import matmul_timings
from pretrain_bench.peak import cpu_matmul_peak


def test_a_budget_stops_the_timed_calls_early_but_never_before_the_first():
    assert len(matmul_timings("fp32", 64, repeats=3)) == 3
    bounded = matmul_timings("fp32", 256, repeats=100_000, budget_s=0.05)
    assert 1 <= len(bounded) < 100_000
    assert len(matmul_timings("fp32", 64, repeats=5, budget_s=0.0)) == 1


def test_sizes_predicted_past_the_budget_are_left_out_and_named():
    flops, method = cpu_matmul_peak("fp32", sizes=(64, 8192, 16384), budget_s=0.02)
    # 8192² costs 2¹⁵ × 64²'s FLOPs: far over 0.01 s on any CPU, so neither large size runs
    assert flops > 0
    assert re.fullmatch(r"best fp32 square matmul x @ wᵀ \(64² ×\d calls; 8192², 16384² left out: one 8192² call "
                        r"predicted at [\d.e+-]+ s, over half the 0.02 s each size may take\)", method), method


def test_every_size_runs_its_repeats_within_a_generous_budget():
    flops, method = cpu_matmul_peak("fp32", sizes=(64, 128), repeats=4, budget_s=60)
    assert method == "best fp32 square matmul x @ wᵀ (64² ×4, 128² ×4 calls)"
    assert flops > 0


def test_a_bf16_cpu_run_is_told_when_its_cpu_emulates_bf16_matmuls():
    from pretrain_bench.devices import emulated_bf16_note

    note = emulated_bf16_note("cpu", "bf16", native=lambda: False)
    assert note.startswith("train.precision bf16 on a CPU without native bf16 matmuls (oneDNN reports none; torch's "
                           "CPU capability: ")
    assert note.endswith("train.precision fp32 is the faster choice on this CPU")
    assert emulated_bf16_note("cpu", "bf16", native=lambda: True) is None
    assert emulated_bf16_note("cpu", "fp32", native=lambda: False) is None
    assert emulated_bf16_note("cuda", "bf16", native=lambda: False) is None
