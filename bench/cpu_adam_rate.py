"""Parameters per second DeepSpeed's CPU Adam (DeepSpeedCPUAdam) updates on this machine: the figure behind
pretrain_bench.train.memory.offload.CPU_ADAM_PARAMS_PER_S_PER_CORE.

Usage: python bench/cpu_adam_rate.py [--elements N] [--steps S]
Prints params/s for the whole machine and per core (one process, DeepSpeed's OpenMP threads on every core).
"""
import argparse
import os
import time


def measure(elements: int, steps: int) -> float:
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    param = torch.nn.Parameter(torch.randn(elements))
    param.grad = torch.randn(elements)
    optimizer = DeepSpeedCPUAdam([param], lr=1e-4)
    optimizer.step()  # the moments are created on the first step
    started = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return elements * steps / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=50_000_000)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    rate, cores = measure(args.elements, args.steps), os.cpu_count() or 1
    print(f"DeepSpeedCPUAdam: {rate:.3g} params/s on {cores} cores, {rate / cores:.3g} params/s per core")


if __name__ == "__main__":
    main()
