"""Data at scale: weighted mixtures, streamed hf:// datasets stopping at the cap, revision pins, progress lines."""
import json
import logging
from pathlib import Path

import pytest

from httpfixture import FixtureServer, Route
from pretrain_bench.core import progress
from pretrain_bench.data.corpus import CorpusError, build_corpus
from pretrain_bench.data.download import download

ROOT = Path(__file__).parents[2]

SETTINGS = {"min_chars": 1, "dedup": True, "val_fraction": 0.1, "encoding_errors": "replace"}


def jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def sources(tmp_path: Path, weights=(3, 1)) -> list[dict]:
    a = jsonl(tmp_path / "a.jsonl", [f"alpha {i} " + "a" * 90 for i in range(400)])
    b = jsonl(tmp_path / "b.jsonl", [f"beta {i} " + "b" * 90 for i in range(400)])
    return [{"uri": f"file://{a}", "weight": weights[0]}, {"uri": f"file://{b}", "weight": weights[1]}]


def kept(out: Path) -> list[str]:
    return [json.loads(line)["text"] for split in ("train", "val")
            for line in (out / f"{split}.jsonl").read_text().splitlines()]


def test_weighted_mixture_keeps_the_proportions_under_the_cap_deterministically(tmp_path):
    mix = sources(tmp_path)
    manifest = build_corpus(mix, tmp_path / "one", max_bytes=20_000, cache_dir=tmp_path / "c", seed=7, **SETTINGS)
    shares = {s["uri"]: s["share_kept_bytes"] for s in manifest["mixture"]["sources"]}
    assert shares[mix[0]["uri"]] == pytest.approx(0.75, abs=0.08), shares
    assert [s["weight"] for s in manifest["mixture"]["sources"]] == [3.0, 1.0] and manifest["mixture"]["seed"] == 7
    # concatenation would have kept only the first source
    assert any(text.startswith("beta") for text in kept(tmp_path / "one"))
    again = build_corpus(mix, tmp_path / "two", max_bytes=20_000, cache_dir=tmp_path / "c", seed=7, **SETTINGS)
    assert kept(tmp_path / "two") == kept(tmp_path / "one") and again["train"]["sha256"] == manifest["train"]["sha256"]
    other = build_corpus(mix, tmp_path / "three", max_bytes=20_000, cache_dir=tmp_path / "c", seed=8, **SETTINGS)
    assert other["train"]["sha256"] != manifest["train"]["sha256"], "the seed decides the draws"


def test_mixture_needs_a_weight_on_every_source(tmp_path):
    mix = sources(tmp_path)
    del mix[1]["weight"]
    with pytest.raises(CorpusError, match=r"corpus.sources\[1\] have no weight"):
        build_corpus(mix, tmp_path / "out", max_bytes=None, cache_dir=tmp_path / "c", **SETTINGS)


def test_streamed_hf_dataset_stops_at_the_cap_and_records_the_revision(tmp_path):
    pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    folder.mkdir()
    jsonl(folder / "train.jsonl", [f"row {i} " + "x" * 200 for i in range(2000)])
    source = {"uri": f"hf://{folder}", "split": "train", "streaming": True}
    manifest = build_corpus([source], tmp_path / "out", max_bytes=10_000, cache_dir=tmp_path / "c", **SETTINGS)
    details = manifest["sources"][0]["details"]
    assert details["streaming"] is True and details["stopped_at_cap"] is True
    assert manifest["bytes"] <= 10_000 and manifest["documents_in"] < 100, "the rest of the stream was not read"
    assert not (tmp_path / "c" / "hf").exists() or not any((tmp_path / "c" / "hf").rglob("*.arrow")), \
        "a streamed dataset is not cached whole"
    # a revision is passed to datasets and recorded (a local folder has no revisions: datasets ignores it)
    pinned = build_corpus([{**source, "revision": "main"}], tmp_path / "pinned", max_bytes=10_000,
                          cache_dir=tmp_path / "c", **SETTINGS)
    assert pinned["sources"][0]["details"]["revision"] == "main"


def test_progress_lines_with_rate_and_eta_in_every_data_stage(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(progress, "INTERVAL_S", 0.0)  # a line per update instead of one per 10 s
    caplog.set_level(logging.INFO, logger="pretrain_bench")
    body = b"x" * (1 << 18)
    with FixtureServer({"/data.txt": Route(body)}) as server:
        download(server.url("/data.txt"), tmp_path / "data.txt")
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith(f"download {server.url('/data.txt')}: ") and "of 0.2 MiB" in line and "MiB/s" in line
               and "ETA" in line for line in lines), lines
    caplog.clear()
    build_corpus(sources(tmp_path), tmp_path / "out", max_bytes=20_000, cache_dir=tmp_path / "c", **SETTINGS)
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("cleaning (kept bytes): ") and "ETA" in line and "documents read" in line
               for line in lines), lines
    assert any(line.startswith("cleaning (kept bytes): done") for line in lines)

    from pretrain_bench.data.shards import encode_shard
    from pretrain_bench.data.tokenizer import train_tokenizer

    caplog.clear()
    train_tokenizer(tmp_path / "out" / "train.jsonl", tmp_path / "tok", vocab_size=300, train_bytes=10_000)
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("BPE word counts (sample bytes): ") and "MiB/s" in line and "ETA" in line
               for line in lines), lines
    assert any(line.startswith("BPE training (300 tokens): done in ") for line in lines), lines
    caplog.clear()
    encode_shard(tmp_path / "out" / "train.jsonl", tmp_path / "tok", tmp_path / "s.bin", tmp_path / "s.json",
                 split="train", index=0, count=1, batch_bytes=2_000)
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("train shard 0/1: ") and "ETA" in line and "tokens" in line for line in lines), lines
