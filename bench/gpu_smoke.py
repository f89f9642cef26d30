"""GPU smoke test (`make gpu-smoke`) and its CPU twin (`make gpu-smoke-cpu`): the training paths end to end on one
device, in a few minutes, without Snakemake.

Runs, each at world size 1 over the device's collective backend (nccl on CUDA, gloo on CPU):
1. default-setup: what the default config runs on the source articles' box, derived, not written down: the
   pre-flight (memory_fit.fit_run) on config.yaml's settings for the machine its benchmark.device_memory_gib,
   host_memory_gib and disk_gib describe, whatever GPU this machine has. Its layout (engine, ZeRO stage, offloads,
   activation checkpointing, precision) runs on the smoke's smaller model and micro-batch; today ZeRO-2 with the
   optimizer offloaded to the CPU (DeepSpeed's CPU Adam, pinned host buffers) and activation checkpointing, fp16.
2. zero3-offload: DeepSpeed ZeRO-3 with the optimizer offloaded to the CPU in fp16 with dynamic loss scaling
   (stage3.py's host-side gradient buffers and overflow check).
3. zero2-large: DeepSpeed ZeRO-2 in bf16 on the larger model: tokens/s and MFU at a size that loads the device.
4. zero2-loss-scaling: DeepSpeed ZeRO-2 in fp16 with dynamic loss scaling (loss scale and skipped steps).
5. ddp: PyTorch DDP with fp16 autocast and GradScaler.
6. fsdp: PyTorch FSDP2 with a bf16 mixed-precision policy.
7. zero2-large-compile: zero2-large with train.compile (torch.compile per decoder block, inductor): the JSON's
   `compile` compares its steady-state tokens/s with zero2-large's and gives its compile time and break-even steps.
On CPU fp16 has no loss scaling (DeepSpeed's CPU accelerator lacks it), so those runs use bf16, and every bf16 run uses
fp32 where the CPU only emulates bf16 (no AVX512-bf16 or AMX: devices.cpu_bf16_is_native); everything else is the
same steps. The JSON's wall_s is the smoke's own time. Every run goes through the launcher with a plan file, exactly as
rule pretrain starts it, on a small corpus built from the Python standard library (no network).

Each run reports tokens/s, MFU against the device's peak (CUDA: the GPU's datasheet figure from
pretrain_bench.train.models.flops, or a measured matmul where the GPU is not in the table; CPU: a bf16 matmul measured
on this machine's cores; the JSON names which), the peak memory measured (CUDA: torch's allocator peak; CPU: the rank's
peak RSS) and the memory model's prediction of it.

Needs no CUDA toolkit: DeepSpeed's CUDA kernels are not used (torch's AdamW stands in for FusedAdam). g++ is needed
only for the runs that offload (default-setup, zero3-offload), whose CPU Adam is a C++ op DeepSpeed compiles on
first use (`make install` builds it ahead).

With --device cuda on a machine without GPUs it writes the reason it skipped and exits 0; where nvidia-smi lists GPUs
that torch cannot use (a CPU-only wheel on a GPU box), it fails: exit 1, the reason in the JSON.

Usage: python bench/gpu_smoke.py OUT.json [--device cuda|cpu] [--size gpu|cpu|tiny] [--work DIR] [--steps N]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Size:
    """How big the smoke's data and models are."""

    large: str  # model preset of the default-setup, zero3-offload and zero2-large runs
    small: str  # model preset of the other runs
    seq_len: int
    micro_batch_size: int
    steps: int
    timing_warmup: int  # steps left out of tokens/s (warmup_timing_steps)
    vocab_size: int  # the tokenizer's; the llama presets have 32,000 rows whatever it is
    corpus_bytes: int
    tokenizer_bytes: int


SIZES = {
    # minutes on one GPU; llama-1b's host Adam step (default-setup) is about a second on a server's cores
    "gpu": Size("llama-1b", "llama-125m", 512, 8, 30, 5, 32000, 20_000_000, 5_000_000),
    # under 5 minutes on 2 shared cores (docs/benchmarks/2026-12-04-gpu-smoke-cpu.md): the 125M-parameter model for
    # the runs that size memory and throughput, the tiny one for the engines' own paths, short sequences
    "cpu": Size("llama-125m", "tiny", 64, 2, 5, 2, 32000, 2_000_000, 1_000_000),
    # seconds: the test suite's form
    "tiny": Size("tiny", "tiny", 64, 2, 4, 1, 1024, 1_000_000, 300_000),
}

