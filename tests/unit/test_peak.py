"""The CPU peak measurement (rule measure_peak, the GPU smoke's CPU twin): bounded in time on any CPU, and its
method names exactly the matmuls it timed."""
import re

from pretrain_bench.bench import peak
from pretrain_bench.bench.peak import cpu_machine_peak, cpu_matmul_peak
from pretrain_bench.train.models.flops import matmul_timings


def test_a_budget_stops_the_timed_calls_early_but_never_before_the_first():
    assert len(matmul_timings("fp32", 64, repeats=3)) == 3
    bounded = matmul_timings("fp32", 256, repeats=100_000, budget_s=0.05)
    assert 1 <= len(bounded) < 100_000
    assert len(matmul_timings("fp32", 64, repeats=5, budget_s=0.0)) == 1


def test_sizes_predicted_past_the_budget_are_left_out_and_named():
    flops, method, _ = cpu_matmul_peak("fp32", sizes=(64, 8192, 16384), budget_s=0.02)
    # 8192² costs 2¹⁵ × 64²'s FLOPs: far over 0.01 s on any CPU, so neither large size runs
    assert flops > 0
    assert re.fullmatch(r"best fp32 square matmul x @ wᵀ \(64² ×\d calls; 8192², 16384² left out: one 8192² call "
                        r"predicted at [\d.e+-]+ s, over half the 0.02 s each size may take\)", method), method


def test_every_size_runs_its_repeats_within_a_generous_budget():
    flops, method, by_size = cpu_matmul_peak("fp32", sizes=(64, 128), repeats=4, budget_s=60)
    assert method == "best fp32 square matmul x @ wᵀ (64² ×4, 128² ×4 calls)"
    assert flops > 0 and set(by_size) == {64, 128} and flops == max(by_size.values())


def test_the_machine_peak_is_fp32_where_bf16_is_emulated_and_the_faster_of_both_where_it_is_native(monkeypatch):
    flops, method = cpu_machine_peak(native_bf16=lambda: False, where=" on 2 cores", sizes=(64, 128), repeats=2,
                                     budget_s=60)
    assert flops > 0 and method == ("best fp32 square matmul x @ wᵀ (64² ×2, 128² ×2 calls) on 2 cores; bf16 not "
                                    "measured: this CPU has no native bf16 matmuls (oneDNN), so they are emulated in "
                                    "fp32")
    flops, method = cpu_machine_peak(native_bf16=lambda: True, sizes=(64,), repeats=2, budget_s=60)
    assert flops > 0 and re.fullmatch(r"best (fp32|bf16) square matmul x @ wᵀ \(64² ×2 calls\); (bf16|fp32) square "
                                      r"matmul x @ wᵀ \(64² ×2 calls\): [\d.e+-]+ TFLOP/s", method), method
    assert method.count("fp32") == method.count("bf16") == 1
    # whichever precision measured faster is the peak, the other named with its figure
    for fp32_flops, bf16_flops, expected in ((3e11, 1e12, "best bf16"), (3e11, 1e11, "best fp32")):
        figures = {"fp32": fp32_flops, "bf16": bf16_flops}
        monkeypatch.setattr(peak, "cpu_matmul_peak",
                            lambda dtype, figures=figures, **_: peak.MatmulPeak(
                                figures[dtype], f"best {dtype} square matmul x @ wᵀ (8² ×1 calls)",
                                {8: figures[dtype]}))
        flops, method = cpu_machine_peak(native_bf16=lambda: True)
        other = "fp32" if expected == "best bf16" else "bf16"
        assert flops == max(fp32_flops, bf16_flops) and method == (
            f"{expected} square matmul x @ wᵀ (8² ×1 calls); {other} square matmul x @ wᵀ (8² ×1 calls): "
            f"{min(fp32_flops, bf16_flops) / 1e12:.3g} TFLOP/s")


