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
Then the sections the runs above do not take:
8. zero2-2-ranks: ZeRO-2 at world size 2 (NCCL on a machine with 2+ GPUs; with one GPU it is recorded as not
   applicable, neither a pass nor a failure; the CPU twin runs 2 gloo ranks).
9. gloo-on-cuda: comm_backend gloo with CUDA tensors (a matrix axis); on CPU every run is gloo already, so the twin
   records it as not applicable.
10. checkpoint-zero3, checkpoint-fsdp: save → resume → export. N steps uninterrupted, N/2 steps then resumed to N
   from the N/2 checkpoint, under a constant learning rate; the per-step losses compared (bit for bit on CPU, within
   LOSS_TOLERANCE on CUDA); the checkpoint exported by rule export_final's script and loaded with transformers: its
   logits against the trained model's, its held-out loss against the engine's.
Every run also records each rank's peak host RSS (on CUDA too) against the memory model's host prediction
(HOST_PREDICTION). The JSON's `sections` lists every section with its status (pass | fail | not_applicable), reason,
tokens/s, MFU, and device and host memory measured and predicted; `passed` and `failed_sections` sum them up, and the
smoke exits 1 when any section failed.
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

# The sections after RUNS, each a path the world-size-1 runs above do not take (see the module's docstring).
# (name, which model, train settings as run on CUDA, ranks): ZeRO-2 at world size 2 over the device's backend
MULTI_RANK = ("zero2-2-ranks", "small", {"engine": "deepspeed", "zero_stage": 2, "precision": "bf16"}, 2)
# (name, which model, train settings as run on CUDA): comm_backend gloo with the tensors on the GPU
GLOO_ON_CUDA = ("gloo-on-cuda", "small", {"engine": "deepspeed", "zero_stage": 2, "precision": "bf16",
                                          "comm_backend": "gloo"})
# (name, train settings as run on CUDA): save, resume and export, on the small model
CHECKPOINT_SECTIONS = [
    ("checkpoint-zero3", {"engine": "deepspeed", "zero_stage": 3, "precision": "fp16"}),
    ("checkpoint-fsdp", {"engine": "fsdp", "zero_stage": 3, "precision": "bf16"}),
]
CHECKPOINT_MAX_STEPS = 8  # N of a checkpoint section: the size's steps, at most this, even
EVAL_SAMPLES = 4  # val samples of the held-out loss the engine and the export both compute
# Resumed vs uninterrupted per-step losses, max |Δ|: equal bit for bit on CPU (deterministic kernels); on CUDA
# atomics in the backward pass (embedding, attention) make two uninterrupted runs differ already, by far less than
# this (0.1 % of a loss of 10), while a resume that lost the optimizer's moments, the loss scale or the data position
# moves the loss by more.
LOSS_TOLERANCE = {"cpu": 0.0, "cuda": 1e-2}
# The export (AutoModelForCausalLM, fp32) vs the class the trainer built with the checkpoint's fp32 weights, both on
# the CPU: the same maths through another module, max |Δ logits|
LOGITS_TOLERANCE = 1e-4
# Held-out loss (nats) of the export (fp32) vs the engine's own at the last step, in the precision it trained in
HELDOUT_TOLERANCE = {"fp32": 1e-3, "bf16": 5e-2, "fp16": 5e-2}
# The figures every section's entry in the JSON's `sections` carries (None where the section ran nothing)
SECTION_FIGURES = ("world_size", "tokens_per_s", "mfu", "peak_memory_bytes", "predicted_memory_bytes",
                   "measured_over_predicted", "peak_host_memory_bytes", "predicted_host_memory_bytes",
                   "host_measured_over_predicted")


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