# (name, which model, train settings as run on CUDA). Every run is at world size 1; default-setup's settings are
# the default config's pre-flight choice (default_setup).
RUNS = [
    ("zero3-offload", "large", {"engine": "deepspeed", "zero_stage": 3, "offload_optimizer": "cpu",
                                "precision": "fp16"}),
    ("zero2-large", "large", {"engine": "deepspeed", "zero_stage": 2, "precision": "bf16"}),
    ("zero2-loss-scaling", "small", {"engine": "deepspeed", "zero_stage": 2, "precision": "fp16"}),
    ("ddp", "small", {"engine": "ddp", "zero_stage": 0, "precision": "fp16"}),
    ("fsdp", "small", {"engine": "fsdp", "zero_stage": 3, "precision": "bf16"}),
    ("zero2-large-compile", "large", {"engine": "deepspeed", "zero_stage": 2, "precision": "bf16", "compile": True}),
]
# (compile off, compile on): the pair of runs the JSON's `compile` compares
COMPILE_PAIR = ("zero2-large", "zero2-large-compile")


# What default-setup takes from the default config's choice; the micro-batch and accumulation are the smoke's own.
LAYOUT_KEYS = ("engine", "zero_stage", "offload_optimizer", "offload_param", "activation_checkpointing", "precision")


def default_setup(config: dict) -> tuple[dict, str]:
    """(layout, why): the train layout (LAYOUT_KEYS) the pre-flight chooses for `config`'s main run on the
    articles' box, and the pre-flight's one-line summary of that choice."""
    from pretrain_bench.config.schema import BenchSettings
    from pretrain_bench.train.memory.fit import fit_run
    from pretrain_bench.train.memory.model import planned_budget
    from pretrain_bench.train.settings import TrainSettings
    from pretrain_bench.workflow.experiment import plan_config

    train = {**config["train"], "device": "cuda"}  # the articles' box has GPUs, whatever train.device says
    chosen, record = fit_run(plan_config({**config, "train": train}), TrainSettings.from_config(train),
                             what="the default config's main run",
                             budget=planned_budget(BenchSettings.from_config(config),
                                                   why="the source articles' box, whatever GPU runs the smoke"))
    return {key: getattr(chosen, key) for key in LAYOUT_KEYS}, record["summary"]


def default_config() -> dict:
    """config.yaml as the workflow sees it (the schema's defaults filled in): the default experiment."""
    from pretrain_bench.workflow.experiment import load_config

    return load_config(ROOT / "config.yaml")


def device_settings(train: dict, device: str, native_bf16: bool | None = None) -> dict:
    """A run's train settings on `device`: on CPU gloo, and bf16 where CUDA runs fp16 (no CPU loss scaling), or fp32
    where this CPU only emulates bf16 (`native_bf16`, by default devices.cpu_bf16_is_native): emulated bf16 ran the
    twin at 2 tokens/s on 2 AVX2 cores, past 25 minutes, testing nothing fp32 does not."""
    if device == "cuda":
        return {**train, "comm_backend": "nccl"}
    precision = "bf16" if train["precision"] == "fp16" else train["precision"]
    if precision == "bf16":
        from pretrain_bench.core.devices import cpu_bf16_is_native

        if not (cpu_bf16_is_native() if native_bf16 is None else native_bf16):
            precision = "fp32"
    return {**train, "comm_backend": "gloo", "precision": precision}


