"""Training data: packed fixed-length samples over a split's token shards, and the batches each rank draws.

The split's shards are one token stream (shard order, documents separated by EOS). Sample k is the window of
seq_len + 1 tokens starting at k * seq_len: inputs are its first seq_len tokens, targets its last seq_len, so
consecutive samples' targets tile the stream without gaps or overlap.

Batch order: epoch e visits the samples in the order `EpochPermutation(num_samples, seed, e)`, a keyed Feistel
network over the sample indices: a true permutation, computed per index, so no array of num_samples indices is
ever materialised (8 bytes per sample would be ~62 GB at 10^12 tokens of 128-token samples). All ranks compute the
same permutation and advance one shared position by micro_batch_size x world_size per `next_batch`; rank r takes
its slice [r * micro, (r + 1) * micro) of that window, so ranks never share a sample within an epoch. The tail of
an epoch too short for a whole window is dropped. The state is three integers, so a resumed run continues with
exactly the batches it would have drawn.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from pretrain_bench.data.products import DamagedProductError, damaged


class TokenIdError(DamagedProductError):
    """A shard holds a token id the vocabulary does not have (>= index.json's vocab_size): the embedding would fail
    with a bare IndexError; the message names the shard, the position and the id."""


class PackedTokens:
    """Read-only view of one split's shards as (seq_len + 1)-token samples; memmapped, never loaded whole."""

    def __init__(self, index_path: Path, split: str, seq_len: int):
        index_path = Path(index_path)
        index = json.loads(index_path.read_text())
        if split not in index["splits"]:
            raise KeyError(f"{index_path} has no split {split!r} (has {sorted(index['splits'])})")
        self.split, self.seq_len = split, seq_len
        self.dtype = np.dtype(index["dtype"])
        self.eos_id, self.pad_id, self.vocab_size = index["eos_id"], index["pad_id"], index["vocab_size"]
        # Empty shards (a slice without documents) cannot be memmapped and hold nothing: leave them out.
        shards = [shard for shard in index["splits"][split]["shards"] if shard["tokens"] > 0]
        self._paths = [index_path.parent / shard["file"] for shard in shards]
        self._index_path = index_path
        for path, shard in zip(self._paths, shards):
            size = path.stat().st_size if path.is_file() else None
            if size != shard["tokens"] * self.dtype.itemsize:
                held = "is missing" if size is None else f"holds {size:,} bytes"
                raise damaged(str(index_path.parent), f"{path} {held}, {index_path} lists {shard['tokens']:,} tokens "
                              f"of {self.dtype.itemsize} bytes", [str(path)], str(index_path))
        sizes = np.array([shard["tokens"] for shard in shards], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(sizes)])  # (shards + 1,) stream offset of each shard
        self.num_tokens = int(self._starts[-1])
        self.num_samples = max(0, (self.num_tokens - 1) // seq_len)
        self._maps: dict[int, np.memmap] = {}  # opened on first use: a map holds a file descriptor

    def __len__(self) -> int:
        return self.num_samples

    def _shard(self, i: int) -> np.memmap:
        if i not in self._maps:
            self._maps[i] = np.memmap(self._paths[i], dtype=self.dtype, mode="r")
        return self._maps[i]

    def __getitem__(self, k: int) -> np.ndarray:
        """(seq_len + 1,) int64: stream tokens [k * seq_len, k * seq_len + seq_len]."""
        if not 0 <= k < self.num_samples:
            raise IndexError(f"sample {k} outside 0..{self.num_samples - 1} of split {self.split}")
        start, stop = k * self.seq_len, k * self.seq_len + self.seq_len + 1
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        pieces = []
        while start < stop:  # a window may straddle shard boundaries
            offset = start - int(self._starts[shard])
            take = min(stop, int(self._starts[shard + 1])) - start
            piece = self._shard(shard)[offset:offset + take]
            if take and int(piece.max()) >= self.vocab_size:
                self._bad_id(shard, offset, piece)
            pieces.append(piece)
            start += take
            shard += 1
        return np.concatenate(pieces).astype(np.int64)


    def _bad_id(self, shard: int, offset: int, piece: np.ndarray):
        at = int(np.argmax(piece >= self.vocab_size))
        path = self._paths[shard]
        raise TokenIdError(str(damaged(
            str(self._index_path.parent), f"{path} holds token id {int(piece[at])} at token {offset + at:,}, "
            f"outside the vocabulary of {self.vocab_size} ids that {self._index_path} records", [str(path)],
            str(self._index_path))))


class EpochPermutation:
    """A pseudo-random permutation of range(n) for one (seed, epoch), evaluated index by index in O(1) memory.

    Hand-written because neither numpy nor torch offers an index-addressable permutation (both materialise the
    whole array). A balanced Feistel network on 2·h bits (2^(2h) >= n) with ROUNDS keyed rounds is a bijection of
    [0, 2^(2h)); "cycle walking" (apply it again until the value falls below n) restricts it to a bijection of
    [0, n), needing fewer than 4 applications on average since 2^(2h) < 4n.
    """

    ROUNDS = 6

    def __init__(self, n: int, seed: int, epoch: int):
        if n < 1:
            raise ValueError(f"cannot permute {n} samples")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = np.random.SeedSequence([seed, epoch]).generate_state(self.ROUNDS, dtype=np.uint64)

    @staticmethod
    def _mix(z: np.ndarray) -> np.ndarray:
        """splitmix64's finaliser (Steele et al.): a cheap, well-spread 64-bit hash."""
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        half = np.uint64(self.half)
        left, right = x >> half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (self._mix(right ^ key) & self.mask)
        return (left << half) | right

    def __getitem__(self, positions) -> np.ndarray:
        """The samples at these positions of the epoch's order, (len(positions),) int64."""
        positions = np.asarray(positions, dtype=np.uint64)
        if positions.size and int(positions.max()) >= self.n:
            raise IndexError(f"position {int(positions.max())} outside 0..{self.n - 1}")
        with np.errstate(over="ignore"):  # the hash relies on wrapping uint64 arithmetic
            out = self._encrypt(positions)
            outside = out >= np.uint64(self.n)
            while outside.any():
                out[outside] = self._encrypt(out[outside])
                outside = out >= np.uint64(self.n)
        return out.astype(np.int64)


class RankBatches:
    """This rank's micro-batches: deterministic from (seed, epoch), disjoint across ranks, resumable."""

    def __init__(self, data: PackedTokens, *, rank: int, world_size: int, micro_batch_size: int, seed: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1} (world_size {world_size})")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.data, self.rank, self.world_size = data, rank, world_size
        self.micro_batch_size, self.seed = micro_batch_size, seed
        self.window = micro_batch_size * world_size  # samples drawn by all ranks per next_batch
        if data.num_samples < self.window:
            needed = self.window * data.seq_len + 1
            raise ValueError(
                f"split {data.split} holds {data.num_tokens} tokens; one global batch of {self.window} samples "
                f"(micro_batch_size {micro_batch_size} x world_size {world_size}) of {data.seq_len}+1 tokens "
                f"needs {needed}"
            )
        self.samples_per_epoch = data.num_samples // self.window * self.window  # tail dropped
        self.epoch, self.position = 0, 0
        self._order_epoch, self._order = None, None

    def _epoch_order(self) -> EpochPermutation:
        """The current epoch's order (an index-addressable permutation, not an array)."""
        if self._order_epoch != self.epoch:
            self._order = EpochPermutation(self.data.num_samples, self.seed, self.epoch)
            self._order_epoch = self.epoch
        return self._order

    def next_batch(self) -> torch.LongTensor:
        """(micro_batch_size, seq_len + 1) int64 samples of this rank; advances every rank's shared position."""
        if self.position + self.window > self.samples_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        first = self.position + self.rank * self.micro_batch_size
        indices = self._epoch_order()[np.arange(first, first + self.micro_batch_size)]
        self.position += self.window
        return torch.from_numpy(np.stack([self.data[int(k)] for k in indices]))

    def state_dict(self) -> dict:
        """Where the data order stands; `position` counts global samples consumed in `epoch`."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "world_size": self.world_size, "micro_batch_size": self.micro_batch_size}

    def load_state_dict(self, state: dict, *, allow_reshape: bool = False) -> None:
        """Resume from `state_dict()`. The seed must match; so must world_size and micro_batch_size unless
        `allow_reshape` (position counts global samples, so a new window size simply continues from it)."""
        checked = ["seed"] + ([] if allow_reshape else ["world_size", "micro_batch_size"])
        mismatched = [f"{key} {state[key]} (saved) != {getattr(self, key)} (now)"
                      for key in checked if state[key] != getattr(self, key)]
        if mismatched:
            raise ValueError(f"cannot resume the data order of split {self.data.split}: {'; '.join(mismatched)}")
        if not 0 <= state["position"] <= self.data.num_samples:
            raise ValueError(f"saved position {state['position']} is outside the {self.data.num_samples} samples "
                             f"of split {self.data.split} (did the shards change?)")
        self.epoch, self.position = state["epoch"], state["position"]