def test_a_bf16_cpu_run_is_told_when_its_cpu_emulates_bf16_matmuls():
    from pretrain_bench.core.devices import emulated_bf16_note

    note = emulated_bf16_note("cpu", "bf16", native=lambda: False)
    assert note.startswith("train.precision bf16 on a CPU without native bf16 matmuls (oneDNN reports none; torch's "
                           "CPU capability: ")
    assert note.endswith("train.precision fp32 is the faster choice on this CPU")
    assert emulated_bf16_note("cpu", "bf16", native=lambda: True) is None
    assert emulated_bf16_note("cpu", "fp32", native=lambda: False) is None
    assert emulated_bf16_note("cuda", "bf16", native=lambda: False) is None


def test_bf16_sizes_after_one_where_it_ran_under_half_fp32s_speed_are_left_out(monkeypatch):
    from pretrain_bench.train.models import flops

    # seconds per call: fp32 at 1 TFLOP/s at every size; bf16 at a quarter of that at 512², then (were it timed) 4×
    # fp32's speed from 1024² on, which is what leaving it out gives up, and why only under half is left out
    speeds = {("fp32", 512): 1e12, ("fp32", 1024): 1e12, ("fp32", 2048): 1e12,
              ("bf16", 512): 0.25e12, ("bf16", 1024): 4e12, ("bf16", 2048): 4e12}
    timed = []

    def timings(dtype, size, repeats, budget_s=None):
        timed.append((dtype, size))
        return [2.0 * size**3 / speeds[dtype, size]] * repeats

    monkeypatch.setattr(flops, "matmul_timings", timings)
    best, method = cpu_machine_peak(native_bf16=lambda: True, where=" on 2 cores", repeats=2, budget_s=1e9)
    assert timed == [("fp32", 512), ("fp32", 1024), ("fp32", 2048), ("bf16", 512)]
    assert best == 1e12
    assert method == ("best fp32 square matmul x @ wᵀ (512² ×2, 1024² ×2, 2048² ×2 calls) on 2 cores; bf16 square "
                      "matmul x @ wᵀ (512² ×2 calls; 1024², 2048² left out: at 512² it ran at 0.25 TFLOP/s, under "
                      "0.5× fp32's 1) on 2 cores: 0.25 TFLOP/s")
    # at half fp32's speed or above, every size is timed, and a faster bf16 is the peak
    speeds["bf16", 512] = 0.5e12
    timed.clear()
    best, method = cpu_machine_peak(native_bf16=lambda: True, repeats=2, budget_s=1e9)
    assert timed[3:] == [("bf16", 512), ("bf16", 1024), ("bf16", 2048)]
    assert best == 4e12 and method.startswith("best bf16 square matmul x @ wᵀ (512² ×2, 1024² ×2, 2048² ×2 calls); "
                                              "fp32 square matmul")


def test_the_peak_is_keyed_by_the_machine_and_software_not_by_a_run_name(monkeypatch):
    """One file per machine and software under results/data/: the same identity gives the same path whatever the run;
    another torch, device or core count gives another."""
    from pretrain_bench.bench.peak import MachinePeak, machine_identity

    here = MachinePeak.here("cpu")
    assert here == MachinePeak.here("cpu") and here.identity == machine_identity("cpu")
    assert here.path == f"results/{here.folder}/peak.json" and here.folder.startswith("data/machine-")
    assert {"device", "machine", "processor", "cpu_count", "usable_cpus", "torch"} <= set(here.identity)
    for key, other in (("torch", "0.0.1"), ("device", "cuda"), ("usable_cpus", here.identity["usable_cpus"] + 1)):
        assert MachinePeak.of({**here.identity, key: other}).path != here.path, key
    monkeypatch.setattr(peak.metadata, "version", lambda package: "9.9.9")
    assert MachinePeak.here("cpu").identity["torch"] == "9.9.9" and MachinePeak.here("cpu").path != here.path
