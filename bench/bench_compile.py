"""train.compile's choices on this machine: eager, each decoder block compiled, the whole model compiled.

Same model as bench/bench_trainer.py (~12M parameters, LLaMA architecture), same batch (8 × 128 tokens of seeded
random tokens), fused AdamW, fp32, all cores. The three models live in one process and start from the same weights;
each compiles in its first step (inductor, into a fresh cache folder, so the compile time is a cold start's), then
the variants take turns for --rounds rounds of --steps steps each (eager, block, whole, eager, …), so a busy machine
slows every variant alike. Per round, a variant's speedup is eager's step time ÷ its own; the figure is the median
over rounds, and the scope that measures faster is decided by the median over rounds of the whole model's step time
÷ the blocks'. Break-even: compile seconds ÷ seconds saved per step, the steps a run must take before compiling pays.
The losses of the first steps (same weights, same batches) are compared with eager's: their largest difference is
the tolerance the compile tests state.
Writes JSON (default bench-results/compile.json).

    python bench/bench_compile.py [out.json] [--steps 3] [--rounds 3] [--implementation transformers|native]
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_trainer import MODEL_OVERRIDES

VOCAB, BATCH, SEQ_LEN, SEED = 4096, 8, 128, 1234
VARIANTS = ("eager", "block", "whole")


def build(variant: str, implementation: str):
    """(model, optimizer) of one variant of the model class `implementation` (model.implementation), from the same
    seeded weights (compiled lazily, at its first step)."""
    import torch

    from pretrain_bench.train.compiling import compile_model
    from pretrain_bench.train.engines.spec import TORCH_ADAMW_KWARGS
    from pretrain_bench.train.models.llama import build_model, resolve_shape

    model = build_model(resolve_shape("tiny", MODEL_OVERRIDES, VOCAB), SEQ_LEN, SEED, implementation=implementation)
    if variant != "eager":  # what train.compile does for each scope; the bench's own clock times every first step
        compile_model(model, {"block": "blocks", "whole": "model"}[variant]).close()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, **TORCH_ADAMW_KWARGS)
    return model, optimizer


def step(model, optimizer, batch) -> float:
    """One training step (forward, cross-entropy, backward, clip, AdamW); returns the loss."""
    import torch
    import torch.nn.functional as F

    logits = model(input_ids=batch[:, :-1]).logits  # (B, T, vocab)
    loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default="bench-results/compile.json")
    parser.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--implementation", choices=["transformers", "native"], default="transformers",
                        help="the model class (model.implementation)")
    args = parser.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-compile-inductor-")  # a cold start
    import torch

    from pretrain_bench.train.compiling import CompileClock

    torch.set_num_threads(os.cpu_count())
    generator = torch.Generator().manual_seed(SEED)
    batches = torch.randint(0, VOCAB, (args.rounds * args.steps + 1, BATCH, SEQ_LEN + 1), generator=generator)
    runs = {variant: build(variant, args.implementation) for variant in VARIANTS}
    first, clock = {}, CompileClock()
    for variant, (model, optimizer) in runs.items():  # 1) the first step of each: its compilation
        started, compiled_before, count_before = time.perf_counter(), clock.seconds, clock.compilations
        loss = step(model, optimizer, batches[0])
        first[variant] = {"first_step_s": time.perf_counter() - started, "loss": loss,
                          "compile_s": clock.seconds - compiled_before,
                          "compilations": clock.compilations - count_before}
    clock.close()
    rounds, losses = [], {variant: [first[variant]["loss"]] for variant in VARIANTS}
    for r in range(args.rounds):  # 2) steady state, the variants taking turns
        times = {}
        for variant, (model, optimizer) in runs.items():
            started = time.perf_counter()
            for i in range(args.steps):
                losses[variant].append(step(model, optimizer, batches[1 + r * args.steps + i]))
            times[variant] = (time.perf_counter() - started) / args.steps
        rounds.append(times)
    result = {
        "what": "1 process, CPU, fp32, fused AdamW, 8 × 128 tokens: eager vs torch.compile (inductor) per decoder "
                "block vs the whole model, from the same weights on the same batches",
        "implementation": args.implementation,
        "threads": os.cpu_count(), "steps_per_round": args.steps, "rounds": args.rounds,
        "load_average": list(os.getloadavg()),
        "step_time_s_per_round": rounds,
        "variants": {},
    }
    eager_step = statistics.median(r["eager"] for r in rounds)
    for variant in VARIANTS:
        speedup = statistics.median(r["eager"] / r[variant] for r in rounds)
        saved = eager_step - statistics.median(r[variant] for r in rounds)
        compile_s = first[variant]["compile_s"]
        result["variants"][variant] = {
            **{k: first[variant][k] for k in ("first_step_s", "compile_s", "compilations")},
            "speedup_vs_eager": speedup,
            "break_even_steps": (compile_s / saved if saved > 0 else None) if variant != "eager" else None,
            "max_abs_loss_diff_vs_eager": max(abs(a - b) for a, b in zip(losses[variant], losses["eager"])),
        }
    # the choice itself: per round, the whole model's step time ÷ the blocks' (> 1: compiling per block is faster)
    whole_over_block = [r["whole"] / r["block"] for r in rounds]
    result["whole_over_block_step_time_per_round"] = whole_over_block
    result["whole_over_block_step_time"] = statistics.median(whole_over_block)
    result["faster_scope"] = "block" if result["whole_over_block_step_time"] > 1 else "whole"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(main())
