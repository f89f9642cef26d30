"""The benchmark: the declared matrix of timed cells and which of them this machine can run (matrix), and the
machine's peak FLOP/s that MFU is measured against (peak)."""
