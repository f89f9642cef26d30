"""Token shards: content equals the corpus, counts equal a direct encode, reproducible bytes, index.json, uint32."""

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from pretrain_bench.core.digests import digest_file
from pretrain_bench.data.products import DamagedProductError, command_line_forcing
from pretrain_bench.data.shards import (
    build_index,
    changed_shard_problems,
    dtype_for_vocab,
    encode_shard,
    shard_byte_range,
    verify_index,
)
from pretrain_bench.data.tokenizer import (
    EOS_TOKEN,
    load_tokenizer,
    save_hf_folder,
    train_bpe,
    train_tokenizer,
)
from support import TRICKY_TEXTS, stdlib_texts, write_jsonl

TEXTS = stdlib_texts(200_000) + TRICKY_TEXTS


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    corpus = write_jsonl(folder / "train.jsonl", TEXTS)
    train_tokenizer(corpus, folder, vocab_size=800, train_bytes=100_000)
    return folder


def shard_split(corpus: Path, tokenizer_dir: Path, out: Path, split: str, count: int, **kwargs) -> list[Path]:
    """Run every shard job of a split, as Snakemake would; returns the sidecar paths."""
    sidecars = []
    for index in range(count):
        stem = out / f"{split}-{index:05d}"
        encode_shard(corpus, tokenizer_dir, stem.with_suffix(".bin"), stem.with_suffix(".json"), split=split,
                     index=index, count=count, **kwargs)
        sidecars.append(stem.with_suffix(".json"))
    return sidecars


def read_stream(index_path: Path, split: str) -> np.ndarray:
    index = json.loads(index_path.read_text())
    files = [index_path.parent / shard["file"] for shard in index["splits"][split]["shards"]]
    return np.concatenate([np.fromfile(path, dtype=index["dtype"]) for path in files])


def split_documents(stream: np.ndarray, eos_id: int) -> list[list[int]]:
    ends = np.flatnonzero(stream == eos_id)
    assert ends.size and ends[-1] == stream.size - 1, "every document, the last included, ends with EOS"
    return [piece.tolist() for piece in np.split(stream, ends + 1)[:-1]]  # each piece ends with its EOS


