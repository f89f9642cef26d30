"""Benchmark of the token stage: shard throughput against its limits, and the loader's share of a training step.

    python bench/bench_tokens.py [out.json] [--corpus-bytes 8000000]     (default bench-results/tokens.json)

Corpus: the train split of builtin://python-stdlib (the tiny run's corpus) capped at --corpus-bytes, built by
pretrain_bench.data.corpus.build_corpus as the download_corpus rule does.
In one process, each repeat measures, interleaved so machine drift hits all alike:
  shard_end_to_end   encode_shard: read jsonl + encode + write .bin/.json (what a shard_tokens job does)
  encode_batch       the tokenizer's raw `encode_batch` on the same texts already in memory: the limit
  encode_batch_fast  the same without offsets, which encode_shard uses
  datasets_map       the common recipe: datasets json -> Dataset.map(batched=True) with the same fast tokenizer
                     -> numpy -> .bin
Each variant loads the tokenizer afresh, as a shard job does (a cold BPE word cache; ~10 ms). Ratios are given
for the best and the median repeat by wall clock, for the best by process CPU time, and as the median of the ratios
within each round (per_round_median: the variants run back to back in every round, so drift between rounds
cancels). Then the loader: the median time to draw one (8, 129) batch against the median forward+backward+AdamW
step of a ~3M-parameter LlamaForCausalLM on one thread.

Threads: the tokenizer's Rust (rayon) pool uses every core unless RAYON_NUM_THREADS says otherwise; all variants
run with the same pool, whose size is recorded. TOKENIZERS_PARALLELISM only matters after a fork (datasets'
num_proc, DataLoader workers), which nothing here does; it is recorded too.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from pretrain_bench.data.corpus import build_corpus
from pretrain_bench.data.loader import PackedTokens, RankBatches
from pretrain_bench.data.shards import build_index, dtype_for_vocab, encode_shard
from pretrain_bench.data.tokenizer import iter_texts, load_tokenizer, train_tokenizer


def write_builtin_corpus(out_dir: Path, max_bytes: int) -> Path:
    """train.jsonl of builtin://python-stdlib, cleaned and split exactly as the download_corpus rule does."""
    build_corpus([{"uri": "builtin://python-stdlib"}], out_dir, max_bytes=max_bytes, min_chars=32, dedup=True,
                 val_fraction=0.02, encoding_errors="replace", cache_dir=out_dir / "cache")
    return out_dir / "train.jsonl"


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def datasets_recipe(jsonl: Path, tokenizer_dir: Path, out_bin: Path, cache_dir: Path) -> None:
    """The usual peer pipeline, with the same fast tokenizer and EOS after each document."""
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    shutil.rmtree(cache_dir, ignore_errors=True)  # each run converts the json afresh, as a first run would
    hf_tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    eos = hf_tokenizer.eos_token_id
    dataset = datasets.load_dataset("json", data_files=str(jsonl), split="train", cache_dir=str(cache_dir))
    tokenized = dataset.map(lambda batch: {"ids": [ids + [eos] for ids in hf_tokenizer(batch["text"])["input_ids"]]},
                            batched=True, remove_columns=["text"], load_from_cache_file=False)
    ids = np.fromiter(itertools.chain.from_iterable(tokenized["ids"]), dtype=dtype_for_vocab(len(hf_tokenizer)))
    ids.tofile(out_bin)


def fresh_tokenizer(tokenizer_dir: Path):
    """A newly loaded tokenizer, as each shard job has: its BPE word cache starts cold, so no variant reuses
    a cache warmed by the previous repeat."""
    tokenizer, _ = load_tokenizer(tokenizer_dir)
    tokenizer.encode_special_tokens = True  # as encode_shard does
    return tokenizer


