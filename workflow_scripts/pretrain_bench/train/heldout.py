"""Held-out loss during training (train.eval_every): a fixed slice of the val shards, split over all ranks.

The slice is the same at every evaluation, so the curve compares like with like: `eval_tokens // seq_len` val samples
(rounded down to a multiple of the ranks, at least one per rank; a val split with fewer is refused when the run is
planned, see `heldout_samples`) chosen evenly spaced over the split exactly as
`eval_sample_indices` chooses the samples of a checkpoint's evaluation; rank r takes every world-th one
from r. Every rank runs the same number of forward passes, which ZeRO-3's parameter gathers need.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pretrain_bench.data.loader import PackedTokens
from pretrain_bench.train.settings import ConfigError


def heldout_samples(val_tokens: int, seq_len: int, world_size: int, eval_tokens: int, index_path: Path) -> int:
    """Val samples one evaluation takes over all ranks: eval_tokens // seq_len, rounded down to a multiple of the
    ranks, at least one per rank. Raises ConfigError when the val split of `index_path` holds fewer, naming its size,
    what is needed and the keys that change either; the plan rule calls this before launch, with the same numbers
    the ranks use."""
    available = max(0, (val_tokens - 1) // seq_len)  # samples of seq_len + 1 tokens, as loader.PackedTokens counts
    wanted = max(world_size, eval_tokens // seq_len // world_size * world_size)
    if wanted <= available:
        return wanted
    fits = available // world_size * world_size * seq_len
    lower = (f"lower train.eval_tokens to at most {fits:,}, " if fits else
             "lower train.gpus (one val sample per rank is the least an evaluation takes), ")
    raise ConfigError(
        f"train.eval_every: the val split of {index_path} holds {val_tokens:,} tokens, {available:,} sample(s) of "
        f"{seq_len}+1 tokens (model.seq_len {seq_len}); an evaluation needs {wanted:,} sample(s) "
        f"({wanted * seq_len + 1:,} tokens: train.eval_tokens {eval_tokens:,} over {world_size} rank(s), at least one "
        "sample per rank). "
        f"Raise corpus.val_fraction (or the corpus size), {lower}or set train.eval_every: null")


def eval_sample_indices(num_samples: int, seq_len: int, max_tokens: int) -> np.ndarray:
    """The val samples evaluated: max_tokens // seq_len of them (at least 1), evenly spaced over the split."""
    if num_samples < 1:
        raise ValueError("the val split holds less than one sample of seq_len + 1 tokens: nothing to evaluate")
    count = min(num_samples, max(1, max_tokens // seq_len))
    return np.arange(count, dtype=np.int64) * num_samples // count


class HeldOutSlice:
    """This rank's part of the fixed val slice; `evaluate` returns its summed loss and target-token count."""

    def __init__(self, index_path: Path, seq_len: int, rank: int, world_size: int, eval_tokens: int):
        self.data = PackedTokens(Path(index_path), "val", seq_len)
        self.seq_len = seq_len
        count = heldout_samples(self.data.num_tokens, seq_len, world_size, eval_tokens, index_path)
        self.samples = count  # over all ranks
        self.indices = eval_sample_indices(self.data.num_samples, seq_len, count * seq_len)[rank::world_size]

    @torch.no_grad()
    def evaluate(self, engine, batch_size: int, device: str, vocab: int) -> tuple[float, float]:
        """(sum of per-token cross-entropy in nats, number of target tokens) over this rank's samples."""
        engine.eval()  # no dropout; the LLaMA blocks have none today, but a model.init_from config may
        total = 0.0
        try:
            for start in range(0, len(self.indices), batch_size):
                rows = np.stack([self.data[int(k)] for k in self.indices[start:start + batch_size]])
                batch = torch.from_numpy(rows).to(device)  # (B, T+1)
                logits = engine(input_ids=batch[:, :-1]).logits  # (B, T, vocab)
                total += F.cross_entropy(logits.float().reshape(-1, vocab), batch[:, 1:].reshape(-1),
                                         reduction="sum").item()
        finally:
            engine.train()
        return total, float(len(self.indices) * self.seq_len)
