"""Held-out loss during training (train.eval_every): a fixed slice of the val shards, split over all ranks.

The slice is the same at every evaluation, so the curve compares like with like: `eval_tokens // seq_len` val samples
(rounded down to a multiple of the ranks, at least one per rank) chosen evenly spaced over the split exactly as
`evaluation.eval_sample_indices` chooses the samples of a checkpoint's evaluation; rank r takes every world-th one
from r. Every rank runs the same number of forward passes, which ZeRO-3's parameter gathers need.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .evaluation import eval_sample_indices
from .loader import PackedTokens


class HeldOutSlice:
    """This rank's part of the fixed val slice; `evaluate` returns its summed loss and target-token count."""

    def __init__(self, index_path: Path, seq_len: int, rank: int, world_size: int, eval_tokens: int):
        self.data = PackedTokens(Path(index_path), "val", seq_len)
        self.seq_len = seq_len
        usable = self.data.num_samples // world_size * world_size
        if usable == 0:
            raise ValueError(f"train.eval_every: the val split of {index_path} holds {self.data.num_samples} "
                             f"sample(s) of {seq_len}+1 tokens, fewer than the {world_size} ranks; raise "
                             "corpus.val_fraction or set train.eval_every: null")
        count = min(usable, max(world_size, eval_tokens // seq_len // world_size * world_size))
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
