"""Our trainer against a minimal hand-written GPT training loop of the same shape and FLOPs, compile off and on.

The reference (`reference_loop`) is written here from scratch in plain PyTorch, in the shape of nanoGPT's model and
train.py: a decoder of pre-norm blocks (RMSNorm, one fused q/k/v projection, rotary positions, torch's
scaled_dot_product_attention with a causal mask, output projection, SwiGLU MLP), tied input embedding and LM head,
and a loop of forward, cross-entropy, backward, clip, AdamW step, zero_grad(set_to_none) and nothing else. Its matmuls
are those of our LLaMA model (~12M parameters: 6 layers, width 384, 6 heads, FFN 1024, the tokenizer's vocabulary,
batch 8 × 128 tokens), so both do the same FLOPs per token (pretrain_bench.train.models.flops). It uses
AdamW(fused=True), the optimizer kernel every engine builds, so the ratio is the trainer's own cost, not an optimizer's.

Sides: compile off on both (eager), then compile on on both (the reference: torch.compile of its whole model, what
nanoGPT's --compile does; the trainer: train.compile, with the scope compiling.compile_scope picks for the tiny
config's model class and the engine). Variants of the trainer at one rank: DeepSpeed ZeRO-0, ZeRO-1, ZeRO-2, DDP,
FSDP. The machine is noisy, so within a round every variant runs once in turn (reference, zero0, zero1, …, and the
other way round in every second round: round_order) and each ratio is the median over rounds of the variant's
tokens/s ÷ the same round's reference. Each run, the reference's included, is a fresh interpreter. Targets: ZeRO-0
and DDP ≥ 1.0×, ZeRO-1/2 ≥ 0.95×. Each trainer run also records its rank's start-up (launch to first step).
The loop flushes denormal floats to zero, as the trainer's CPU ranks do (pretrain_bench.core.devices.flush_denormals),
so a ratio is the trainer's own cost; --loop-denormals keep runs it as plain PyTorch runs by default, which the CPU
slows as training produces denormals (README, "Denormal floats").

--model-class measures transformers' LlamaForCausalLM against the same maths and state dict written as plain modules
(`llama_layout_model`), in one process from the same weights: the largest logit difference, each one's training step
(alternating rounds) and build time, and the CPU seconds importing transformers' LLaMA adds to a training rank's
imports: whether the model class limits speed or start-up.

Writes JSON (default bench-results/trainer.json); --merge keeps the sections of an existing file that a call does not
measure, so the sides can run as separate, shorter calls.

    python bench/bench_trainer.py [out.json] [--steps 32] [--warmup 8] [--repeats 4] [--compile off on]
                                  [--variants zero0 …] [--loop-denormals flush|keep] [--model-class] [--merge]
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

ROOT = Path(__file__).resolve().parents[1]

NAME = "bench-trainer"
MODEL_OVERRIDES = {"hidden_size": 384, "num_attention_heads": 6, "num_key_value_heads": 6,
                   "intermediate_size": 1024, "num_hidden_layers": 6}


def build_data() -> tuple[dict, Path, Path]:
    """The tiny config with the bench's model, and its shards' index.json and tokenizer folder (built by Snakemake
    under results/data/ where missing)."""
    from pretrain_bench.data.products import DataProducts
    from pretrain_bench.workflow.experiment import Config, load_config

    config = load_config(ROOT / "config.yaml", ROOT / "config" / "tiny-cpu.yaml")
    config["name"] = NAME
    config["model"]["overrides"] = MODEL_OVERRIDES
    s = Config.from_config(config)
    products = DataProducts.from_config(s.corpus, s.tokenizer, s.shards, s.model.init_from)
    subprocess.run([sys.executable, "-m", "snakemake", products.index, products.tokenizer_json, "--cores",
                    str(os.cpu_count()), "--configfile", "config/tiny-cpu.yaml", "--config", f"name={NAME}", "--quiet"],
                   cwd=ROOT, check=True)
    return config, ROOT / products.index, ROOT / "results" / products.tokenizer


VARIANTS = {"zero0": {"zero_stage": 0}, "zero1": {"zero_stage": 1}, "zero2": {"zero_stage": 2},
            "ddp": {"engine": "ddp", "zero_stage": 0}, "fsdp": {"engine": "fsdp", "zero_stage": 3}}
TARGETS = {"zero0": 1.0, "ddp": 1.0, "zero1": 0.95, "zero2": 0.95}


def bench_train(steps: int, warmup: int) -> dict:
    """The train keys every run of the bench sets over the tiny config's, the reference's included: one rank, `steps`
    steps (the first `warmup` left out of the timing), a 1-step learning-rate warm-up, no checkpoints, no evaluation."""
    return {"gpus": 1, "global_batch_size": None, "max_steps": steps, "warmup_timing_steps": warmup,
            "warmup_steps": 1, "checkpoint_every": 10**6, "eval_every": None}


def run_trainer(config: dict, data: tuple[Path, Path], steps: int, warmup: int, variant: str, compiled: bool,
                work: Path) -> dict:
    from pretrain_bench.core.logs import read_startups
    from pretrain_bench.train.plan import make_plan
    from pretrain_bench.train.run_summary import RunSummary
    from pretrain_bench.workflow.experiment import plan_config

    train = {**bench_train(steps, warmup), "compile": compiled, **VARIANTS[variant]}
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
    startups = [r["startup_s"] for r in read_startups(log.read_text()) if r["what"] == "first training step"]
    return {**RunSummary.read(work / name / "summary.json").to_dict(), "rank_startup_s": (startups or [None])[0]}


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


def llama_layout_model(shape, seq_len: int):
    """transformers' LlamaForCausalLM written as plain PyTorch modules with its parameters under its names (separate
    q/k/v/o and gate/up/down projections, input_layernorm, post_attention_layernorm, tied lm_head), the same maths
    through torch's SDPA: what a native model class would run. Only for the model-class measurement (`model_class`);
    it loads LlamaForCausalLM's state dict as it is, so both run from the same weights."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    heads, width = shape.num_attention_heads, shape.hidden_size
    head_dim = width // heads

    def rotate(x, cos, sin):  # (B, heads, T, head_dim), halves rotated (transformers' rotate_half)
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-second, first), dim=-1) * sin

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(width, width, bias=False) for _ in range(4))

        def forward(self, x, cos, sin):  # x: (B, T, width)
            batch, length, _ = x.shape
            q, k, v = (proj(x).view(batch, length, heads, head_dim).transpose(1, 2)
                       for proj in (self.q_proj, self.k_proj, self.v_proj))  # (B, heads, T, head_dim)
            attended = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
            return self.o_proj(attended.transpose(1, 2).reshape(batch, length, width))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(width, shape.intermediate_size, bias=False)
            self.up_proj = nn.Linear(width, shape.intermediate_size, bias=False)
            self.down_proj = nn.Linear(shape.intermediate_size, width, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.mlp = Attention(), MLP()
            self.input_layernorm = nn.RMSNorm(width, eps=shape.rms_norm_eps)
            self.post_attention_layernorm = nn.RMSNorm(width, eps=shape.rms_norm_eps)

        def forward(self, x, cos, sin):
            x = x + self.self_attn(self.input_layernorm(x), cos, sin)
            return x + self.mlp(self.post_attention_layernorm(x))

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(shape.vocab_size, width)
            self.layers = nn.ModuleList(Layer() for _ in range(shape.num_hidden_layers))
            self.norm = nn.RMSNorm(width, eps=shape.rms_norm_eps)
            inverse = 1.0 / shape.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
            angles = torch.outer(torch.arange(seq_len).float(), inverse)  # (T, head_dim / 2)
            angles = torch.cat((angles, angles), dim=-1)
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)

        def forward(self, tokens):
            x = self.embed_tokens(tokens)
            for layer in self.layers:
                x = layer(x, self.cos, self.sin)
            return self.norm(x)

    class CausalLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Decoder()
            self.lm_head = nn.Linear(width, shape.vocab_size, bias=False)
            self.lm_head.weight = self.model.embed_tokens.weight  # tied, as the tiny preset's LLaMA

        def forward(self, tokens):  # (B, T) -> logits (B, T, vocab)
            return self.lm_head(self.model(tokens))

    return CausalLM()


