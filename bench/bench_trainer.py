"""Our trainer against a minimal hand-written GPT training loop of the same shape and FLOPs, compile off and on.

The reference (`reference_loop`) is written here from scratch in plain PyTorch, in the shape of nanoGPT's model and
train.py: a decoder of pre-norm blocks (RMSNorm, one fused q/k/v projection, rotary positions, torch's
scaled_dot_product_attention with a causal mask, output projection, SwiGLU MLP), tied input embedding and LM head,
and a loop of forward, cross-entropy, backward, clip, AdamW step, zero_grad(set_to_none) and nothing else. Its matmuls
are those of our LLaMA model (~12M parameters: 6 layers, width 384, 6 heads, FFN 1024, the tokenizer's vocabulary,
batch 8 × 128 tokens), so both do the same FLOPs per token (pretrain_bench.flops). It uses AdamW(fused=True), the
optimizer kernel every engine builds, so the ratio is the trainer's own cost, not an optimizer's.

Sides: compile off on both (eager), then compile on on both (the reference: torch.compile of its whole model, what
nanoGPT's --compile does; the trainer: train.compile, per decoder block). Variants of the trainer at one rank:
DeepSpeed ZeRO-0, ZeRO-1, ZeRO-2, DDP, FSDP. The machine is noisy, so within a round every variant runs once in turn
(reference, zero0, zero1, …) and each ratio is the median over rounds of the variant's tokens/s ÷ the same round's
reference. Targets: ZeRO-0 and DDP ≥ 1.0×, ZeRO-1/2 ≥ 0.95×. Writes JSON (default bench-results/trainer.json).

    python bench/bench_trainer.py [out.json] [--steps 12] [--warmup 3] [--repeats 3] [--compile off on]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

NAME = "bench-trainer"
MODEL_OVERRIDES = {"hidden_size": 384, "num_attention_heads": 6, "num_key_value_heads": 6,
                   "intermediate_size": 1024, "num_hidden_layers": 6}


def build_data() -> tuple[dict, Path, Path]:
    """The tiny config with the bench's model, and its shards' index.json and tokenizer folder (built by Snakemake
    under results/data/ where missing)."""
    from pretrain_bench.config_types import load_config
    from pretrain_bench.data_products import DataProducts

    config = load_config(ROOT / "config.yaml", ROOT / "config" / "tiny-cpu.yaml")
    config["name"] = NAME
    config["model"]["overrides"] = MODEL_OVERRIDES
    products = DataProducts.from_config(config)
    subprocess.run([sys.executable, "-m", "snakemake", products.index, products.tokenizer_json, "--cores",
                    str(os.cpu_count()), "--configfile", "config/tiny-cpu.yaml", "--config", f"name={NAME}", "--quiet"],
                   cwd=ROOT, check=True)
    return config, ROOT / products.index, ROOT / "results" / products.tokenizer


VARIANTS = {"zero0": {"zero_stage": 0}, "zero1": {"zero_stage": 1}, "zero2": {"zero_stage": 2},
            "ddp": {"engine": "ddp", "zero_stage": 0}, "fsdp": {"engine": "fsdp", "zero_stage": 3}}
TARGETS = {"zero0": 1.0, "ddp": 1.0, "zero1": 0.95, "zero2": 0.95}


def run_trainer(config: dict, data: tuple[Path, Path], steps: int, warmup: int, variant: str, compiled: bool,
                work: Path) -> dict:
    from pretrain_bench.plan import make_plan, plan_config
    from pretrain_bench.run_summary import RunSummary

    train = {"gpus": 1, "global_batch_size": None, "max_steps": steps, "warmup_timing_steps": warmup,
             "warmup_steps": 1, "checkpoint_every": 10**6, "eval_every": None, "compile": compiled,
             **VARIANTS[variant]}
    name = f"{variant}-compile" if compiled else variant
    index, tokenizer = data
    plan = make_plan(plan_config(config, {**config["train"], **train}), index=index,
                     tokenizer=tokenizer, out_dir=work / name, state_dir=work / f"state-{name}",
                     role="bench", resume=False, save_checkpoints=False)
    plan_path = work / f"plan-{name}.json"
    plan.to_json(plan_path)
    log = work / f"trainer-{name}.log"
    with open(log, "w") as handle:
        code = subprocess.run([sys.executable, str(ROOT / "workflow_scripts" / "launch.py"), "--ranks", "1",
                               "--plan", str(plan_path)], cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT).returncode
    if code:
        raise SystemExit(f"trainer failed, see {log}")
    return RunSummary.read(work / name / "summary.json").to_dict()


def reference_model(shape, seq_len: int):
    """A minimal GPT of `shape` (a pretrain_bench ModelShape), hand-written: see the module's docstring."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    heads, width = shape.num_attention_heads, shape.hidden_size
    head_dim = width // heads

    def rotate(x, cos, sin):  # rotary positions on (B, heads, T, head_dim), halves rotated (LLaMA's layout)
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-second, first), dim=-1) * sin

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm, self.mlp_norm = nn.RMSNorm(width, eps=shape.rms_norm_eps), nn.RMSNorm(width,
                                                                                                  eps=shape.rms_norm_eps)
            self.qkv = nn.Linear(width, 3 * width, bias=False)
            self.out = nn.Linear(width, width, bias=False)
            self.gate_up = nn.Linear(width, 2 * shape.intermediate_size, bias=False)
            self.down = nn.Linear(shape.intermediate_size, width, bias=False)

        def forward(self, x, cos, sin):  # x: (B, T, width)
            batch, length, _ = x.shape
            q, k, v = self.qkv(self.attn_norm(x)).view(batch, length, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)  # (B, heads, T, head_dim)
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out(attended.transpose(1, 2).reshape(batch, length, width))
            gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
            return x + self.down(F.silu(gate) * up)

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(shape.vocab_size, width)
            self.blocks = nn.ModuleList(Block() for _ in range(shape.num_hidden_layers))
            self.norm = nn.RMSNorm(width, eps=shape.rms_norm_eps)
            self.head = nn.Linear(width, shape.vocab_size, bias=False)
            self.head.weight = self.embed.weight  # tied, as the tiny preset's LLaMA
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, std=0.02)
            inverse = 1.0 / shape.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
            angles = torch.outer(torch.arange(seq_len).float(), inverse)  # (T, head_dim / 2)
            angles = torch.cat((angles, angles), dim=-1)
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)

        def forward(self, tokens):  # (B, T) -> logits (B, T, vocab)
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x, self.cos, self.sin)
            return self.head(self.norm(x))

    return GPT()


