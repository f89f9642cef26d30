"""FLOPs per token and per-device peaks, for MFU.

MFU = achieved model FLOP/s ÷ peak FLOP/s. Model FLOPs per token follow the PaLM paper (Chowdhery et al. 2022,
appendix B): 6N for the dense matmuls forward + backward, plus 12·L·H·Q·T for attention scores and values
(L layers, H heads, Q head dim, T sequence length). Recomputation (activation checkpointing) is not counted: MFU,
unlike hardware FLOPs utilisation, charges only the FLOPs the model needs.
"""
from __future__ import annotations

import re

FLOPS_FORMULA = "6N + 12*L*H*Q*T (PaLM appendix B; N = parameters in matmuls: all but the input embedding)"

# Dense peak TFLOP/s per GPU for 16-bit (fp16 and bf16) tensor-core inputs with fp32 accumulation, without
# sparsity: the figure MFU divides by. Datasheets that print only the 2:4-sparse figure (marked *) are halved.
# A key matches torch.cuda.get_device_name() where its words appear in the name's, in a row (gpu_table_peak), longest
# key first, so "H100 PCIe" wins over "H100"; a word never matches part of another ("A100" is not in "RTX A1000").
GPU_PEAK_TFLOPS_16BIT = {
    "H200": 989.5,  # NVIDIA H200 Tensor Core GPU datasheet (2024), H200 SXM: BF16/FP16 1,979* TFLOPS
    "H200 NVL": 835.5,  # same datasheet, H200 NVL: 1,671* TFLOPS
    "H100": 989.5,  # NVIDIA H100 Tensor Core GPU datasheet (2023), H100 SXM: BF16/FP16 1,979* TFLOPS
    "H100 PCIe": 756.5,  # same datasheet, H100 PCIe: 1,513* TFLOPS
    "H100 NVL": 835.5,  # same datasheet, H100 NVL: 1,671* TFLOPS (per GPU)
    "H800": 989.5,  # NVIDIA H800 Tensor Core GPU datasheet (2023), H800 SXM5: BF16/FP16 1,979* TFLOPS (H100 SXM's
                    # compute with NVLink at 400 GB/s): the GPU DeepSeek-V2 and V3 report their training costs on
    "H800 PCIe": 756.5,  # same datasheet, H800 PCIe: 1,513* TFLOPS
    "A100": 312.0,  # NVIDIA A100 Tensor Core GPU datasheet (2021), SXM and PCIe: BF16/FP16 312 (624*) TFLOPS
    "L40S": 362.05,  # NVIDIA L40S datasheet (2023): BF16/FP16 362.05 (733*) TFLOPS
    "L40": 181.05,  # NVIDIA L40 datasheet (2022): BF16/FP16 181.05 (362.1*) TFLOPS
    "L4": 121.0,  # NVIDIA L4 Tensor Core GPU datasheet (2023): BF16/FP16 242* TFLOPS
    "RTX 4090": 165.2,  # NVIDIA Ada GPU architecture whitepaper, table 2: FP16/BF16 tensor with FP32 accumulate 165.2
    "RTX 4090 D": 147.0,  # 4090 D: 14,592 CUDA cores vs 16,384 (same clock) -> 165.2 * 0.89
    "RTX 3090": 71.0,  # NVIDIA Ampere GA102 GPU architecture whitepaper, table 9: FP16/BF16 tensor with FP32
                       # accumulate 71 (142*) TFLOPS
    "RTX 3090 Ti": 80.0,  # GA102 full die: 84 SMs at 1.86 GHz vs the 3090's 82 at 1.695 GHz -> 71 * 1.124
}