def build_data(work: Path, size: Size) -> tuple[Path, Path]:
    """Corpus, tokenizer and shards, as the pipeline's first stages make them."""
    from pretrain_bench.data.corpus import build_corpus
    from pretrain_bench.data.shards import build_index, encode_shard
    from pretrain_bench.data.tokenizer import train_tokenizer

    corpus, tokenizer, shards = work / "corpus", work / "tokenizer", work / "shards"
    if not (shards / "index.json").is_file():
        build_corpus([{"uri": "builtin://python-stdlib"}], corpus, max_bytes=size.corpus_bytes, min_chars=32,
                     dedup=True, val_fraction=0.02, encoding_errors="replace", cache_dir=work / "cache")
        train_tokenizer(corpus / "train.jsonl", tokenizer, vocab_size=size.vocab_size,
                        train_bytes=size.tokenizer_bytes, path=None)
        sidecars = []
        for split in ("train", "val"):
            meta = shards / f"{split}-00000.json"
            encode_shard(corpus / f"{split}.jsonl", tokenizer, shards / f"{split}-00000.bin", meta, split=split,
                         index=0, count=1)
            sidecars.append(meta)
        build_index(sidecars, shards / "index.json")
    return shards / "index.json", tokenizer


def smoke_config(name: str, preset: str, train: dict, size: Size, device: str) -> dict:
    """config.yaml with one run's settings: one rank on `device`, the memory model's verdict kept as asked."""
    config = default_config()
    config["name"] = f"gpu-smoke-{name}"
    config["model"].update(preset=preset, seq_len=size.seq_len, overrides={}, init_from=None)
    config["train"].update(train, gpus=1, nodes=1, device=device, global_batch_size=None, grad_accum_steps=1,
                           micro_batch_size=size.micro_batch_size, max_steps=size.steps, max_tokens=None,
                           warmup_steps=1, warmup_timing_steps=size.timing_warmup, eval_every=None,
                           memory_fit="strict")
    config["tokenizer"].update(vocab_size=size.vocab_size, path=None)
    config["benchmark"]["force"] = True  # the smoke measures the model's prediction; it does not plan around it
    return config


def predicted_memory_bytes(estimate: dict, device: str) -> int:
    """What the memory model predicts the run's measured peak to be. CUDA: the device memory torch's allocator
    counts (the CUDA context is the model's runtime term, outside the allocator). CPU: the rank's RSS, where the
    device and the host are one memory, so offloaded states count too."""
    if device == "cuda":
        return estimate["per_rank"] - estimate["runtime"]
    return estimate["per_rank"] + estimate["host_states"]


