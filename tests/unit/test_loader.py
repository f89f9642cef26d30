"""Loader: packed windows across shard boundaries, rank-disjoint and resumable order, epochs, clear errors."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from pretrain_bench.data.loader import EpochPermutation, PackedTokens, RankBatches, TokenIdError
from pretrain_bench.data.products import DamagedProductError
from pretrain_bench.data.shards import build_index

SEQ_LEN = 8


def write_counting_shards(out: Path, sizes: list[int], split: str = "train") -> Path:
    """Shards whose concatenated stream is 0, 1, 2, ...: every window's content is known. Returns index.json."""
    sidecars, first = [], 0
    for i, size in enumerate(sizes):
        tokens = np.arange(first, first + size, dtype=np.uint32)
        first += size
        (out / f"{split}-{i:05d}.bin").write_bytes(tokens.tobytes())
        sidecar = {"split": split, "shard": i, "count": len(sizes), "file": f"{split}-{i:05d}.bin",
                   "tokens": size, "documents": 1, "text_bytes": size,
                   "sha256": hashlib.sha256(tokens.tobytes()).hexdigest(), "dtype": "uint32",
                   "vocab_size": 1 << 20, "eos_id": 0, "pad_id": 1}
        (out / f"{split}-{i:05d}.json").write_text(json.dumps(sidecar))
        sidecars.append(out / f"{split}-{i:05d}.json")
    build_index(sidecars, out / "index.json")
    return out / "index.json"


@pytest.fixture
def data(tmp_path) -> PackedTokens:
    # 301 tokens in uneven shards, one empty: 37 windows of 8+1, several straddling a boundary
    return PackedTokens(write_counting_shards(tmp_path, [50, 0, 3, 120, 128]), "train", SEQ_LEN)