def bench_sharding(work: Path, repeats: int) -> dict:
    jsonl, tokenizer_dir = work / "train.jsonl", work / "tokenizer"
    texts = list(iter_texts(jsonl))
    variants = {
        "shard_end_to_end": lambda: encode_shard(jsonl, tokenizer_dir, work / "train-00000.bin",
                                                 work / "train-00000.json", split="train", index=0, count=1),
        "encode_batch": lambda: fresh_tokenizer(tokenizer_dir).encode_batch(texts, add_special_tokens=False),
        "encode_batch_fast": lambda: fresh_tokenizer(tokenizer_dir).encode_batch_fast(texts, add_special_tokens=False),
        "datasets_map": lambda: datasets_recipe(jsonl, tokenizer_dir, work / "peer.bin", work / "hf-cache"),
    }
    # wall seconds, and CPU seconds of all this process's threads: the work done, which other load on a shared
    # machine inflates far less than the wall clock
    wall, cpu = {name: [] for name in variants}, {name: [] for name in variants}
    for _ in range(repeats):
        for name, variant in variants.items():
            cpu_start, wall_start = time.process_time(), time.perf_counter()
            variant()
            wall[name].append(time.perf_counter() - wall_start)
            cpu[name].append(time.process_time() - cpu_start)
    ours = np.fromfile(work / "train-00000.bin", dtype=json.loads((work / "train-00000.json").read_text())["dtype"])
    peer = np.fromfile(work / "peer.bin", dtype=ours.dtype)
    if not np.array_equal(ours, peer):
        raise RuntimeError("the datasets recipe produced different tokens: the comparison would be unfair")
    tokens = int(ours.size)  # EOS included; every variant encodes the same texts
    result = {"documents": len(texts), "text_bytes": sum(len(text.encode()) for text in texts), "tokens": tokens,
              "wall_s": wall, "cpu_s": cpu}
    # best-of-N is the headline on a shared machine (noise only ever adds time); medians are kept beside it
    for statistic, seconds in (("best", {name: min(values) for name, values in wall.items()}),
                               ("median", {name: statistics.median(values) for name, values in wall.items()}),
                               ("cpu_best", {name: min(values) for name, values in cpu.items()})):
        result[statistic] = {
            "tokens_per_s": {name: tokens / value for name, value in seconds.items()},
            **{f"shard_vs_{name}": seconds[name] / seconds["shard_end_to_end"]
               for name in ("encode_batch", "encode_batch_fast", "datasets_map")},
        }
    # each round runs every variant back to back (A B C D, A B C D ...): the median of the per-round ratios cancels
    # drift of the machine's speed between rounds, which the ratio of separate medians does not
    result["per_round_median"] = {
        f"shard_vs_{name}": statistics.median(other / ours for other, ours in zip(wall[name], wall["shard_end_to_end"]))
        for name in ("encode_batch", "encode_batch_fast", "datasets_map")}
    result["targets"] = {"shard_vs_encode_batch": ">= 0.9", "shard_vs_datasets_map": ">= 1.0"}
    return result


def bench_loader(work: Path, draws: int, steps: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    micro_batch_size, seq_len = 8, 128
    torch.set_num_threads(1)
    torch.manual_seed(0)
    build_index([work / "train-00000.json"], work / "index.json")
    data = PackedTokens(work / "index.json", "train", seq_len)
    batches = RankBatches(data, rank=0, world_size=1, micro_batch_size=micro_batch_size, seed=0)
    for _ in range(10):  # first touches of the memmap pages
        batches.next_batch()
    draw_s = [timed(batches.next_batch) for _ in range(draws)]

    config = LlamaConfig(vocab_size=data.vocab_size, hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=seq_len,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = batches.next_batch()  # (B, T + 1)

    def train_step():
        logits = model(input_ids=batch[:, :-1]).logits  # (B, T, vocab)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        train_step()
    step_s = [timed(train_step) for _ in range(steps)]
    return {
        "micro_batch_size": micro_batch_size, "seq_len": seq_len, "samples": data.num_samples,
        "model_params": sum(p.numel() for p in model.parameters()), "torch_threads": torch.get_num_threads(),
        "draw_s_median": statistics.median(draw_s), "draw_s_max": max(draw_s),
        "step_s_median": statistics.median(step_s),
        "draw_share_of_step": statistics.median(draw_s) / statistics.median(step_s), "target": "< 0.02",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, nargs="?", default=Path("bench-results/tokens.json"))
    parser.add_argument("--corpus-bytes", type=int, default=8_000_000)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import tokenizers
    import torch
    import transformers

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_builtin_corpus(work, args.corpus_bytes)
        train_s = timed(lambda: train_tokenizer(work / "train.jsonl", work / "tokenizer", vocab_size=args.vocab_size,
                                                train_bytes=2_000_000))
        result = {
            "corpus": {"source": "builtin://python-stdlib, train split",
                       "jsonl_bytes": (work / "train.jsonl").stat().st_size},
            "tokenizer": {"vocab_size": args.vocab_size, "train_bytes": 2_000_000, "train_s": train_s},
            "sharding": bench_sharding(work, args.repeats),
            "loader": bench_loader(work, draws=200, steps=10),
        }
    result["environment"] = {
        "cpu_count": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
        # other work on a shared machine shows up here, and as spread between best and median
        "loadavg_1min_before_after": [load_before[0], os.getloadavg()[0]],
        "RAYON_NUM_THREADS": os.environ.get("RAYON_NUM_THREADS"),
        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM"),
        "versions": {"tokenizers": tokenizers.__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__, "numpy": np.__version__},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    headline = {statistic: result["sharding"][statistic]
                for statistic in ("best", "median", "cpu_best", "per_round_median")}
    headline["draw_share_of_step"] = result["loader"]["draw_share_of_step"]
    headline["loadavg_1min_before_after"] = result["environment"]["loadavg_1min_before_after"]
    print(json.dumps(headline, indent=2))


if __name__ == "__main__":
    main()