def model_class(config: dict, data: tuple[Path, Path], steps: int, warmup: int, repeats: int) -> dict:
    """transformers' LlamaForCausalLM against `llama_layout_model` from the same weights, in this process: the
    largest logit difference, the seconds each takes to build, and each one's training steps (forward, loss, backward,
    clip, AdamW), alternating in rounds; plus what importing transformers' LLaMA adds to a training rank's imports."""
    import torch
    import torch.nn.functional as F

    from pretrain_bench.data.loader import PackedTokens, RankBatches
    from pretrain_bench.train.engines.spec import TORCH_ADAMW_KWARGS
    from pretrain_bench.train.models.llama import build_model, resolve_shape

    torch.set_num_threads(os.cpu_count())
    index = json.loads(data[0].read_text())
    seq_len, train = config["model"]["seq_len"], config["train"]
    shape = resolve_shape(config["model"]["preset"], MODEL_OVERRIDES, index["vocab_size"])
    build_s = {"transformers": [], "plain": []}
    for _ in range(3):
        started = time.perf_counter()
        hf = build_model(shape, seq_len, train["seed"])
        build_s["transformers"].append(time.perf_counter() - started)
        started = time.perf_counter()
        plain = llama_layout_model(shape, seq_len)
        build_s["plain"].append(time.perf_counter() - started)
    plain.load_state_dict(hf.state_dict())  # strict: the same names and shapes
    batches = RankBatches(PackedTokens(data[0], "train", seq_len), rank=0, world_size=1,
                          micro_batch_size=train["micro_batch_size"], seed=train["seed"])
    probe = batches.next_batch()[:, :-1]
    with torch.no_grad():
        logit_difference = (hf(input_ids=probe).logits - plain(probe)).abs().max().item()
    if logit_difference > 1e-5:  # otherwise the two would not be the same model, and their times say nothing
        raise SystemExit(f"the plain modules' logits differ from transformers' LLaMA by {logit_difference:.2e}")
    models = {"transformers": (hf, lambda tokens: hf(input_ids=tokens).logits), "plain": (plain, plain)}
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=train["lr"], **TORCH_ADAMW_KWARGS)
                  for name, (model, _) in models.items()}

    def seconds_per_step(name: str, count: int) -> float:
        (model, forward), optimizer = models[name], optimizers[name]
        started = time.perf_counter()
        for _ in range(count):
            batch = batches.next_batch()  # (B, T+1)
            logits = forward(batch[:, :-1])  # (B, T, vocab)
            F.cross_entropy(logits.reshape(-1, shape.vocab_size), batch[:, 1:].reshape(-1)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), train["grad_clip"])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return (time.perf_counter() - started) / count

    for name in models:
        seconds_per_step(name, warmup)
    rounds = [{name: seconds_per_step(name, steps) for name in models} for _ in range(repeats)]
    ratios = [r["plain"] / r["transformers"] for r in rounds]  # transformers' tokens/s ÷ the plain module's
    return {"what": "transformers' LlamaForCausalLM vs the same maths and state dict as plain modules, 1 process, "
                    "compile off, forward + loss + backward + clip + AdamW; ratio = transformers' tokens/s ÷ plain's",
            "max_abs_logit_difference": logit_difference,
            "step_s": {name: [r[name] for r in rounds] for name in models},
            "ratio_per_round": ratios, "ratio": statistics.median(ratios),
            "build_s": {name: statistics.median(values) for name, values in build_s.items()},
            "rank_imports": rank_import_seconds()}