@pytest.fixture(scope="module")
def sharded(tokenizer_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards")
    train = write_jsonl(out / "train.jsonl", TEXTS)
    val = write_jsonl(out / "val.jsonl", TEXTS[:3])
    # a small batch size so the encoder's batching and the shard slicing both really happen
    sidecars = shard_split(train, tokenizer_dir, out, "train", 3, batch_bytes=20_000)
    sidecars += shard_split(val, tokenizer_dir, out, "val", 2)
    build_index(sidecars, out / "index.json")
    return out / "index.json"


def test_decoding_shards_gives_back_the_corpus(sharded, tokenizer_dir):
    tokenizer, info = load_tokenizer(tokenizer_dir)
    documents = split_documents(read_stream(sharded, "train"), info["eos_id"])
    assert [tokenizer.decode(ids[:-1]) for ids in documents] == TEXTS
    # the literal "<|endoftext|>" inside a document stayed text: no extra boundary, spelled in ordinary tokens
    assert EOS_TOKEN in TEXTS[-2] and len(documents) == len(TEXTS)


def test_token_counts_equal_a_direct_encode(sharded, tokenizer_dir):
    tokenizer, _ = load_tokenizer(tokenizer_dir)
    tokenizer.encode_special_tokens = True
    index = json.loads(sharded.read_text())
    direct = sum(len(tokenizer.encode(text, add_special_tokens=False).ids) + 1 for text in TEXTS)
    assert index["splits"]["train"]["tokens"] == direct == read_stream(sharded, "train").size
    assert index["splits"]["train"]["documents"] == len(TEXTS)
    assert index["splits"]["train"]["text_bytes"] == sum(len(text.encode()) for text in TEXTS)
    assert index["splits"]["val"]["documents"] == 3


def test_evaluator_byte_count_matches_the_index(sharded, tokenizer_dir):
    """Bits per byte divides by the bytes evaluation.token_byte_lengths counts: over a whole split they must be
    the corpus's UTF-8 bytes, multi-byte characters split across tokens and literal special-token text included."""
    from pretrain_bench.evaluate.evaluation import token_byte_lengths

    index = json.loads(sharded.read_text())
    lengths = token_byte_lengths(tokenizer_dir, index["vocab_size"])
    for split in ("train", "val"):
        counted = int(lengths[read_stream(sharded, split)].sum())
        assert counted == index["splits"][split]["text_bytes"]
    assert index["splits"]["train"]["text_bytes"] == sum(len(text.encode()) for text in TEXTS)


def test_index_fields(sharded, tokenizer_dir):
    _, info = load_tokenizer(tokenizer_dir)
    index = json.loads(sharded.read_text())
    assert {key: index[key] for key in ("format", "dtype", "eos_id", "pad_id", "vocab_size")} == {
        "format": 2, "dtype": "uint16", "eos_id": info["eos_id"], "pad_id": info["pad_id"], "vocab_size": 800}
    assert "seq_len" not in index  # the token stream is shared by runs of any sample length
    train = index["splits"]["train"]
    assert [shard["file"] for shard in train["shards"]] == [f"train-{i:05d}.bin" for i in range(3)]
    assert sum(shard["tokens"] for shard in train["shards"]) == train["tokens"]
    for shard in train["shards"]:
        assert shard["tokens"] > 0  # byte ranges split the documents, not all into one shard
        assert shard["sha256"] == hashlib.sha256((sharded.parent / shard["file"]).read_bytes()).hexdigest()


def test_same_input_gives_byte_identical_shards(sharded, tokenizer_dir, tmp_path):
    sidecars = shard_split(sharded.parent / "train.jsonl", tokenizer_dir, tmp_path, "train", 3)
    for sidecar in sidecars:
        bin_name = sidecar.with_suffix(".bin").name
        assert (tmp_path / bin_name).read_bytes() == (sharded.parent / bin_name).read_bytes()
    assert not list(tmp_path.glob("*.tmp-*"))  # temporary files were renamed into place


def test_shard_byte_ranges_tile_the_file():
    for size, count in [(10, 3), (7, 7), (5, 8), (1_000_003, 64)]:
        ranges = [shard_byte_range(size, i, count) for i in range(count)]
        assert ranges[0][0] == 0 and ranges[-1][1] == size
        assert all(stop == next_start for (_, stop), (next_start, _) in zip(ranges, ranges[1:]))
    with pytest.raises(ValueError, match=r"shard index 3 is outside 0\.\.2"):
        shard_byte_range(10, 3, 3)


@pytest.mark.parametrize("count", [1, 2, 40])
def test_any_shard_count_gives_the_same_stream(sharded, tokenizer_dir, tmp_path, count):
    """40 shards over 30-odd documents leaves some shards empty; the stream must not change."""
    sidecars = shard_split(sharded.parent / "train.jsonl", tokenizer_dir, tmp_path, "train", count)
    build_index(sidecars, tmp_path / "index.json")
    assert np.array_equal(read_stream(tmp_path / "index.json", "train"), read_stream(sharded, "train"))


def test_index_rejects_missing_or_damaged_shards(sharded, tmp_path):
    sidecars = sorted(sharded.parent.glob("train-*.json"))
    with pytest.raises(ValueError, match=r"split train: expected shards 0\.\.2, got \[0, 2\]"):
        build_index([sidecars[0], sidecars[2]], tmp_path / "index.json")
    for path in sidecars:
        (tmp_path / path.name).write_text(path.read_text())
        (tmp_path / path.with_suffix(".bin").name).write_bytes(path.with_suffix(".bin").read_bytes())
    (tmp_path / "train-00001.bin").write_bytes(b"\0\0")  # truncated
    with pytest.raises(DamagedProductError, match=r"is damaged: .*train-00001\.bin holds 2 bytes"):
        build_index(sorted(tmp_path.glob("train-*.json")), tmp_path / "index.json")


def copy_shards(sharded: Path, into: Path) -> list[Path]:
    """A copy of the train shards and their sidecars (as their jobs wrote them) in `into`; its sidecars."""
    for path in sorted(sharded.parent.glob("train-*.json")):
        (into / path.name).write_text(path.read_text())
        (into / path.with_suffix(".bin").name).write_bytes(path.with_suffix(".bin").read_bytes())
    return sorted(into.glob("train-*.json"))


def overwrite_same_size(path: Path, at: int) -> None:
    """Change 2 bytes at offset `at`, keeping the size (and, like a careful hand, the mtime)."""
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[at:at + 2] = bytes([(data[at] + 1) % 256, (data[at + 1] + 1) % 256])
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_sidecars_record_the_digests_of_the_bytes_written_and_the_index_never_blesses_changed_bytes(sharded,
                                                                                                   tmp_path):
    sidecars = copy_shards(sharded, tmp_path)
    sidecar = json.loads(sidecars[1].read_text())
    data = (tmp_path / sidecar["file"]).read_bytes()
    assert sidecar["sha256"] == hashlib.sha256(data).hexdigest() and sidecar["bytes"] == len(data)
    assert sidecar["sampled_sha256"] == digest_file(tmp_path / sidecar["file"])["sampled_sha256"]
    index = build_index(sidecars, tmp_path / "index.json")
    assert index["splits"]["train"]["shards"][1]["sampled_sha256"] == sidecar["sampled_sha256"]
    # a shard rewritten with other bytes of the same size, then touched: the index job reruns and refuses it
    overwrite_same_size(tmp_path / "train-00001.bin", 100)
    (tmp_path / "train-00001.bin").touch()
    with pytest.raises(DamagedProductError) as caught:
        build_index(sidecars, tmp_path / "index.json")
    message = str(caught.value)
    assert f"the data product {tmp_path} is damaged: {tmp_path}/train-00001.bin does not match the sha256 its " \
           "shard job recorded from the bytes it wrote" in message
    assert f"--forcerun {tmp_path}/train-00001.bin -- {tmp_path}/index.json" in message


def test_a_reader_finds_a_same_size_overwrite_in_full_and_a_truncation_either_way(sharded, tmp_path):
    build_index(copy_shards(sharded, tmp_path), tmp_path / "index.json")
    assert verify_index(tmp_path / "index.json", "full")["splits"]["train"]["tokens"] > 0
    overwrite_same_size(tmp_path / "train-00002.bin", 100)
    with pytest.raises(DamagedProductError, match=r"train-00002\.bin does not match the sha256 its shard job"):
        verify_index(tmp_path / "index.json", "full")
    # the sampled check reads the first SAMPLE_BYTES of a 64 MiB stride: these small shards whole
    with pytest.raises(DamagedProductError, match=r"train-00002\.bin does not match the sampled sha256"):
        verify_index(tmp_path / "index.json", "sampled")
    with open(tmp_path / "train-00000.bin", "r+b") as handle:
        handle.truncate(100)
    with pytest.raises(DamagedProductError, match=r"train-00000\.bin holds 100 bytes, its shard job wrote"):
        verify_index(tmp_path / "index.json", "sampled")


def test_before_any_job_a_shard_changed_after_its_job_is_named_unless_this_command_rebuilds_it(sharded, tmp_path):
    copy_shards(sharded, tmp_path)
    index = str(tmp_path / "index.json")
    assert changed_shard_problems(str(tmp_path), index) is None
    shard = tmp_path / "train-00001.bin"
    shard.touch()  # newer than its sidecar, the same bytes: Snakemake reruns the index, which may go ahead
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    assert changed_shard_problems(str(tmp_path), index) is None
    overwrite_same_size(shard, 10)
    problem = changed_shard_problems(str(tmp_path), index)
    assert problem.startswith(f"the data product {tmp_path} is damaged: {shard} does not match the sha256")
    assert f"--forcerun {shard} -- {index}" in problem
    # the command it gives rebuilds the shard: not refused by the same check
    assert changed_shard_problems(str(tmp_path), index, forcerun={str(shard)}) is None
    assert changed_shard_problems(str(tmp_path), index, forcerun={"shard_tokens"}) is None


def test_large_vocabulary_writes_uint32(tmp_path):
    assert dtype_for_vocab(65_536) == np.uint16 and dtype_for_vocab(65_537) == np.uint32
    tokenizer = train_bpe(["def f(x):\n    return x\n"] * 5, 300)
    tokenizer.add_tokens([f"<w{i}>" for i in range(66_000)])  # ids beyond 65,535
    save_hf_folder(tokenizer, {"eos": EOS_TOKEN, "pad": "<|pad|>", "bos": None}, tmp_path / "tok")
    texts = ["x <w65999> y <w0>", "def f(x):\n    return <w65000>\n"]
    corpus = write_jsonl(tmp_path / "val.jsonl", texts)
    sidecars = shard_split(corpus, tmp_path / "tok", tmp_path, "val", 1)
    index = build_index(sidecars, tmp_path / "index.json")
    assert index["dtype"] == "uint32" and index["vocab_size"] > 65_536
    stream = read_stream(tmp_path / "index.json", "val")
    assert stream.max() > 65_535  # high ids survived, not wrapped
    loaded, info = load_tokenizer(tmp_path / "tok")
    assert [loaded.decode(ids[:-1]) for ids in split_documents(stream, info["eos_id"])] == texts


def test_failed_shard_leaves_no_files(tokenizer_dir, tmp_path):
    corpus = write_jsonl(tmp_path / "train.jsonl", TEXTS[:3])
    with open(corpus, "a") as f:
        f.write("not json\n")
    with pytest.raises(ValueError, match=r"train\.jsonl: line at byte \d+ is not a JSON object"):
        shard_split(corpus, tokenizer_dir, tmp_path, "train", 1, batch_bytes=100)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["train.jsonl"]


def test_a_full_disk_while_sharding_names_the_file_and_the_space_it_needs(tokenizer_dir, tmp_path, monkeypatch):
    """ENOSPC on the shard's write (simulated: a full disk after a few batches) names the shard, the free space, and
    about how much the shard needs; no partial file is left."""
    import errno
    import io

    from pretrain_bench.core.io import DiskFull

    corpus = write_jsonl(tmp_path / "train.jsonl", TEXTS)
    full = shard_split(corpus, tokenizer_dir, tmp_path / "whole", "train", 1, batch_bytes=20_000)
    size = (full[0].with_suffix(".bin")).stat().st_size
    class FullDisk(io.FileIO):
        """The shard's file on a disk that fills up after a third of the shard's bytes."""

        def write(self, data):
            if self.tell() + len(memoryview(data).cast("B")) > size // 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write(data)

    monkeypatch.setattr("pretrain_bench.core.digests.open", lambda path, mode: FullDisk(path, mode), raising=False)
    out = tmp_path / "full"
    with pytest.raises(DiskFull) as caught:
        shard_split(corpus, tokenizer_dir, out, "train", 1, batch_bytes=20_000)
    message = str(caught.value)
    assert f"no space left on device writing {out / 'train-00000.bin'} (" in message and "bytes free" in message
    needed = int(message.split("it needs about ")[1].split(" bytes")[0].replace(",", ""))
    assert 0.5 * size < needed < 2 * size, (needed, size)
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(out / "train-00000.bin")
    assert list(out.iterdir()) == [], "no partial shard left"


def test_the_rebuild_command_is_read_from_snakemakes_command_line_while_the_workflow_is_parsed():
    argv = ["snakemake", "--cores", "all", "--forcerun", "a.bin", "b.bin", "--configfile", "c.yaml", "--", "index"]
    assert command_line_forcing(argv) == ({"a.bin", "b.bin"}, False)
    assert command_line_forcing(["snakemake", "-R", "shard_tokens", "-F"]) == ({"shard_tokens"}, True)
    assert command_line_forcing(["snakemake", "--forcerun=x.bin", "y.bin", "-n"]) == ({"x.bin", "y.bin"}, False)
    assert command_line_forcing(["snakemake", "--", "a.bin"]) == (set(), False)
