"""tiny-moe (native DeepSeek: MLA, sigmoid router, 8 routed experts of which 2 per token + 1 shared) against its dense
LLaMA twin of the same active FLOPs per token (pretrain_bench.bench.dense_twin: same depth, width, heads and
vocabulary, the SwiGLU width that matches each family's flops_per_token): tokens/s of a training step on one process.

A step is forward, cross-entropy, backward and AdamW(fused=True) step, fp32 on CPU, denormals flushed as a training
rank flushes them, on fixed-seed random tokens (batch × seq_len). Each side has its own model and optimizer, built
once and warmed up; then every repeat times `--steps` steps of each side in turn, the order alternating between
repeats (A B, B A, …) so load drifts fall on both alike. Reported: each side's median tokens/s over repeats, the ratio
MoE ÷ dense per repeat and its median (the goal: ≥ 0.7 on CPU, so the batched expert dispatch is not the
bottleneck), the same per CPU second of the process (which other processes' load on a shared machine stretches less
than wall time), the ratio of each side's fastest single step (the least disturbed), both FLOPs per token, the MoE
layers' MaxVio over the timed steps (the router's own choice; the bias is not updated) and the load average.
`--profile` adds a torch.profiler table of the MoE step (self CPU time by op, and the forward time of the MoE layer's
parts: router, routed experts with their dispatch, shared experts).

    python bench/bench_moe_vs_dense.py [out.json] [--repeats 7] [--steps 6] [--warmup 3] [--batch 8]
                                       [--seq-len 128] [--vocab 2048] [--kernel auto|grouped_mm|loop] [--threads N]
                                       [--profile]
"""
import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from pretrain_bench.bench.dense_twin import dense_twin, flops_mismatch
from pretrain_bench.core.devices import flush_denormals
from pretrain_bench.core.provenance import git_commit
from pretrain_bench.train.models.deepseek import resolve_shape
from pretrain_bench.train.models.native_deepseek import max_violation
from pretrain_bench.train.models.registry import model_family

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("moe", "dense")
GOAL = 0.7  # MoE ÷ dense tokens/s at equal active FLOPs per token, on CPU


class Side:
    """One model with its AdamW and a fixed batch: `step()` trains one step."""

    def __init__(self, shape, seq_len: int, batch: int, seed: int = 0):
        self.shape, self.family = shape, model_family(shape)
        self.model = self.family.build(shape, seq_len, seed, implementation="native")
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4, fused=True)
        generator = torch.Generator().manual_seed(seed)
        self.batch = torch.randint(0, shape.vocab_size, (batch, seq_len), generator=generator)  # (B, T)
        self.flops_per_token = self.family.flops_per_token(shape, seq_len)
        self.parameters = self.family.count_parameters(shape)

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model(self.batch, labels=self.batch).loss.backward()
        self.optimizer.step()

    def timed(self, steps: int) -> tuple[float, float, list[float]]:
        """(tokens per wall second, tokens per CPU second of this process, each step's wall seconds) over `steps`
        steps."""
        cpu, seconds = time.process_time(), []
        for _ in range(steps):
            start = time.perf_counter()
            self.step()
            seconds.append(time.perf_counter() - start)
        tokens = steps * self.batch.numel()
        return tokens / sum(seconds), tokens / (time.process_time() - cpu), seconds