RANK_IMPORTS = "import torch, deepspeed, pretrain_bench.train.trainer"


def child_cpu_seconds(code: str, what: str) -> float:
    """CPU seconds (user + system) of a fresh interpreter that runs `code`; exits naming `what` if it fails."""
    process = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, DS_ACCELERATOR="cpu"),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    if status:
        raise SystemExit(f"{what} failed: {process.stderr.read()[-2000:].decode(errors='replace')}")
    return usage.ru_utime + usage.ru_stime


def rank_import_seconds(runs: int = 3) -> dict:
    """CPU seconds (user + system, which a busy machine does not stretch as it does wall time) of a fresh interpreter
    importing what a training rank imports, without and with transformers' LlamaForCausalLM (median of `runs`,
    alternating)."""
    codes = {"rank": RANK_IMPORTS, "rank_and_transformers_llama": f"{RANK_IMPORTS}; from transformers import "
                                                                  "LlamaForCausalLM"}
    seconds: dict[str, list[float]] = {name: [] for name in codes}
    for _ in range(runs):
        for name, code in codes.items():
            seconds[name].append(child_cpu_seconds(code, name))
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    return {"cpu_s": medians, "cpu_s_runs": seconds,
            "transformers_llama_cpu_s": medians["rank_and_transformers_llama"] - medians["rank"]}