def smoke_config(name: str, preset: str, train: dict, size: Size, device: str, ranks: int = 1) -> dict:
    """config.yaml with one run's settings: `ranks` ranks (one unless a section asks more) on `device`, the memory
    model's verdict kept as asked."""
    config = default_config()
    config["name"] = f"gpu-smoke-{name}"
    config["model"].update(preset=preset, seq_len=size.seq_len, overrides={}, init_from=None)
    config["train"].update(train, gpus=ranks, nodes=1, device=device, global_batch_size=None, grad_accum_steps=1,
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


# What predicted_host_bytes predicts, as the JSON's host_memory_prediction says it.
HOST_PREDICTION = {
    "cuda": "host_states + CUDA_RANK_HOST_BYTES (memory/model.py: the offloaded states and pinned staging buffers, "
            "plus a CUDA rank's host baseline, the per-rank term its host-RAM check uses)",
    "cpu": "per_rank + host_states (the host is the device: the same prediction as the device memory's)",
}


def predicted_host_bytes(estimate: dict, device: str) -> int:
    """What the memory model predicts a rank's peak RSS to be. CUDA: the host terms of memory/model.py's judge, per
    rank: the offloaded states and their pinned staging buffers (`host_states`, 0 without offload) plus
    CUDA_RANK_HOST_BYTES, its baseline for the host RAM of a CUDA rank (the CUDA libraries, pinned staging); the
    model has no other host term (it builds the model on the device, so no host copy of the weights). CPU: the
    device memory's prediction, the host being the device."""
    if device == "cuda":
        from pretrain_bench.train.memory.model import CUDA_RANK_HOST_BYTES

        return estimate["host_states"] + CUDA_RANK_HOST_BYTES
    return predicted_memory_bytes(estimate, device)


def run_one(name: str, preset: str, train: dict, size: Size, device: str, peak: dict, index: Path,
            tokenizer: Path, work: Path, *, ranks: int = 1, extra: dict | None = None, run_dir: Path | None = None,
            state_dir: Path | None = None, resume: bool = False, save_checkpoints: bool = False) -> dict:
    """Plan and launch one run; its figures, or its exit code and log tail when it failed. `extra`: train settings
    beyond the size's (a checkpoint section's steps and schedule); `run_dir` (default work/name) holds its plan, log
    and outputs, `state_dir` (default run_dir/state) its checkpoints; resume and save_checkpoints go to make_plan as
    rule pretrain passes them."""
    from pretrain_bench.train.metrics import one_record_per_step, peak_memory_per_rank
    from pretrain_bench.train.plan import make_plan
    from pretrain_bench.train.run_summary import RunSummary
    from pretrain_bench.workflow.experiment import plan_config

    config = smoke_config(name, preset, train, size, device, ranks)
    config["train"].update(extra or {})
    run_dir = run_dir or work / name
    plan = make_plan(plan_config(config), index=index, tokenizer=tokenizer, out_dir=run_dir / "out",
                     state_dir=state_dir or run_dir / "state", resume=resume, save_checkpoints=save_checkpoints,
                     peak=peak)
    plan_path = run_dir / "plan.json"
    plan.to_json(plan_path)
    settings = plan.train
    result = {"name": name, "preset": preset, "engine": settings.engine, "zero_stage": settings.zero_stage,
              "offload_optimizer": settings.offload_optimizer, "offload_param": settings.offload_param,
              "activation_checkpointing": settings.activation_checkpointing, "precision": settings.precision,
              "comm_backend": settings.comm_backend, "device": device, "compile": settings.compile,
              "world_size": settings.world_size}
    started = time.perf_counter()
    log = run_dir / "train.log"
    with open(log, "w") as out:
        code = subprocess.call([sys.executable, str(ROOT / "workflow_scripts" / "launch.py"), "--ranks", str(ranks),
                                "--plan", str(plan_path), "--lock-dir", str(work / "slots")],
                               stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    result.update(exit_code=code, wall_s=time.perf_counter() - started, log=str(log))
    if code:
        return {**result, "log_tail": log.read_text()[-3000:]}
    summary = RunSummary.read(run_dir / "out" / "summary.json")
    estimate = plan.memory_fit["estimate"]
    measured = max(peak for peak in summary.peak_mem_bytes if peak is not None)  # the largest rank's
    predicted = predicted_memory_bytes(estimate, device)
    records = [json.loads(line) for line in (run_dir / "out" / "metrics.jsonl").read_text().splitlines()]
    # each rank's peak RSS, from metrics.jsonl (the trainer records it every step, on CUDA too)
    host = peak_memory_per_rank(one_record_per_step(records), summary.world_size, "peak_host_bytes")
    host_measured = max((peak for peak in host if peak is not None), default=None)
    host_predicted = predicted_host_bytes(estimate, device)
    result.update(
        tokens_per_s=summary.tokens_per_s, mfu=summary.mfu, mfu_note=summary.mfu_note,
        precision_note=summary.precision_note,
        peak_flops_per_rank=summary.peak_flops_per_rank, peak_flops_source=summary.peak_flops_source,
        step_time_s=summary.step_time_s, loss=summary.loss, parameters=summary.model["parameters"],
        peak_memory_bytes=measured, peak_memory_kind=summary.peak_mem_kind,
        peak_memory_allocated_bytes=(summary.peak_mem_allocated_bytes or [None])[0],
        predicted_memory_bytes=predicted, measured_over_predicted=measured / predicted,
        peak_memory_bytes_per_rank=summary.peak_mem_bytes,
        peak_host_memory_bytes=host_measured, peak_host_memory_bytes_per_rank=host,
        predicted_host_memory_bytes=host_predicted,
        host_measured_over_predicted=host_measured / host_predicted if host_measured else None,
        host_memory_prediction=HOST_PREDICTION[device], resumed_from_step=summary.resumed_from_step,
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


def run_status(run: dict) -> dict:
    """A run's {"status", "reason"}: "pass" when it ran and reported its throughput and its host memory, else "fail"
    and why (a section that does not apply here is recorded by not_applicable instead)."""
    if run.get("error"):
        return {"status": "fail", "reason": f"not run: {run['error']}"}
    if run.get("exit_code"):
        return {"status": "fail", "reason": f"exit {run['exit_code']}, see {run.get('log') or run['name']}"}
    if not run.get("tokens_per_s"):
        return {"status": "fail", "reason": "no steady-state tokens/s in its summary.json"}
    if not run.get("peak_host_memory_bytes"):
        return {"status": "fail", "reason": "no peak host memory (peak_host_bytes) in its metrics.jsonl"}
    return {"status": "pass", "reason": None}


def not_applicable(name: str, preset: str, train: dict, device: str, ranks: int, reason: str) -> dict:
    """The record of a run-like section that does not apply on this machine: neither a pass nor a failure."""
    return {"name": name, "kind": "run", "preset": preset, "device": device, "world_size": ranks,
            "offload_optimizer": "none", **train, "exit_code": None, "status": "not_applicable", "reason": reason}


def multi_rank_reason(device: str, gpu_count: int, ranks: int) -> str | None:
    """Why the multi-rank section does not apply here (None: it does). CPU: gloo ranks always apply."""
    if device == "cuda" and gpu_count < ranks:
        return f"{gpu_count} GPU" + ("s" if gpu_count != 1 else "") + f" (a {ranks}-rank nccl run needs {ranks})"
    return None


def gloo_on_cuda_reason(device: str) -> str | None:
    """Why the gloo-on-CUDA section does not apply here (None: it does)."""
    if device != "cuda":
        return ("covered by the other runs: on CPU every run of the twin is comm_backend gloo on CPU tensors; "
                "gloo with CUDA tensors needs a GPU")
    return None


def section_summary(section: dict) -> dict:
    """A section's entry in the JSON's `sections`: its name, kind, status and reason, and SECTION_FIGURES."""
    return {"name": section["name"], "kind": section.get("kind", "run"), "status": section["status"],
            "reason": section.get("reason"), **{key: section.get(key) for key in SECTION_FIGURES}}


def verdict(sections: list[dict]) -> tuple[bool, list[str]]:
    """(passed, failed_sections): passed unless some section failed; one that does not apply fails nothing."""
    failed = [section["name"] for section in sections if section["status"] == "fail"]
    return not failed, failed


def result_line(run: dict) -> str:
    """One line per section for the terminal; every figure may be missing (a failed run, an MFU not reported)."""
    if run.get("kind") == "checkpoint":
        return checkpoint_line(run)
    text = f"{run['name']} ({run['precision']}, ZeRO-{run['zero_stage']}, {run['engine']}, {run['comm_backend']}"
    text += f", {run['world_size']} ranks): " if run.get("world_size", 1) > 1 else "): "
    if run.get("status") == "not_applicable":
        return text + f"not applicable: {run['reason']}"
    if run.get("error"):
        return text + f"not run: {run['error']}"
    if run["exit_code"]:
        return text + f"exit {run['exit_code']}, see {run['name']}/train.log"
    mfu = f"{run['mfu']:.1%}" if run["mfu"] is not None else f"n/a ({run['mfu_note']})"
    text += (f"{run['tokens_per_s']:,.0f} tokens/s, MFU {mfu}, peak {run['peak_memory_bytes'] / 2**30:.2f} GiB "
             f"vs predicted {run['predicted_memory_bytes'] / 2**30:.2f} GiB (×{run['measured_over_predicted']:.2f})")
    if run.get("peak_host_memory_bytes") and run["device"] == "cuda":  # on CPU the host is the device: said above
        text += (f", host {run['peak_host_memory_bytes'] / 2**30:.2f} GiB vs predicted "
                 f"{run['predicted_host_memory_bytes'] / 2**30:.2f} GiB (×{run['host_measured_over_predicted']:.2f})")
    if run.get("status") == "fail":
        text += f": FAILED: {run['reason']}"
    return text


def checkpoint_line(section: dict) -> str:
    """A checkpoint section's line: its verdict and the three comparisons it made."""
    text = f"{section['name']} ({section['precision']}, ZeRO-{section['zero_stage']}, {section['engine']}, " \
           f"{section['comm_backend']}): {section['steps']} steps, resumed at {section['resumed_at']}: "
    found = []
    if section.get("loss_max_abs_difference") is not None:
        found.append(f"losses resumed vs uninterrupted max |Δ| {section['loss_max_abs_difference']:.3g}")
    if section.get("logits_max_abs_difference") is not None:
        found.append(f"export logits max |Δ| {section['logits_max_abs_difference']:.3g}")
    if section.get("heldout_loss_export") is not None and section.get("heldout_loss_engine") is not None:
        found.append(f"held-out loss engine {section['heldout_loss_engine']:.4f} vs export "
                     f"{section['heldout_loss_export']:.4f}")
    verdict_text = "pass" if section["status"] == "pass" else f"FAILED: {section['reason']}"
    return text + ", ".join(found) + ("; " if found else "") + verdict_text


def checkpoint_steps(size: Size) -> int:
    """N of a checkpoint section: the size's steps, at most CHECKPOINT_MAX_STEPS, even (N/2 is whole), at least 2."""
    return max(2, min(size.steps, CHECKPOINT_MAX_STEPS) // 2 * 2)


def checkpoint_extra(steps: int, seq_len: int) -> dict:
    """The train settings of a checkpoint section's runs beyond the size's. A constant learning rate without warm-up:
    the schedule of the N/2-step run is then the N-step run's, so resuming it to N retraces the uninterrupted run (a
    cosine over N/2 steps would not). A checkpoint at N/2 and N, all kept; the held-out loss at the last step, on
    EVAL_SAMPLES val samples, for the export to match."""
    return {"lr_schedule": "constant", "warmup_steps": 0, "checkpoint_every": steps // 2, "keep_checkpoints": None,
            "eval_every": steps, "eval_tokens": EVAL_SAMPLES * seq_len}


def step_records(metrics: Path) -> list[dict]:
    """A run's metrics.jsonl records, one per step in step order."""
    from pretrain_bench.train.metrics import one_record_per_step

    return one_record_per_step([json.loads(line) for line in metrics.read_text().splitlines() if line.strip()])


def checkpoint_section(name: str, train: dict, size: Size, device: str, peak: dict, index: Path, tokenizer: Path,
                       work: Path) -> dict:
    """Save → resume → export for one engine: N steps uninterrupted, N/2 steps and then resumed to N from the
    N/2 checkpoint (max_steps raised, as a run trained further is), all with checkpoints, through the launcher as
    run_one plans them; the per-step losses of the two compared; the resumed run's checkpoint N exported by the
    export rule's script and loaded back with transformers (check_export). Its figures are the uninterrupted run's."""
    steps = checkpoint_steps(size)
    half, folder = steps // 2, work / name
    extra = checkpoint_extra(steps, size.seq_len)
    args = (size.small, train, size, device, peak, index, tokenizer, work)
    runs = {"uninterrupted": run_or_record(f"{name}-uninterrupted", *args, extra={**extra, "max_steps": steps},
                                           run_dir=folder / "uninterrupted", save_checkpoints=True),
            "first-half": run_or_record(f"{name}-first-half", *args, extra={**extra, "max_steps": half},
                                        run_dir=folder / "first-half", save_checkpoints=True)}
    if runs["first-half"]["status"] == "pass":
        runs["resumed"] = run_or_record(f"{name}-resumed", *args, extra={**extra, "max_steps": steps},
                                        run_dir=folder / "resumed", state_dir=folder / "first-half" / "state",
                                        resume=True, save_checkpoints=True)
    reference = runs["uninterrupted"]
    section = {"name": name, "kind": "checkpoint", "preset": size.small, "device": device, **train,
               "steps": steps, "resumed_at": half, "loss_tolerance": LOSS_TOLERANCE[device],
               "logits_tolerance": LOGITS_TOLERANCE, "heldout_tolerance": HELDOUT_TOLERANCE[train["precision"]],
               **{key: reference.get(key) for key in SECTION_FIGURES},
               "runs": [{"role": role, **run} for role, run in runs.items()]}
    problems = [f"the {role} run failed: {run['reason']}" for role, run in runs.items() if run["status"] != "pass"]
    if "resumed" not in runs:
        problems.append("not resumed: the first half did not finish")
    elif runs["resumed"]["status"] == "pass":
        resumed = step_records(folder / "resumed" / "out" / "metrics.jsonl")
        section["losses_resumed"] = [r["loss"] for r in resumed]
        if runs["resumed"]["resumed_from_step"] != half:
            problems.append(f"the resumed run resumed from step {runs['resumed']['resumed_from_step']}, not {half}")
        if reference["status"] == "pass":
            uninterrupted = step_records(folder / "uninterrupted" / "out" / "metrics.jsonl")
            section["losses_uninterrupted"] = [r["loss"] for r in uninterrupted]
            expected = list(range(1, steps + 1))
            if [r["step"] for r in resumed] != expected or [r["step"] for r in uninterrupted] != expected:
                problems.append(f"steps recorded: resumed {[r['step'] for r in resumed]}, uninterrupted "
                                f"{[r['step'] for r in uninterrupted]}, not 1 to {steps}")
            else:
                difference = max(abs(a["loss"] - b["loss"]) for a, b in zip(resumed, uninterrupted))
                section["loss_max_abs_difference"] = difference
                if difference > LOSS_TOLERANCE[device]:
                    problems.append(f"resumed losses differ from the uninterrupted run's by up to {difference:.3g} "
                                    f"(tolerance {LOSS_TOLERANCE[device]})")
        section["heldout_loss_engine"] = resumed[-1].get("val_loss")
        export = check_export(folder / "resumed" / "plan.json", steps, folder / "hf")
        section["export"] = export
        problems += export_problems(section, export)
    section.update(status="fail" if problems else "pass", reason="; ".join(problems) or None)
    return section


def export_problems(section: dict, export: dict) -> list[str]:
    """What the export check found wrong (check_export's record against the section's tolerances)."""
    if export.get("error"):
        return [f"export: {export['error']}"]
    section.update(logits_max_abs_difference=export["logits_max_abs_difference"],
                   heldout_loss_export=export["heldout_loss"])
    problems = []
    if not export["logits_abs_max"] > 0:
        problems.append("the trained model's logits are all zero")
    if not export["logits_max_abs_difference"] <= LOGITS_TOLERANCE:
        problems.append(f"export logits differ from the trained model's by up to "
                        f"{export['logits_max_abs_difference']:.3g} (tolerance {LOGITS_TOLERANCE})")
    engine, tolerance = section["heldout_loss_engine"], section["heldout_tolerance"]
    if engine is None:
        problems.append("no held-out loss from the engine at the last step (metrics.jsonl val_loss)")
    elif not abs(engine - export["heldout_loss"]) <= tolerance:
        problems.append(f"held-out loss of the export {export['heldout_loss']:.5f} vs the engine's {engine:.5f} "
                        f"(tolerance {tolerance})")
    return problems


# The export of a checkpoint by the export rule's own script (workflow_scripts/export_final.py, fp32) and the
# checks of what it wrote, in a child process (its models and threads stay out of the smoke's process): logits of
# the export loaded with transformers against the class the trainer built with the checkpoint's fp32 weights, on the
# first held-out sample, both on the CPU; the export's held-out loss on the slice the engine evaluated.
_EXPORT_CHECK = """
import json, sys, time
from pathlib import Path
import numpy as np
import torch
sys.path.insert(0, sys.argv[1])  # workflow_scripts: export_final.py, rule export_final's script
import export_final
from pretrain_bench.evaluate.evaluation import load_export
from pretrain_bench.train.checkpoints.checkpointer import load_fp32_state_dict
from pretrain_bench.train.heldout import HeldOutSlice
from pretrain_bench.train.models.registry import model_family
from pretrain_bench.train.plan import Plan, plan_shape

plan_path, step, target = Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
started = time.perf_counter()
export_final.main(plan_path, step, target, "fp32", torch.get_num_threads())
export_s = time.perf_counter() - started
plan = Plan.from_json(plan_path)
shape = plan_shape(plan, json.loads(Path(plan.paths.index).read_text())["vocab_size"])
model = model_family(shape).build(shape, plan.model.seq_len, plan.train.seed, "fp32", "cpu",
                                  plan.model.attn_implementation, plan.model.implementation)
model.load_state_dict(load_fp32_state_dict(Path(plan.paths.state_dir) / "checkpoints", step))
model.eval()
exported, _ = load_export(target, "cpu", "fp32")
heldout = HeldOutSlice(Path(plan.paths.index), plan.model.seq_len, 0, 1, plan.train.eval_tokens)
ids = torch.from_numpy(np.asarray(heldout.data[int(heldout.indices[0])][:-1], dtype=np.int64))[None]
with torch.no_grad():
    trained, loaded = model(input_ids=ids).logits.float(), exported(input_ids=ids).logits.float()
nll, tokens = heldout.evaluate(exported, plan.train.micro_batch_size, "cpu", shape.vocab_size)
print(json.dumps({"step": step, "export_s": export_s, "dtype": "fp32", "class": type(exported).__name__,
                  "files": sorted(p.name for p in target.iterdir()),
                  "logits_max_abs_difference": (trained - loaded).abs().max().item(),
                  "logits_abs_max": trained.abs().max().item(), "heldout_loss": nll / tokens,
                  "heldout_samples": heldout.samples}))
"""


def check_export(plan_path: Path, step: int, target: Path) -> dict:
    """Export checkpoint `step` of the run planned at `plan_path` to `target` and check it (_EXPORT_CHECK): its
    figures, or {"error": ...} with the child's last lines."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _EXPORT_CHECK, str(ROOT / "workflow_scripts"), str(plan_path),
                           str(step), str(target)], capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - started
    if proc.returncode:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-1500:]}", "wall_s": wall}
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "path": str(target), "wall_s": wall}


# The device's peak and description, taken in a child process: a CUDA context and the peak matmul's cached blocks
# in this process would hold GPU memory through every run.
_MACHINE_FACTS = """
import json, sys
from pathlib import Path
from pretrain_bench.core.devices import hardware_description
from pretrain_bench.bench.peak import measure_hardware_peak
# the machine's one peak, as rule measure_peak takes it: a GPU's 16-bit figure, a CPU's faster of fp32 and bf16
peak = measure_hardware_peak(sys.argv[2], lock_dir=Path(sys.argv[3]))
gpus = 0
if sys.argv[2] == "cuda":
    import torch
    gpus = torch.cuda.device_count()
print(json.dumps({"peak": peak, "hardware": hardware_description(peak["device"]), "gpu_count": gpus}))
"""


def machine_facts(device: str, work: Path) -> dict:
    """{"peak": rule measure_peak's record for this device, "hardware": its description, "gpu_count": the GPUs
    torch sees (0 on CPU)}."""
    proc = subprocess.run([sys.executable, "-c", _MACHINE_FACTS, str(ROOT / "workflow_scripts"), device,
                           str(work / "slots")], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"gpu-smoke: measuring the {device}'s peak failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def smoke(out: Path, device: str, size: Size, work: Path) -> int:
    """Every section on `device`, the JSON rewritten after each; 0 unless a section failed."""
    from pretrain_bench.train.settings import ConfigError

    started = time.perf_counter()
    work.mkdir(parents=True, exist_ok=True)
    index, tokenizer = build_data(work, size)
    facts = machine_facts(device, work)
    peak = facts["peak"]
    print(f"gpu-smoke on {device}: peak {peak['peak_flops'] / 1e12:,.3g} TFLOP/s ({peak['peak_source']})")
    report = {"device": device, "hardware": facts["hardware"], "gpu_count": facts.get("gpu_count", 0), "peak": peak,
              "size": vars(size), "passed": None, "failed_sections": [], "sections": [], "runs": [],
              "checkpoint": [], "compile": None, "wall_s": None}

    def record(section: dict, line: bool = True) -> None:
        """A finished section into the JSON (rewritten) and, with `line`, its line onto the terminal."""
        report["sections"].append(section_summary(section))
        report["passed"], report["failed_sections"] = verdict(report["sections"])
        report["compile"] = compile_comparison(report["runs"])
        report["wall_s"] = time.perf_counter() - started  # the smoke's own time so far: data, peak and sections
        out.write_text(json.dumps(report, indent=2))
        if line:
            print(result_line(section), flush=True)

    try:
        layout, why = default_setup(default_config())
        report["default_setup"] = {"layout": layout, "pre_flight": why}
        print(f"gpu-smoke default-setup: config.yaml's pre-flight for the source articles' box: {why}")
        runs = [("default-setup", "large", layout), *RUNS]
    except ConfigError as error:  # nothing the default could run: the other runs still go
        report["default_setup"] = {"layout": None, "pre_flight": str(error)}
        print(f"gpu-smoke default-setup: not run, config.yaml's pre-flight refused it: {error}")
        record({"name": "default-setup", "status": "fail",
                "reason": f"config.yaml's pre-flight refused it: {error}"}, line=False)
        runs = RUNS
    for name, model, train in runs:
        preset = size.large if model == "large" else size.small
        run = run_or_record(name, preset, device_settings(train, device), size, device, peak, index, tokenizer, work)
        report["runs"].append(run)
        record(run)
    name, model, train, ranks = MULTI_RANK
    preset, train = size.large if model == "large" else size.small, device_settings(train, device)
    reason = multi_rank_reason(device, report["gpu_count"], ranks)
    run = (not_applicable(name, preset, train, device, ranks, reason) if reason else
           run_or_record(name, preset, train, size, device, peak, index, tokenizer, work, ranks=ranks))
    report["runs"].append(run)
    record(run)
    name, model, train = GLOO_ON_CUDA
    preset, train = size.large if model == "large" else size.small, {**device_settings(train, device),
                                                                     "comm_backend": train["comm_backend"]}
    reason = gloo_on_cuda_reason(device)
    run = (not_applicable(name, preset, train, device, 1, reason) if reason else
           run_or_record(name, preset, train, size, device, peak, index, tokenizer, work))
    report["runs"].append(run)
    record(run)
    for name, train in CHECKPOINT_SECTIONS:
        section = checkpoint_or_record(name, device_settings(train, device), size, device, peak, index, tokenizer,
                                       work)
        report["checkpoint"].append(section)
        record(section)
    for note in dict.fromkeys(run["precision_note"] for run in report["runs"] if run.get("precision_note")):
        print(f"gpu-smoke note: {note}")  # bf16 emulated on this CPU: its tokens/s and MFU are the emulation's
    if report["compile"]:
        c = report["compile"]
        print(f"gpu-smoke compile: {c['tokens_per_s_off']:,.0f} tokens/s off, {c['tokens_per_s_on']:,.0f} on "
              f"(×{c['speedup']:.2f}), {c['compile_time_s']:.1f} s compiling"
              + (f", paid back after {c['break_even_steps']:,.0f} steps" if c["break_even_steps"] else
                 ", never paid back"))
    print(f"gpu-smoke: {report['wall_s']:.0f} s in all")
    statuses = [section["status"] for section in report["sections"]]
    if report["passed"]:
        print(f"gpu-smoke: passed: {statuses.count('pass')} sections passed, "
              f"{statuses.count('not_applicable')} not applicable here")
    else:
        print(f"gpu-smoke: FAILED: {', '.join(report['failed_sections'])}")
    return 0 if report["passed"] else 1


def run_or_record(name: str, preset: str, train: dict, size: Size, device: str, *args, **kwargs) -> dict:
    """run_one with its status (run_status), or, where planning or reading the results raised, a record of the error:
    one run's refusal or fault must not cost a GPU session the runs after it."""
    try:
        run = run_one(name, preset, train, size, device, *args, **kwargs)
    except Exception as error:
        run = {"name": name, "preset": preset, "device": device, "offload_optimizer": "none", **train,
               "world_size": kwargs.get("ranks", 1), "exit_code": None, "error": f"{type(error).__name__}: {error}"}
    return {"kind": "run", **run, **run_status(run)}


def checkpoint_or_record(name: str, train: dict, size: Size, device: str, *args) -> dict:
    """checkpoint_section, or, where it raised, a failed section with the error."""
    try:
        return checkpoint_section(name, train, size, device, *args)
    except Exception as error:
        return {"name": name, "kind": "checkpoint", "device": device, **train, "steps": checkpoint_steps(size),
                "resumed_at": checkpoint_steps(size) // 2, "status": "fail",
                "reason": f"{type(error).__name__}: {error}"}


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