def first_tokens(batch) -> list[int]:
    """Sample ids of a batch: sample k starts with token k * SEQ_LEN in the counting stream."""
    return [int(row[0]) // SEQ_LEN for row in batch]


def test_samples_are_overlapping_windows_across_shards(data):
    assert data.num_tokens == 301 and data.num_samples == 37 == len(data)
    for k in range(data.num_samples):
        sample = data[k]
        assert sample.dtype == np.int64
        assert np.array_equal(sample, np.arange(k * SEQ_LEN, k * SEQ_LEN + SEQ_LEN + 1))
    with pytest.raises(IndexError):
        data[37]


def test_ranks_never_share_a_sample_within_an_epoch(data):
    world, micro = 3, 2
    ranks = [RankBatches(data, rank=r, world_size=world, micro_batch_size=micro, seed=7) for r in range(world)]
    steps = data.num_samples // (world * micro)  # 6 steps of 6 samples; 1 sample dropped
    seen = []
    for _ in range(steps):
        batches = [loader.next_batch() for loader in ranks]
        assert all(tuple(batch.shape) == (micro, SEQ_LEN + 1) for batch in batches)
        seen += [k for batch in batches for k in first_tokens(batch)]
    assert len(seen) == len(set(seen)) == steps * world * micro
    assert all(loader.epoch == 0 for loader in ranks)
    # the same window without rank slicing: rank r's rows are positions [r*micro, (r+1)*micro) of the order
    order = EpochPermutation(data.num_samples, 7, 0)
    assert seen[:world * micro] == order[np.arange(world * micro)].tolist()


def test_resumed_loader_continues_identically(data):
    uninterrupted = RankBatches(data, rank=1, world_size=2, micro_batch_size=3, seed=11)
    stopped = RankBatches(data, rank=1, world_size=2, micro_batch_size=3, seed=11)
    for _ in range(4):
        uninterrupted.next_batch()
        stopped.next_batch()
    state = json.loads(json.dumps(stopped.state_dict()))  # survives a checkpoint's serialisation
    assert state == {"epoch": 0, "position": 24, "seed": 11, "world_size": 2, "micro_batch_size": 3}
    resumed = RankBatches(data, rank=1, world_size=2, micro_batch_size=3, seed=11)
    resumed.load_state_dict(state)
    for _ in range(10):  # runs into the next epoch too
        assert first_tokens(resumed.next_batch()) == first_tokens(uninterrupted.next_batch())
    assert resumed.state_dict() == uninterrupted.state_dict() and resumed.epoch == 2


def test_epoch_rollover_draws_a_new_permutation(data):
    loader = RankBatches(data, rank=0, world_size=1, micro_batch_size=4, seed=3)
    per_epoch = data.num_samples // 4  # 9 batches, 1 sample dropped
    epochs = [[k for _ in range(per_epoch) for k in first_tokens(loader.next_batch())] for _ in range(2)]
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["position"] == 36
    for epoch, seen in enumerate(epochs):
        assert seen == EpochPermutation(37, 3, epoch)[np.arange(36)].tolist()
    assert epochs[0] != epochs[1]
    loader.next_batch()
    assert loader.epoch == 2 and loader.position == 4


def test_too_few_tokens_names_split_and_counts(tmp_path):
    data = PackedTokens(write_counting_shards(tmp_path, [40], split="val"), "val", SEQ_LEN)
    with pytest.raises(ValueError, match=r"split val holds 40 tokens; .* 6 samples .* needs 49"):
        RankBatches(data, rank=0, world_size=3, micro_batch_size=2, seed=0)
    assert RankBatches(data, rank=0, world_size=2, micro_batch_size=2, seed=0).samples_per_epoch == 4


def test_load_state_dict_rejects_mismatches(data):
    loader = RankBatches(data, rank=0, world_size=2, micro_batch_size=2, seed=5)
    for key, value in [("world_size", 3), ("micro_batch_size", 4), ("seed", 6)]:
        state = {**loader.state_dict(), key: value}
        with pytest.raises(ValueError, match=f"{key} {value} \\(saved\\) != "):
            loader.load_state_dict(state)
    with pytest.raises(ValueError, match="outside the 37 samples"):
        loader.load_state_dict({**loader.state_dict(), "position": 1000})


def test_reshaped_resume_continues_the_epoch_without_repeats(data):
    before = RankBatches(data, rank=0, world_size=1, micro_batch_size=4, seed=9)
    seen = [k for _ in range(3) for k in first_tokens(before.next_batch())]
    after = [RankBatches(data, rank=r, world_size=2, micro_batch_size=3, seed=9) for r in range(2)]
    for loader in after:
        loader.load_state_dict(before.state_dict(), allow_reshape=True)
    while after[0].epoch == 0 and after[0].position + 6 <= after[0].samples_per_epoch:
        seen += [k for loader in after for k in first_tokens(loader.next_batch())]
    assert len(seen) == len(set(seen)) == 36  # 12 + 4 windows of 6, then the epoch's last sample is dropped



@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_epoch_order_is_a_deterministic_permutation(n):
    order = EpochPermutation(n, seed=5, epoch=0)[np.arange(n)]
    assert sorted(order.tolist()) == list(range(n)), "every sample exactly once"
    assert order.tolist() == EpochPermutation(n, seed=5, epoch=0)[np.arange(n)].tolist()
    if n >= 64:
        assert order.tolist() != list(range(n)), "shuffled"
        assert order.tolist() != EpochPermutation(n, seed=5, epoch=1)[np.arange(n)].tolist()
        assert order.tolist() != EpochPermutation(n, seed=6, epoch=0)[np.arange(n)].tolist()
    # any slice equals the same slice of the whole order: a resumed loader can start anywhere
    start = n // 3
    assert EpochPermutation(n, 5, 0)[np.arange(start, n)].tolist() == order[start:].tolist()


def test_epoch_order_memory_does_not_grow_with_the_corpus():
    import tracemalloc

    tracemalloc.start()
    # 10^12 tokens of 128-token samples: 7.8e9 samples (an array of them would take 62 GB)
    order = EpochPermutation(7_812_500_000, seed=1, epoch=0)
    batch = order[np.arange(10**9, 10**9 + 64)]
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1_000_000 and len(set(batch.tolist())) == 64 and int(batch.max()) < 7_812_500_000


def test_a_token_id_outside_the_vocabulary_is_a_named_error_not_an_index_error(tmp_path):
    index = write_counting_shards(tmp_path, [40, 40])
    recorded = json.loads(index.read_text())
    recorded["vocab_size"] = 60  # the stream counts to 79: ids 60.. are outside this vocabulary
    index.write_text(json.dumps(recorded))
    data = PackedTokens(index, "train", SEQ_LEN)
    assert data[0].max() < 60
    with pytest.raises(TokenIdError) as caught:
        data[7]  # tokens 56..64
    message = str(caught.value)
    assert f"{tmp_path}/train-00001.bin holds token id 60 at token 20, outside the vocabulary of 60 ids" in message
    assert "is damaged" in message and f"--forcerun {tmp_path}/train-00001.bin -- {index}" in message


def test_a_truncated_shard_is_a_damaged_product_naming_the_file_and_its_rebuild(tmp_path):
    index = write_counting_shards(tmp_path, [40, 40])
    with open(tmp_path / "train-00000.bin", "r+b") as handle:
        handle.truncate(100)
    with pytest.raises(DamagedProductError, match=rf"{tmp_path}/train-00000\.bin holds 100 bytes, {index} lists 40 "
                                                  rf"tokens of 4 bytes\. Rebuild exactly it with:\n  snakemake .* "
                                                  rf"--forcerun {tmp_path}/train-00000\.bin -- {index}"):
        PackedTokens(index, "train", SEQ_LEN)