def reference_loop(config: dict, data: tuple[Path, Path], steps: int, warmup: int, compiled: bool,
                   flush: bool) -> dict:
    """The hand-written loop on the same data, batch, threads and learning-rate schedule as the trainer (its
    LambdaLR over the same settings: warm-up, then the decay to min_lr), so both train through the same regime.
    `flush`: the loop flushes denormal floats as a CPU rank does (devices.flush_denormals), so that a ratio is the
    trainer's own cost; without it the loop runs as a hand-written loop runs by default (README: "Denormal floats")."""
    import torch
    import torch.nn.functional as F

    from pretrain_bench.core.devices import denormals_flushed, flush_denormals
    from pretrain_bench.data.loader import PackedTokens, RankBatches
    from pretrain_bench.train.engines.base import lr_schedule
    from pretrain_bench.train.engines.spec import TORCH_ADAMW_KWARGS
    from pretrain_bench.train.models.llama import resolve_shape
    from pretrain_bench.train.settings import TrainSettings

    torch.set_num_threads(os.cpu_count())
    if flush:
        flush_denormals()
    index_path = data[0]
    index = json.loads(index_path.read_text())
    seq_len, train = config["model"]["seq_len"], config["train"]
    shape = resolve_shape(config["model"]["preset"], MODEL_OVERRIDES, index["vocab_size"])
    settings = TrainSettings.from_config({**train, **bench_train(steps, warmup)})
    torch.manual_seed(train["seed"])
    model = reference_model(shape, seq_len)
    if compiled:
        model.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=tuple(settings.adam_betas),
                                  eps=settings.adam_eps, weight_decay=settings.weight_decay, **TORCH_ADAMW_KWARGS)
    scheduler = lr_schedule(settings, settings.total_steps(seq_len))(optimizer)
    batches = RankBatches(PackedTokens(index_path, "train", seq_len), rank=0, world_size=1,
                          micro_batch_size=train["micro_batch_size"], seed=train["seed"])
    times, losses, marks = [], [], []
    for _ in range(steps):
        start = time.perf_counter()
        batch = batches.next_batch()  # (B, T+1)
        forward = time.perf_counter()
        logits = model(batch[:, :-1])  # (B, T, vocab)
        loss = F.cross_entropy(logits.float().reshape(-1, shape.vocab_size), batch[:, 1:].reshape(-1))
        backward = time.perf_counter()
        loss.backward()
        optimizer_start = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        marks.append((forward, backward, optimizer_start, time.perf_counter()))
        losses.append(loss.item())  # the loop reads its loss every step, as the trainer does
        times.append(time.perf_counter() - start)
    steady = times[warmup:]
    # the trainer's phases (step.PhaseTimer), medians: forward with the loss, backward, and the optimizer's part
    # (clip, step, schedule, zero_grad)
    phases = {phase: statistics.median(m[i + 1] - m[i] for m in marks[warmup:])
              for i, phase in enumerate(("forward", "backward", "optimizer"))}
    tokens = settings.micro_batch_size * seq_len
    return {"tokens_per_s": tokens * len(steady) / sum(steady), "step_time_s_median": statistics.median(steady),
            "first_step_s": times[0], "loss": {"first": losses[0], "last": losses[-1]}, "phase_time_s": phases,
            "parameters": sum(p.numel() for p in model.parameters()), "denormals_flushed": denormals_flushed()}


