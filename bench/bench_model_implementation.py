"""model.implementation native against transformers: a training rank's start-up and steady tokens/s, and the CPU
seconds of what a rank imports and builds.

Trainer runs: the trainer at one rank (DDP, fp32, compile off, bench_trainer's model and data), launched through the
real launcher, once per implementation per round, the order alternating between rounds (A B, B A, …), so load drifts
fall on both alike. Each run gives its rank's start-up (launch to its first step, the rank's `start-up:` record),
its steady tokens/s (summary.json, warm-up steps left out) and its losses (the two should be equal: same seed, same
weights, same maths). Ratios are native ÷ transformers within a round, then the median over rounds.

Imports: CPU seconds (user + system, which load stretches less than wall time) of fresh interpreters that import
what a training rank imports (torch, DeepSpeed, the trainer) and build the bench's model with each implementation,
alternating, median of `--import-runs`.

    python bench/bench_model_implementation.py [out.json] [--rounds 2] [--steps 10] [--warmup 3]
                                               [--import-runs 3] [--skip-trainer] [--skip-imports]
"""
import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from bench_trainer import MODEL_OVERRIDES, RANK_IMPORTS, build_data, child_cpu_seconds, run_trainer

IMPLEMENTATIONS = ("transformers", "native")


def trainer_rounds(config: dict, data: tuple[Path, Path], rounds: int, steps: int, warmup: int) -> dict:
    """Alternating 1-rank DDP runs of each implementation: start-up, tokens/s and losses per run."""
    runs: dict[str, list[dict]] = {name: [] for name in IMPLEMENTATIONS}
    for number in range(rounds):
        order = IMPLEMENTATIONS if number % 2 == 0 else IMPLEMENTATIONS[::-1]
        for name in order:
            work = Path(tempfile.mkdtemp(prefix=f"bench-implementation-{name}-"))
            implementation_config = {**config, "model": {**config["model"], "implementation": name}}
            summary = run_trainer(implementation_config, data, steps, warmup, "ddp", False, work)
            assert summary["model"]["implementation"] == name, summary["model"]
            losses = [json.loads(line)["loss"] for line in (work / "ddp" / "metrics.jsonl").read_text().splitlines()]
            runs[name].append({"rank_startup_s": summary["rank_startup_s"], "tokens_per_s": summary["tokens_per_s"],
                               "losses": losses, "load_average": list(os.getloadavg())})
    startup_ratios = [n["rank_startup_s"] / t["rank_startup_s"] for n, t in zip(runs["native"], runs["transformers"])]
    speed_ratios = [n["tokens_per_s"] / t["tokens_per_s"] for n, t in zip(runs["native"], runs["transformers"])]
    return {"what": "1 rank, DDP, CPU, fp32, compile off; ratios native ÷ transformers per round, then the median",
            "runs": runs,
            "rank_startup_s_median": {name: statistics.median(r["rank_startup_s"] for r in runs[name])
                                      for name in IMPLEMENTATIONS},
            "startup_ratio_per_round": startup_ratios, "startup_ratio": statistics.median(startup_ratios),
            "tokens_per_s_ratio_per_round": speed_ratios, "tokens_per_s_ratio": statistics.median(speed_ratios),
            "losses_identical": all(n["losses"] == t["losses"] for n, t in zip(runs["native"], runs["transformers"])),
            "max_abs_loss_difference": max(abs(a - b) for n, t in zip(runs["native"], runs["transformers"])
                                           for a, b in zip(n["losses"], t["losses"]))}


def import_seconds(vocab_size: int, runs: int) -> dict:
    """CPU seconds of a fresh interpreter importing a rank's libraries and building the model with each
    implementation (median of `runs`, alternating)."""
    shape = f"resolve_shape('tiny', {MODEL_OVERRIDES!r}, {vocab_size})"
    seconds: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
    for _ in range(runs):
        for name in IMPLEMENTATIONS:
            code = (f"{RANK_IMPORTS}; from pretrain_bench.train.models.llama import build_model, resolve_shape; "
                    f"build_model({shape}, 128, 0, implementation={name!r})")
            seconds[name].append(child_cpu_seconds(code, f"importing and building ({name})"))
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    return {"what": f"CPU s of a fresh interpreter: {RANK_IMPORTS}, then build_model of the bench's model",
            "cpu_s": medians, "cpu_s_runs": seconds, "saved_cpu_s": medians["transformers"] - medians["native"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default="bench-results/model-implementation.json")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--import-runs", type=int, default=3)
    parser.add_argument("--skip-trainer", action="store_true")
    parser.add_argument("--skip-imports", action="store_true")
    args = parser.parse_args()
    config, *data = build_data()
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.is_file() else {}  # sections a call does not measure are kept
    sections = {}
    if not args.skip_imports:
        vocab = json.loads(data[0].read_text())["vocab_size"]
        sections["imports"] = lambda: import_seconds(vocab, args.import_runs)
    if not args.skip_trainer:
        sections["trainer"] = lambda: trainer_rounds(config, tuple(data), args.rounds, args.steps, args.warmup)
    out.parent.mkdir(parents=True, exist_ok=True)
    for section, measure in sections.items():
        load_start = list(os.getloadavg())
        result[section] = {**measure(), "load_average_start": load_start, "load_average_end": list(os.getloadavg())}
        out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