def reference_loop(config: dict, data: tuple[Path, Path], steps: int, warmup: int, compiled: bool) -> dict:
    """The hand-written loop on the same data, batch, threads and learning rate as the trainer."""
    import torch
    import torch.nn.functional as F

    from pretrain_bench.loader import PackedTokens, RankBatches
    from pretrain_bench.model import resolve_shape
    from pretrain_bench.settings import TORCH_ADAMW_KWARGS

    torch.set_num_threads(os.cpu_count())
    index_path = data[0]
    index = json.loads(index_path.read_text())
    seq_len, train = config["model"]["seq_len"], config["train"]
    shape = resolve_shape(config["model"]["preset"], MODEL_OVERRIDES, index["vocab_size"])
    torch.manual_seed(train["seed"])
    model = reference_model(shape, seq_len)
    if compiled:
        model.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=train["lr"], betas=tuple(train["adam_betas"]),
                                  weight_decay=train["weight_decay"], **TORCH_ADAMW_KWARGS)
    batches = RankBatches(PackedTokens(index_path, "train", seq_len), rank=0, world_size=1,
                          micro_batch_size=train["micro_batch_size"], seed=train["seed"])
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        batch = batches.next_batch()  # (B, T+1)
        logits = model(batch[:, :-1])  # (B, T, vocab)
        loss = F.cross_entropy(logits.float().reshape(-1, shape.vocab_size), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # the loop reads its loss every step, as the trainer does
        times.append(time.perf_counter() - start)
    steady = times[warmup:]
    tokens = train["micro_batch_size"] * seq_len
    return {"tokens_per_s": tokens * len(steady) / sum(steady), "step_time_s_median": statistics.median(steady),
            "first_step_s": times[0], "loss": {"first": losses[0], "last": losses[-1]},
            "parameters": sum(p.numel() for p in model.parameters())}


def side(config: dict, data: tuple[Path, Path], args, compiled: bool, work: Path) -> dict:
    """One side (compile off or on): rounds of the reference and every variant in turn, and the ratios."""
    rounds = []
    for _ in range(args.repeats):  # A B C … A B C …: slow phases of the machine hit every variant alike
        reference = reference_loop(config, data, args.steps, args.warmup, compiled)
        rounds.append({"reference": reference,
                       **{variant: run_trainer(config, data, args.steps, args.warmup, variant, compiled, work)
                          for variant in args.variants}})

    def ratios(variant: str) -> list[float]:
        return [r[variant]["tokens_per_s"] / r["reference"]["tokens_per_s"] for r in rounds]

    return {
        "reference_tokens_per_s": [r["reference"]["tokens_per_s"] for r in rounds],
        "reference_first_step_s": [r["reference"]["first_step_s"] for r in rounds],
        "reference_parameters": rounds[0]["reference"]["parameters"],
        "trainer": {variant: {
            "engine": rounds[0][variant]["engine"], "zero_stage": rounds[0][variant]["zero_stage"],
            "tokens_per_s": [r[variant]["tokens_per_s"] for r in rounds],
            "ratio_to_reference_per_round": ratios(variant),
            "ratio_to_reference": statistics.median(ratios(variant)),
            "target": TARGETS.get(variant),
            "compile_time_s": [(r[variant]["compile"] or {}).get("time_s") for r in rounds],
            "phase_time_s": rounds[-1][variant]["phase_time_s"]}
            for variant in args.variants},
    }


def main() -> None:
    import torch

    from pretrain_bench.flops import flops_per_token, measure_matmul_peak
    from pretrain_bench.model import count_parameters, resolve_shape

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default="bench-results/trainer.json")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--compile", nargs="+", default=["off", "on"], choices=["off", "on"])
    args = parser.parse_args()
    config, *data = build_data()
    work = Path(tempfile.mkdtemp(prefix="bench-trainer-"))
    torch.set_num_threads(os.cpu_count())
    peak = max(measure_matmul_peak("fp32", size=1024) for _ in range(3))
    index = json.loads(data[0].read_text())
    shape = resolve_shape("tiny", MODEL_OVERRIDES, index["vocab_size"])
    params = count_parameters(shape)
    per_token = flops_per_token(params["matmul"], shape.num_hidden_layers, shape.num_attention_heads,
                                shape.hidden_size // shape.num_attention_heads, config["model"]["seq_len"])
    result = {
        "what": "1 rank, CPU, fp32, same shape/FLOPs/batch/data/threads: the trainer vs a hand-written GPT loop",
        "parameters": params["total"], "threads": os.cpu_count(), "steps": args.steps, "warmup_steps": args.warmup,
        "repeats": args.repeats,
        "reference": "hand-written GPT (RMSNorm, fused qkv, rotary, SDPA, SwiGLU, tied head), AdamW(fused=True); "
                     "compile on: torch.compile of the whole model",
        "measured_matmul_peak_flops": peak, "flops_per_token": per_token,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for which in args.compile:  # the JSON is rewritten after each side: a side that ran is never lost
        measured = result[f"compile_{which}"] = side(config, data, args, which == "on", work)
        # MFU against the matmul peak measured here: (6N + 12·L·H·Q·T) × tokens/s ÷ peak (pretrain_bench.flops)
        measured["reference_mfu"] = statistics.median(measured["reference_tokens_per_s"]) * per_token / peak
        for variant in measured["trainer"].values():
            variant["mfu"] = statistics.median(variant["tokens_per_s"]) * per_token / peak
        result["load_average_end"] = list(os.getloadavg())
        Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