def flops_per_token(matmul_params: int, layers: int, heads: int, head_dim: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward)."""
    return 6.0 * matmul_params + 12.0 * layers * heads * head_dim * seq_len


def gpu_table_peak(device_name: str, precision: str) -> tuple[float, str] | None:
    """(peak FLOP/s, source) for a known GPU name, or None. fp32 runs use TF32-free CUDA cores: not tabulated."""
    if precision not in ("fp16", "bf16"):
        return None
    words = _name_words(device_name)
    # Longest key first so "RTX 4090 D" wins over "RTX 4090".
    for key in sorted(GPU_PEAK_TFLOPS_16BIT, key=lambda k: len(_name_words(k)), reverse=True):
        wanted = _name_words(key)
        if any(words[i:i + len(wanted)] == wanted for i in range(len(words) - len(wanted) + 1)):
            return GPU_PEAK_TFLOPS_16BIT[key] * 1e12, f"datasheet table: {key} {GPU_PEAK_TFLOPS_16BIT[key]} TFLOP/s"
    return None


def _name_words(name: str) -> list[str]:
    """A GPU name's words, upper case, split at spaces, hyphens and underscores ("NVIDIA A100-SXM4-80GB" → NVIDIA,
    A100, SXM4, 80GB)."""
    return re.split(r"[\s_-]+", name.upper().strip())


def matmul_timings(dtype_name: str = "fp32", size: int = 1024, repeats: int = 8, device: str = "cpu",
                   budget_s: float | None = None) -> list[float]:
    """Seconds of each timed square matmul of `size` on this device with the current thread count: `repeats` calls
    after one that warms caches and kernels, or fewer once `budget_s` (warm-up included) is spent, never none.

    The product is x @ wᵀ (torch.nn.functional.linear), the layout of every nn.Linear in the model: a CPU without
    native bf16 matmuls (AVX2 only) runs the plain x @ w layout in bf16 over 10× slower (on 2 such cores, 1024²:
    0.75 GFLOP/s against 12.7), a speed no layer of the model sees."""
    import time

    import torch
    import torch.nn.functional as F

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    timings: list[float] = []
    began = time.perf_counter()
    for call in range(repeats + 1):
        if device != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter()
        F.linear(a, b)
        if device != "cpu":
            torch.cuda.synchronize()
        if call:
            timings.append(time.perf_counter() - start)
            if budget_s is not None and time.perf_counter() - began >= budget_s:
                break
    return timings


def measure_matmul_peak(dtype_name: str = "fp32", size: int = 1024, repeats: int = 8, device: str = "cpu") -> float:
    """Measured FLOP/s of a square matmul on this device with the current thread count (best of `repeats`)."""
    return 2.0 * size**3 / min(matmul_timings(dtype_name, size, repeats, device))


def mfu_ratio(tokens_per_s: float, flops_per_token_: float, peak_per_rank: float, ranks: int) -> float:
    """Model FLOPs utilisation as computed, above 1 included: tokens/s × FLOPs per token ÷ (ranks × peak per rank)."""
    return tokens_per_s * flops_per_token_ / (peak_per_rank * ranks)


def model_flops_utilisation(tokens_per_s: float | None, flops_per_token_: float, peak_per_rank: float | None,
                            ranks: int, peak_source: str) -> tuple[float | None, str | None]:
    """(MFU, None), or (None, why not): an MFU above 100 % is impossible, so a peak below what the run achieved is
    not this run's peak, and no figure is printed rather than a wrong one."""
    if not tokens_per_s or not peak_per_rank:
        return None, "no throughput or no peak to divide by"
    mfu = mfu_ratio(tokens_per_s, flops_per_token_, peak_per_rank, ranks)
    if mfu > 1.0:
        return None, (f"MFU would be {mfu:.0%}: the run achieved more than the peak it was given "
                      f"({peak_per_rank / 1e12:,.3g} TFLOP/s per rank, {peak_source}), so that is not its peak; "
                      "not reported")
    return mfu, None


def plan_peak(peak: dict | None, peak_tflops: float | None, device: str, ranks: int) -> dict | None:
    """The peak FLOP/s per rank every run of a machine divides by: report.peak_tflops, else rule measure_peak's
    figure (bench/peak.json: a GPU's datasheet or measured peak; on CPU the whole machine measured in one process,
    shared by the ranks of a run, so each rank's share is 1/ranks of it)."""
    if peak_tflops:
        return {"flops_per_rank": peak_tflops * 1e12, "source": "report.peak_tflops in the config"}
    if not peak:
        return None
    if device == "cpu":
        return {"flops_per_rank": peak["peak_flops"] / ranks,
                "source": f"{peak['peak_source']} (rule measure_peak), shared by {ranks} CPU rank(s)"}
    return {"flops_per_rank": peak["peak_flops"], "source": f"{peak['peak_source']} (rule measure_peak)"}
