"""What DeepSpeed ZeRO-1/2 costs at one data-parallel rank, apart from what our trainer costs.

Three loops train the same model (bench_trainer's shape, the tiny config's model class, its data, batch, threads and
learning-rate schedule) at one rank, CPU, fp32, compile off:

- plain: bench_trainer's hand-written loop (forward, loss, backward, clip, fused AdamW, zero_grad);
- bare DeepSpeed (`bare_deepspeed_loop`): a minimal hand-written loop around `deepspeed.initialize` with the same
  ds_config the trainer hands DeepSpeed (pretrain_bench.train.settings.deepspeed_config, so the same ZeRO settings and
  the same torch AdamW), the same model and nothing of our trainer: forward, loss, `engine.backward`, `engine.step`,
  the loss read each step;
- our trainer (bench_trainer's run through the launcher, as a benchmark cell runs).

All three flush denormal floats to zero, as the trainer's CPU ranks do (pretrain_bench.core.devices.flush_denormals).
Within a round each runs once in turn (the other way round in every second round: bench_trainer.round_order), each in
a fresh interpreter; the ratios are medians over rounds of per-round ratios of tokens/s: trainer ÷ bare DeepSpeed is
our trainer's own cost around DeepSpeed (≥ 1.0 where it adds nothing), bare DeepSpeed ÷ plain is DeepSpeed's own cost
at one rank (what its partition copies, flattening and own gradient norm take), and trainer ÷ plain their product,
bench_trainer's figure.

Writes JSON (default bench-results/zero-overhead.json).

--bare-also JSON adds, per variant, the bare loop with those train.deepspeed keys merged in (a setting's previous
value, say) to each round, and its tokens/s ÷ the bare loop's and whether its losses are the same.

    python bench/bench_zero_overhead.py [out.json] [--steps 12] [--warmup 3] [--repeats 3] [--variants zero1 zero2]
                                        [--bare-also '{"zero_optimization": {"reduce_scatter": true}}']
"""
import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_trainer import (
    MODEL_OVERRIDES,
    ROOT,
    VARIANTS,
    bench_train,
    build_data,
    round_order,
    run_reference,
    run_trainer,
)

from pretrain_bench.train.launcher import free_port

DEEPSPEED_VARIANTS = [name for name, keys in VARIANTS.items() if keys.get("engine", "deepspeed") == "deepspeed"]