def profile_moe(side: Side, steps: int) -> dict:
    """Self CPU time of `steps` MoE steps by op (the top 20) and by the MoE layer's parts, from torch.profiler
    record_function ranges placed by forward hooks: milliseconds per step."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def wrap(module, name):
        forward = module.forward

        def ranged(*args, **kwargs):
            with record_function(name):
                return forward(*args, **kwargs)
        module.forward = ranged
        return forward

    parts, originals = [], []
    for layer in side.model.moe_layers():
        for module, name in ((layer.gate, "moe.router"), (layer.experts, "moe.experts"),
                             (layer.shared_experts, "moe.shared_experts"), (layer, "moe.layer")):
            originals.append((module, wrap(module, name)))
            parts.append(name)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            for _ in range(steps):
                side.step()
    finally:
        for module, forward in originals:
            module.forward = forward
    events = profiler.key_averages()
    by_op = sorted(((e.key, e.self_cpu_time_total / 1e3 / steps) for e in events if not e.key.startswith("moe.")),
                   key=lambda item: -item[1])[:20]
    ranges = {e.key: e.cpu_time_total / 1e3 / steps for e in events if e.key in parts}
    total = sum(e.self_cpu_time_total for e in events) / 1e3 / steps
    return {"what": "ms per MoE step (self CPU time; ranges: forward only, inclusive)", "total_self_cpu_ms": total,
            "ranges_forward_ms": ranges, "top_ops_self_ms": dict(by_op)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default="bench-results/moe-vs-dense.json")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per side per repeat")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per side before the first repeat")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048, help="the demo tokenizer's vocabulary")
    parser.add_argument("--kernel", choices=("auto", "grouped_mm", "loop"), default="auto",
                        help="the routed experts' kernel (native_deepseek.Experts.kernel)")
    parser.add_argument("--profile", action="store_true", help="add a torch.profiler table of the MoE step")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's, one per core); 1 on a shared machine keeps "
                             "other processes' load from stalling a step's threads on each other")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    flush_denormals()
    moe_shape = resolve_shape("tiny-moe", None, args.vocab)
    sides = {"moe": Side(moe_shape, args.seq_len, args.batch), "dense": Side(dense_twin(moe_shape, args.seq_len),
                                                                              args.seq_len, args.batch)}
    for layer in sides["moe"].model.moe_layers():
        layer.experts.kernel = args.kernel
    for side in sides.values():
        for _ in range(args.warmup):
            side.step()
    sides["moe"].model.reset_expert_load()
    load_start = list(os.getloadavg())
    tokens_per_s: dict[str, list[float]] = {name: [] for name in SIDES}
    tokens_per_cpu_s: dict[str, list[float]] = {name: [] for name in SIDES}
    step_s: dict[str, list[float]] = {name: [] for name in SIDES}
    for repeat in range(args.repeats):
        for name in SIDES if repeat % 2 == 0 else SIDES[::-1]:
            wall, cpu, seconds = sides[name].timed(args.steps)
            tokens_per_s[name].append(wall)
            tokens_per_cpu_s[name].append(cpu)
            step_s[name].extend(seconds)
    load_end = list(os.getloadavg())
    ratios = [moe / dense for moe, dense in zip(tokens_per_s["moe"], tokens_per_s["dense"])]
    cpu_ratios = [moe / dense for moe, dense in zip(tokens_per_cpu_s["moe"], tokens_per_cpu_s["dense"])]
    ratio = statistics.median(ratios)
    best = {name: args.batch * args.seq_len / min(seconds) for name, seconds in step_s.items()}
    moe = sides["moe"]
    result = {
        "what": "tokens/s of forward + backward + AdamW steps on 1 process, fp32, CPU; tiny-moe (native) against "
                "its dense LLaMA twin (native) of the same active FLOPs per token; ratio MoE ÷ dense per repeat, "
                "then the median",
        "git_commit": git_commit(ROOT), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(), "batch": args.batch, "seq_len": args.seq_len, "vocab_size": args.vocab,
        "repeats": args.repeats, "steps_per_repeat": args.steps, "warmup_steps": args.warmup,
        "expert_kernel": args.kernel,
        "shapes": {name: {key: value for key, value in side.shape.__dict__.items() if key != "extra"}
                   for name, side in sides.items()},
        "parameters": {"moe_total": moe.parameters["total"], "moe_active": moe.parameters["active"],
                       "dense_total": sides["dense"].parameters["total"]},
        "flops_per_token": {name: side.flops_per_token for name, side in sides.items()},
        "flops_mismatch": flops_mismatch(moe_shape, sides["dense"].shape, args.seq_len),
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_median": {name: statistics.median(values) for name, values in tokens_per_s.items()},
        "ratio_per_repeat": ratios, "ratio": ratio, "goal": GOAL, "meets_goal": ratio >= GOAL,
        # CPU seconds (user + system) of this process, which other processes' load stretches less than wall time
        "tokens_per_cpu_s": tokens_per_cpu_s,
        "tokens_per_cpu_s_median": {name: statistics.median(values) for name, values in tokens_per_cpu_s.items()},
        "cpu_ratio_per_repeat": cpu_ratios, "cpu_ratio": statistics.median(cpu_ratios),
        # the fastest single step of each side: the least disturbed by other processes on a shared machine
        "step_s": step_s, "tokens_per_s_best": best,
        "best_ratio": best["moe"] / best["dense"],
        "max_violation_timed": max_violation(moe.model.expert_load()).tolist(),
        "load_average_start": load_start, "load_average_end": load_end,
    }
    if args.profile:
        result["moe_profile"] = profile_moe(moe, args.steps)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({key: result[key] for key in ("flops_per_token", "flops_mismatch", "tokens_per_s_median",
                                                    "ratio_per_repeat", "ratio", "tokens_per_cpu_s_median",
                                                    "cpu_ratio", "tokens_per_s_best", "best_ratio",
                                                    "max_violation_timed",
                                                    "load_average_start", "load_average_end")}, indent=2))
    if args.profile:
        print(json.dumps(result["moe_profile"], indent=2))


if __name__ == "__main__":
    main()