def run_reference(config: dict, data: tuple[Path, Path], steps: int, warmup: int, compiled: bool, flush: bool,
                  work: Path) -> dict:
    """`reference_loop` in a fresh interpreter (this script with --reference), as each trainer run is one: neither
    side inherits this process's allocations, threads or compiled graphs."""
    job = work / "reference.json"
    job.write_text(json.dumps({"config": config, "data": [str(path) for path in data], "steps": steps,
                               "warmup": warmup, "compiled": compiled, "flush": flush}))
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--reference", str(job)], cwd=ROOT, check=True)
    return json.loads(job.with_suffix(".out.json").read_text())


def reference_main(job: Path) -> None:
    """The child of `run_reference`: one reference loop, its result written beside the job."""
    spec = json.loads(job.read_text())
    result = reference_loop(spec["config"], tuple(Path(path) for path in spec["data"]), spec["steps"], spec["warmup"],
                            spec["compiled"], spec["flush"])
    job.with_suffix(".out.json").write_text(json.dumps(result))


def round_order(names: list[str], index: int) -> list[str]:
    """The order of round `index`'s runs: `names` as given in even rounds, reversed in odd ones (A B C, C B A, …).
    Every run of a round shares the machine's phase of that round, but a run's place in it weighs too (what ran just
    before it, the first run after the previous round's last): reversed every other round, each place falls to every
    run alike instead of the same one each round."""
    return list(names) if index % 2 == 0 else list(reversed(names))


def side(config: dict, data: tuple[Path, Path], args, compiled: bool, work: Path) -> dict:
    """One side (compile off or on): rounds of the reference and every variant (round_order), and the ratios."""
    rounds = []
    for index in range(args.repeats):
        runs = {}
        for name in round_order(["reference", *args.variants], index):
            runs[name] = (run_reference(config, data, args.steps, args.warmup, compiled, args.loop_denormals == "flush",
                                        work) if name == "reference"
                          else run_trainer(config, data, args.steps, args.warmup, name, compiled, work))
        rounds.append(runs)

    def ratios(variant: str, baseline: str = "reference") -> list[float]:
        return [r[variant]["tokens_per_s"] / r[baseline]["tokens_per_s"] for r in rounds]

    # DDP at one rank is the plain loop inside the trainer (its all-reduce over one rank moves nothing): a variant's
    # ratio to it is that engine's own cost at one rank, the factor by which its 1-rank baseline flatters its speedup
    plain = "ddp" if "ddp" in args.variants else None

    return {
        "order_per_round": [list(r) for r in rounds],
        "reference_tokens_per_s": [r["reference"]["tokens_per_s"] for r in rounds],
        "reference_first_step_s": [r["reference"]["first_step_s"] for r in rounds],
        "reference_phase_time_s": rounds[-1]["reference"]["phase_time_s"],
        "reference_parameters": rounds[0]["reference"]["parameters"],
        # whether the loop's arithmetic flushed denormals (--loop-denormals), measured after its last step
        "reference_denormals_flushed": [r["reference"]["denormals_flushed"] for r in rounds],
        "trainer": {variant: {
            "engine": rounds[0][variant]["engine"], "zero_stage": rounds[0][variant]["zero_stage"],
            "tokens_per_s": [r[variant]["tokens_per_s"] for r in rounds],
            "ratio_to_reference_per_round": ratios(variant),
            "ratio_to_reference": statistics.median(ratios(variant)),
            "target": TARGETS.get(variant),
            "ratio_to_ddp_per_round": ratios(variant, plain) if plain else None,
            "ratio_to_ddp": statistics.median(ratios(variant, plain)) if plain else None,
            "compile_time_s": [(r[variant]["compile"] or {}).get("time_s") for r in rounds],
            # the rank's launch to its first step (pretrain_bench.core.logs.log_startup), compile time not included
            "rank_startup_s": [r[variant]["rank_startup_s"] for r in rounds],
            "phase_time_s": rounds[-1][variant]["phase_time_s"]}
            for variant in args.variants},
    }


