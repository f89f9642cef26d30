"""GPU smoke test (`make gpu-smoke`): the CUDA path end to end on one GPU, in a few minutes, without Snakemake.

1. llama-1b in bf16, ZeRO-2, nccl at world size 1: tokens/s, MFU, peak memory against the memory model.
2. llama-125m in fp16, ZeRO-2, with dynamic loss scaling: loss scale and skipped steps as DeepSpeed reports them.
Both runs go through the launcher with plan files, exactly as rule pretrain starts them, on a small corpus built
from the Python standard library (no network). Writes one JSON with every figure; on a machine without CUDA it
writes the reason it skipped and exits 0.

Usage: python bench/gpu_smoke.py OUT.json [--work DIR] [--steps N]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow_scripts"))

SEQ_LEN = 512
RUNS = {
    "llama-1b-bf16-zero2-nccl": {"model": {"preset": "llama-1b"},
                                 "train": {"precision": "bf16", "zero_stage": 2, "micro_batch_size": 8}},
    "llama-125m-fp16-zero2-loss-scaling": {"model": {"preset": "llama-125m"},
                                           "train": {"precision": "fp16", "zero_stage": 2, "micro_batch_size": 8}},
    # the PyTorch engines' CUDA paths: DDP with fp16 autocast + GradScaler, FSDP2 with a bf16 policy, over nccl
    "llama-125m-fp16-ddp-nccl": {"model": {"preset": "llama-125m"},
                                 "train": {"engine": "ddp", "precision": "fp16", "zero_stage": 0,
                                           "micro_batch_size": 8}},
    "llama-125m-bf16-fsdp-nccl": {"model": {"preset": "llama-125m"},
                                  "train": {"engine": "fsdp", "precision": "bf16", "zero_stage": 3,
                                            "micro_batch_size": 8}},
}


def build_data(work: Path) -> tuple[Path, Path]:
    """Corpus, tokenizer (32,000 ids, the presets' vocabulary) and shards, as the pipeline's first stages do."""
    from pretrain_bench.corpus import build_corpus
    from pretrain_bench.shards import build_index, encode_shard
    from pretrain_bench.tokenizer import train_tokenizer

    corpus, tokenizer, shards = work / "corpus", work / "tokenizer", work / "shards"
    if not (shards / "index.json").is_file():
        build_corpus([{"uri": "builtin://python-stdlib"}], corpus, max_bytes=20_000_000, min_chars=32, dedup=True,
                     val_fraction=0.02, encoding_errors="replace", cache_dir=work / "cache")
        train_tokenizer(corpus / "train.jsonl", tokenizer, vocab_size=32000, train_bytes=5_000_000, path=None)
        sidecars = []
        for split in ("train", "val"):
            meta = shards / f"{split}-00000.json"
            encode_shard(corpus / f"{split}.jsonl", tokenizer, shards / f"{split}-00000.bin", meta, split=split,
                         index=0, count=1)
            sidecars.append(meta)
        build_index(sidecars, shards / "index.json", seq_len=SEQ_LEN)
    return shards / "index.json", tokenizer


def run_one(name: str, overrides: dict, steps: int, index: Path, tokenizer: Path, work: Path) -> dict:
    import yaml

    from pretrain_bench.plan import make_plan, plan_config

    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    config["name"] = f"gpu-smoke-{name}"
    config["model"].update(overrides["model"], seq_len=SEQ_LEN, overrides={})
    config["train"].update(overrides["train"], gpus=1, nodes=1, device="cuda", comm_backend="nccl",
                           global_batch_size=None, grad_accum_steps=1, max_steps=steps, warmup_steps=5,
                           warmup_timing_steps=5, offload_optimizer="none", memory_fit="strict")
    run_dir = work / name
    plan = make_plan(plan_config(config), index=index, tokenizer=tokenizer, out_dir=run_dir / "out",
                     state_dir=run_dir / "state", resume=False, save_checkpoints=False)
    plan_path = run_dir / "plan.json"
    plan.to_json(plan_path)
    started = time.perf_counter()
    log = run_dir / "train.log"
    with open(log, "w") as out:
        code = subprocess.call([sys.executable, str(ROOT / "workflow_scripts" / "launch.py"), "--ranks", "1",
                                "--plan", str(plan_path), "--lock-dir", str(work / "slots")],
                               stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    result = {"exit_code": code, "wall_s": time.perf_counter() - started, "log_tail": log.read_text()[-3000:]}
    if code:
        return result
    summary = json.loads((run_dir / "out" / "summary.json").read_text())
    estimate = plan.memory_fit["estimate"]
    measured = summary["peak_mem_bytes"][0]
    # torch's allocator peak excludes the CUDA context, which the model's runtime term covers
    predicted = estimate["per_rank"] - estimate["runtime"]
    records = [json.loads(line) for line in (run_dir / "out" / "metrics.jsonl").read_text().splitlines()]
    result.update(
        tokens_per_s=summary["tokens_per_s"], mfu=summary["mfu"], peak_flops_source=summary["peak_flops_source"],
        step_time_s=summary["step_time_s"], loss=summary["loss"], comm_backend=summary["comm_backend"],
        precision=summary["precision"], parameters=summary["model"]["parameters"],
        peak_mem_bytes=measured, predicted_mem_bytes=predicted, measured_over_predicted=measured / predicted,
        memory_terms={k: estimate[k] for k in ("params", "grads", "optimizer", "activations", "buffers", "init")},
        skipped_steps=summary["skipped_steps"], loss_scale=[r["loss_scale"] for r in records][:10],
        gpu=summary["provenance"]["hardware"].get("gpu_name"), torch=summary["provenance"]["versions"],
    )
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--work", type=Path, default=ROOT / "bench-results" / "gpu-smoke")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    import torch

    args.out.parent.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        reason = f"no CUDA device visible (torch {torch.__version__}, torch.cuda.is_available() is False)"
        print(f"gpu-smoke: skipped: {reason}")
        args.out.write_text(json.dumps({"skipped": reason}, indent=2))
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    index, tokenizer = build_data(args.work)
    report = {"gpu": torch.cuda.get_device_name(), "runs": {}}
    for name, overrides in RUNS.items():
        report["runs"][name] = run_one(name, overrides, args.steps, index, tokenizer, args.work)
        args.out.write_text(json.dumps(report, indent=2))
        run = report["runs"][name]
        print(f"{name}: exit {run['exit_code']}" + (
            f", {run['tokens_per_s']:,.0f} tokens/s, MFU {run['mfu']:.1%}, peak {run['peak_mem_bytes'] / 2**30:.1f} "
            f"GiB vs predicted {run['predicted_mem_bytes'] / 2**30:.1f} GiB" if not run["exit_code"] else ""))
    return 0 if all(not r["exit_code"] for r in report["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