def bare_deepspeed_loop(config: dict, data: tuple[Path, Path], steps: int, warmup: int, variant: str,
                        deepspeed_overrides: dict | None = None) -> dict:
    """One rank of DeepSpeed with the trainer's ds_config, model and schedule, driven by the smallest loop DeepSpeed
    documents (forward, loss, engine.backward, engine.step), in this process."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()), DS_ACCELERATOR="cpu")
    import deepspeed
    import torch
    import torch.nn.functional as F

    from pretrain_bench.core.devices import flush_denormals
    from pretrain_bench.data.loader import PackedTokens, RankBatches
    from pretrain_bench.train.engines.base import lr_schedule
    from pretrain_bench.train.engines.deepspeed_engine import skip_muon_import
    from pretrain_bench.train.engines.spec import deepspeed_config
    from pretrain_bench.train.models.llama import build_model, resolve_shape
    from pretrain_bench.train.settings import TrainSettings

    torch.set_num_threads(os.cpu_count())
    flush_denormals()  # as the trainer's CPU ranks and the plain loop do (bench_trainer --loop-denormals flush)
    index_path = data[0]
    index = json.loads(index_path.read_text())
    model_config, seq_len = config["model"], config["model"]["seq_len"]
    shape = resolve_shape(model_config["preset"], MODEL_OVERRIDES, index["vocab_size"])
    settings = TrainSettings.from_config({**config["train"], **bench_train(steps, warmup), **VARIANTS[variant],
                                          **({"deepspeed": deepspeed_overrides} if deepspeed_overrides else {})})
    total_steps = settings.total_steps(seq_len)
    # the config a benchmark cell's rank hands DeepSpeed (its comms logger included: a benchmark plan measures comm)
    ds_config = deepspeed_config(settings, "cpu", total_steps)
    skip_muon_import()  # as the trainer's engine does: its optimizer is not Muon
    deepspeed.init_distributed(dist_backend="gloo")
    model = build_model(shape, seq_len, settings.seed, settings.precision, "cpu",
                        model_config["attn_implementation"], model_config["implementation"])
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config,
                                           lr_scheduler=lr_schedule(settings, total_steps))
    batches = RankBatches(PackedTokens(index_path, "train", seq_len), rank=0, world_size=1,
                          micro_batch_size=settings.micro_batch_size, seed=settings.seed)
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        batch = batches.next_batch()  # (B, T+1)
        logits = engine(input_ids=batch[:, :-1]).logits  # (B, T, vocab)
        loss = F.cross_entropy(logits.float().reshape(-1, shape.vocab_size), batch[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())  # read every step, as the trainer and the plain loop do
        times.append(time.perf_counter() - start)
    steady = times[warmup:]
    tokens = settings.micro_batch_size * seq_len
    return {"tokens_per_s": tokens * len(steady) / sum(steady), "step_time_s_median": statistics.median(steady),
            "losses": losses, "zero_stage": int(engine.zero_optimization_stage())}


def run_bare(config: dict, data: tuple[Path, Path], steps: int, warmup: int, variant: str, work: Path,
             deepspeed_overrides: dict | None = None) -> dict:
    """`bare_deepspeed_loop` in a fresh interpreter (this script with --bare), as each trainer run is one."""
    job = work / f"bare-{variant}.json"
    job.write_text(json.dumps({"config": config, "data": [str(path) for path in data], "steps": steps,
                               "warmup": warmup, "variant": variant, "overrides": deepspeed_overrides or {}}))
    log = job.with_suffix(".log")
    with open(log, "w") as handle:
        code = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--bare", str(job)], cwd=ROOT,
                              stdout=handle, stderr=subprocess.STDOUT).returncode
    if code:
        raise SystemExit(f"bare DeepSpeed loop failed, see {log}")
    return json.loads(job.with_suffix(".out.json").read_text())


def bare_main(job: Path) -> None:
    """The child of `run_bare`: one bare DeepSpeed loop, its result written beside the job."""
    spec = json.loads(job.read_text())
    result = bare_deepspeed_loop(spec["config"], tuple(Path(path) for path in spec["data"]), spec["steps"],
                                 spec["warmup"], spec["variant"], spec["overrides"])
    job.with_suffix(".out.json").write_text(json.dumps(result))


def median_ratio(rounds: list[dict], numerator: str, denominator: str) -> tuple[float, list[float]]:
    per_round = [r[numerator]["tokens_per_s"] / r[denominator]["tokens_per_s"] for r in rounds]
    return statistics.median(per_round), per_round


def measure(config: dict, data: tuple[Path, Path], args, work: Path) -> dict:
    """Rounds of plain, then per variant bare DeepSpeed and the trainer, each in turn; the ratios per variant."""
    loops = {"plain": lambda: run_reference(config, data, args.steps, args.warmup, False, True, work)}
    for variant in args.variants:
        loops[f"bare-{variant}"] = functools.partial(run_bare, config, data, args.steps, args.warmup, variant, work)
        if args.bare_also:
            loops[f"bare-{variant}-also"] = functools.partial(run_bare, config, data, args.steps, args.warmup,
                                                              variant, work, args.bare_also)
        loops[variant] = functools.partial(run_trainer, config, data, args.steps, args.warmup, variant, False, work)
    rounds = [{name: loops[name]() for name in round_order(list(loops), index)} for index in range(args.repeats)]
    result = {"order_per_round": [list(r) for r in rounds],
              "plain_tokens_per_s": [r["plain"]["tokens_per_s"] for r in rounds], "variants": {}}
    for variant in args.variants:
        figures = {}
        for name, (numerator, denominator) in {"trainer_to_bare": (variant, f"bare-{variant}"),
                                               "bare_to_plain": (f"bare-{variant}", "plain"),
                                               "trainer_to_plain": (variant, "plain")}.items():
            figures[name], figures[f"{name}_per_round"] = median_ratio(rounds, numerator, denominator)
        result["variants"][variant] = {
            "zero_stage": rounds[0][f"bare-{variant}"]["zero_stage"],
            "bare_tokens_per_s": [r[f"bare-{variant}"]["tokens_per_s"] for r in rounds],
            "trainer_tokens_per_s": [r[variant]["tokens_per_s"] for r in rounds],
            # the same model, data, seed and ds_config: the two DeepSpeed loops' losses agree
            "bare_losses": rounds[0][f"bare-{variant}"]["losses"], **figures}
        if args.bare_also:
            also, also_per_round = median_ratio(rounds, f"bare-{variant}-also", f"bare-{variant}")
            result["variants"][variant]["bare_also"] = {
                "train_deepspeed": args.bare_also, "ratio_to_bare": also, "ratio_to_bare_per_round": also_per_round,
                "same_losses": rounds[0][f"bare-{variant}-also"]["losses"] == rounds[0][f"bare-{variant}"]["losses"]}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default="bench-results/zero-overhead.json")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=["zero1", "zero2"], choices=DEEPSPEED_VARIANTS)
    parser.add_argument("--bare-also", type=json.loads, default=None, metavar="JSON",
                        help="also run the bare loop with these train.deepspeed keys merged in (e.g. a setting's "
                             "previous value) and report its tokens/s ÷ the bare loop's")
    args = parser.parse_args()
    config, *data = build_data()
    work = Path(tempfile.mkdtemp(prefix="bench-zero-overhead-"))
    load_start = list(os.getloadavg())
    result = {"what": "1 rank, CPU, fp32, compile off: the trainer vs a bare DeepSpeed loop (same ds_config, model, "
                      "data) vs the plain hand-written loop; medians of per-round tokens/s ratios",
              **measure(config, tuple(data), args, work),
              "steps": args.steps, "warmup_steps": args.warmup, "repeats": args.repeats,
              "load_average_start": load_start, "load_average_end": list(os.getloadavg())}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--bare"]:
        bare_main(Path(sys.argv[2]))
    else:
        main()