def main() -> None:
    import torch

    from pretrain_bench.train.models.flops import flops_per_token, measure_matmul_peak
    from pretrain_bench.train.models.llama import count_parameters, resolve_shape

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default="bench-results/trainer.json")
    # 8 timed steps spread too widely here to tell a few per cent apart; 24, in 4 rounds, are the README's figures
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--compile", nargs="*", default=["off", "on"], choices=["off", "on"],
                        help="the sides to measure (none given: neither, e.g. with --model-class alone)")
    parser.add_argument("--loop-denormals", choices=["flush", "keep"], default="flush",
                        help="flush: the loop flushes denormal floats to zero as the trainer's CPU ranks do, so a "
                             "ratio is the trainer's own cost; keep: the loop as plain PyTorch runs by default")
    parser.add_argument("--model-class", action="store_true",
                        help="also measure transformers' LlamaForCausalLM against the same model as plain modules")
    parser.add_argument("--merge", action="store_true",
                        help="keep what an existing out file holds of the sections this call does not measure")
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
    out = Path(args.out)
    result = json.loads(out.read_text()) if args.merge and out.is_file() else {}
    result.update({
        "what": "1 rank, CPU, fp32, same shape/FLOPs/batch/data/threads: the trainer vs a hand-written GPT loop",
        "parameters": params["total"], "threads": os.cpu_count(),
        "reference": "hand-written GPT (RMSNorm, fused qkv, rotary, SDPA, SwiGLU, tied head), AdamW(fused=True); "
                     "compile on: torch.compile of the whole model",
        "measured_matmul_peak_flops": peak, "flops_per_token": per_token,
    })
    out.parent.mkdir(parents=True, exist_ok=True)
    measure = {f"compile_{which}": functools.partial(side, config, data, args, which == "on", work)
               for which in args.compile}
    if args.model_class:
        measure["model_class"] = functools.partial(model_class, config, data, args.steps, args.warmup, args.repeats)
    for section, run in measure.items():  # the JSON is rewritten after each section: one that ran is never lost
        load_start = list(os.getloadavg())
        measured = result[section] = run()
        measured.update(steps=args.steps, warmup_steps=args.warmup, repeats=args.repeats,
                        load_average_start=load_start, load_average_end=list(os.getloadavg()))
        if "trainer" in measured:
            # MFU against the matmul peak measured here: (6N + 12·L·H·Q·T) × tokens/s ÷ peak
            # (pretrain_bench.train.models.flops)
            measured["reference_mfu"] = statistics.median(measured["reference_tokens_per_s"]) * per_token / peak
            for variant in measured["trainer"].values():
                variant["mfu"] = statistics.median(variant["tokens_per_s"]) * per_token / peak
        out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--reference"]:
        reference_main(Path(sys.argv[2]))
    else:
        main()
