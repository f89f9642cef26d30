"""The benchmark: the declared matrix of timed cells and which of them this machine can run (matrix), the
machine's peak FLOP/s that MFU is measured against (peak), and the dense LLaMA twin of a mixture-of-experts shape
that bench/bench_moe_vs_dense.py times it against (dense_twin)."""