def run_one(name: str, preset: str, train: dict, size: Size, device: str, peak: dict, index: Path,
            tokenizer: Path, work: Path) -> dict:
    """Plan and launch one run; its figures, or its exit code and log tail when it failed."""
    from pretrain_bench.train.plan import make_plan
    from pretrain_bench.train.run_summary import RunSummary
    from pretrain_bench.workflow.experiment import plan_config

    config = smoke_config(name, preset, train, size, device)
    run_dir = work / name
    plan = make_plan(plan_config(config), index=index, tokenizer=tokenizer, out_dir=run_dir / "out",
                     state_dir=run_dir / "state", resume=False, save_checkpoints=False, peak=peak)
    plan_path = run_dir / "plan.json"
    plan.to_json(plan_path)
    settings = plan.train
    result = {"name": name, "preset": preset, "engine": settings.engine, "zero_stage": settings.zero_stage,
              "offload_optimizer": settings.offload_optimizer, "offload_param": settings.offload_param,
              "activation_checkpointing": settings.activation_checkpointing, "precision": settings.precision,
              "comm_backend": settings.comm_backend, "device": device, "compile": settings.compile}
    started = time.perf_counter()
    log = run_dir / "train.log"
    with open(log, "w") as out:
        code = subprocess.call([sys.executable, str(ROOT / "workflow_scripts" / "launch.py"), "--ranks", "1",
                                "--plan", str(plan_path), "--lock-dir", str(work / "slots")],
                               stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    result.update(exit_code=code, wall_s=time.perf_counter() - started)
    if code:
        return {**result, "log_tail": log.read_text()[-3000:]}
    summary = RunSummary.read(run_dir / "out" / "summary.json")
    estimate = plan.memory_fit["estimate"]
    measured = summary.peak_mem_bytes[0]
    predicted = predicted_memory_bytes(estimate, device)
    records = [json.loads(line) for line in (run_dir / "out" / "metrics.jsonl").read_text().splitlines()]
    result.update(
        tokens_per_s=summary.tokens_per_s, mfu=summary.mfu, mfu_note=summary.mfu_note,
        precision_note=summary.precision_note,
        peak_flops_per_rank=summary.peak_flops_per_rank, peak_flops_source=summary.peak_flops_source,
        step_time_s=summary.step_time_s, loss=summary.loss, parameters=summary.model["parameters"],
        peak_memory_bytes=measured, peak_memory_kind=summary.peak_mem_kind,
        peak_memory_allocated_bytes=(summary.peak_mem_allocated_bytes or [None])[0],
        predicted_memory_bytes=predicted, measured_over_predicted=measured / predicted,
        memory_terms={k: estimate[k] for k in ("params", "grads", "optimizer", "activations", "buffers", "init",
                                               "runtime", "host_states")},
        skipped_steps=summary.skipped_steps, loss_scale=[r.get("loss_scale") for r in records][:10],
        compile_time_s=summary.compile["time_s"] if summary.compile else None,
        attn_implementation=summary.model["attn_implementation"],
    )
    return result


def compile_comparison(runs: list[dict]) -> dict | None:
    """Steady-state tokens/s with train.compile off and on (COMPILE_PAIR), the speedup, the compile time, and the
    steps after which compiling has paid for itself (compile seconds ÷ seconds saved per step); None unless both
    ran."""
    by_name = {run["name"]: run for run in runs}
    off, on = (by_name.get(name) for name in COMPILE_PAIR)
    if not (off and on and off.get("tokens_per_s") and on.get("tokens_per_s")):
        return None
    saved = off["step_time_s"]["median"] - on["step_time_s"]["median"]
    return {"runs": list(COMPILE_PAIR), "tokens_per_s_off": off["tokens_per_s"], "tokens_per_s_on": on["tokens_per_s"],
            "speedup": on["tokens_per_s"] / off["tokens_per_s"], "compile_time_s": on["compile_time_s"],
            "break_even_steps": on["compile_time_s"] / saved if saved > 0 else None}


def result_line(run: dict) -> str:
    """One line per run for the terminal; every figure may be missing (a failed run, an MFU not reported)."""
    text = f"{run['name']} ({run['precision']}, ZeRO-{run['zero_stage']}, {run['engine']}, {run['comm_backend']}): "
    if run.get("error"):
        return text + f"not run: {run['error']}"
    if run["exit_code"]:
        return text + f"exit {run['exit_code']}, see {run['name']}/train.log"
    mfu = f"{run['mfu']:.1%}" if run["mfu"] is not None else f"n/a ({run['mfu_note']})"
    return text + (f"{run['tokens_per_s']:,.0f} tokens/s, MFU {mfu}, peak {run['peak_memory_bytes'] / 2**30:.2f} GiB "
                   f"vs predicted {run['predicted_memory_bytes'] / 2**30:.2f} GiB "
                   f"(×{run['measured_over_predicted']:.2f})")


# The device's peak and description, taken in a child process: a CUDA context and the peak matmul's cached blocks
# in this process would hold GPU memory through every run.
_MACHINE_FACTS = """
import json, sys
from pathlib import Path
from pretrain_bench.core.devices import hardware_description
from pretrain_bench.bench.peak import measure_hardware_peak
# the machine's one peak, as rule measure_peak takes it: a GPU's 16-bit figure, a CPU's faster of fp32 and bf16
peak = measure_hardware_peak(sys.argv[2], lock_dir=Path(sys.argv[3]))
print(json.dumps({"peak": peak, "hardware": hardware_description(peak["device"])}))
"""


def machine_facts(device: str, work: Path) -> dict:
    """{"peak": rule measure_peak's record for this device, "hardware": its description}."""
    proc = subprocess.run([sys.executable, "-c", _MACHINE_FACTS, str(ROOT / "workflow_scripts"), device,
                           str(work / "slots")], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"gpu-smoke: measuring the {device}'s peak failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def smoke(out: Path, device: str, size: Size, work: Path) -> int:
    """Every run on `device`, the JSON rewritten after each; 0 when all ran."""
    from pretrain_bench.train.settings import ConfigError

    started = time.perf_counter()
    work.mkdir(parents=True, exist_ok=True)
    index, tokenizer = build_data(work, size)
    facts = machine_facts(device, work)
    peak = facts["peak"]
    print(f"gpu-smoke on {device}: peak {peak['peak_flops'] / 1e12:,.3g} TFLOP/s ({peak['peak_source']})")
    report = {"device": device, "hardware": facts["hardware"], "peak": peak, "size": vars(size), "runs": [],
              "compile": None, "wall_s": None}
    try:
        layout, why = default_setup(default_config())
        report["default_setup"] = {"layout": layout, "pre_flight": why}
        print(f"gpu-smoke default-setup: config.yaml's pre-flight for the source articles' box: {why}")
        runs = [("default-setup", "large", layout), *RUNS]
    except ConfigError as error:  # nothing the default could run: the other runs still go
        report["default_setup"] = {"layout": None, "pre_flight": str(error)}
        print(f"gpu-smoke default-setup: not run, config.yaml's pre-flight refused it: {error}")
        runs = RUNS
    for name, model, train in runs:
        preset = size.large if model == "large" else size.small
        run = run_or_record(name, preset, device_settings(train, device), size, device, peak, index, tokenizer, work)
        report["runs"].append(run)
        report["compile"] = compile_comparison(report["runs"])
        report["wall_s"] = time.perf_counter() - started  # the smoke's own time so far: data, peak and runs
        out.write_text(json.dumps(report, indent=2))
        print(result_line(run), flush=True)
    for note in dict.fromkeys(run["precision_note"] for run in report["runs"] if run.get("precision_note")):
        print(f"gpu-smoke note: {note}")  # bf16 emulated on this CPU: its tokens/s and MFU are the emulation's
    if report["compile"]:
        c = report["compile"]
        print(f"gpu-smoke compile: {c['tokens_per_s_off']:,.0f} tokens/s off, {c['tokens_per_s_on']:,.0f} on "
              f"(×{c['speedup']:.2f}), {c['compile_time_s']:.1f} s compiling"
              + (f", paid back after {c['break_even_steps']:,.0f} steps" if c["break_even_steps"] else
                 ", never paid back"))
    print(f"gpu-smoke: {report['wall_s']:.0f} s in all")
    ran = report["default_setup"]["layout"] is not None and all(run["exit_code"] == 0 for run in report["runs"])
    return 0 if ran else 1


def run_or_record(name: str, preset: str, train: dict, size: Size, device: str, *args) -> dict:
    """run_one, or, where planning or reading the results raised, a record of the error: one run's refusal or fault
    must not cost a GPU session the runs after it."""
    try:
        return run_one(name, preset, train, size, device, *args)
    except Exception as error:
        return {"name": name, "preset": preset, "device": device, "offload_optimizer": "none", **train,
                "exit_code": None, "error": f"{type(error).__name__}: {error}"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--size", choices=sorted(SIZES), help="data and model sizes (default: the device's)")
    parser.add_argument("--work", type=Path, help="working folder (default: beside OUT, named after it)")
    parser.add_argument("--steps", type=int, help="steps per run (default: the size's)")
    args = parser.parse_args(argv)
    size = SIZES[args.size or ("gpu" if args.device == "cuda" else "cpu")]
    if args.steps:
        size = Size(**{**vars(size), "steps": args.steps})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda":
        import torch

        from pretrain_bench.core.devices import gpu_names

        if not torch.cuda.is_available():
            listed = gpu_names()
            if listed:  # a GPU box where this torch cannot use them: a skip here would be a false pass
                reason = (f"nvidia-smi lists {len(listed)} GPU(s) ({', '.join(dict.fromkeys(listed))}) but torch "
                          f"{torch.__version__} cannot use them (torch.cuda.is_available() is False; a CPU-only "
                          "wheel, or a driver older than its CUDA): install torch's CUDA build")
                print(f"gpu-smoke: FAILED: {reason}", file=sys.stderr)
                args.out.write_text(json.dumps({"failed": reason}, indent=2))
                return 1
            reason = f"no CUDA device visible (torch {torch.__version__}, torch.cuda.is_available() is False)"
            print(f"gpu-smoke: skipped: {reason}")
            args.out.write_text(json.dumps({"skipped": reason}, indent=2))
            return 0
    return smoke(args.out, args.device, size, args.work or args.out.with_suffix(""))


if __name__ == "__main__":
    sys.exit(main())
