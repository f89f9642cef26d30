"""pretrain_bench.data.corpus_parts: the corpus cleaned as part jobs and merged equals the one a single job writes."""
import hashlib
import json
import logging
from pathlib import Path

import pytest

from pretrain_bench.data.corpus import build_corpus
from pretrain_bench.data.corpus_parts import clean_part, corpus_parts, merge_parts, part_paths, part_plan
from pretrain_bench.data.sources import source_units

SETTINGS = {"min_chars": 5, "dedup": True, "val_fraction": 0.2, "encoding_errors": "replace"}
COUNTS = ("documents", "bytes", "train", "val", "replaced_chars", "nul_removed", "binary_skipped", "split")


def source_tree(tmp_path: Path) -> list[dict]:
    """Twelve files of documents of unequal sizes, with duplicates inside a file, across files far apart, short
    documents, NULs, invalid UTF-8 and a binary file; then the standard library as a second source."""
    folder = tmp_path / "tree"
    folder.mkdir()
    for number in range(12):
        texts = [f"file {number} document {i} " + "word " * (i * 7 % 40) for i in range(30)]
        texts += ["a document repeated in every file", "tiny", f"nul\x00 in file {number}"]
        (folder / f"{number:02d}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (folder / "notes.md").write_bytes(b"caf\xe9 au lait, a Latin-1 note of some length")
    (folder / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
    return [{"uri": f"file://{folder}/*"}, {"uri": "builtin://python-stdlib"}]


def in_parts(sources, tmp_path: Path, parts: int, name: str, **settings) -> tuple[Path, dict]:
    folder, out = tmp_path / f"{name}-parts", tmp_path / name
    for part in range(parts):
        clean_part(sources, folder, part=part, parts=parts, cache_dir=tmp_path / "cache", **settings)
    return out, merge_parts(sources, folder, out, parts=parts, **settings)


@pytest.mark.parametrize("max_bytes", [None, 2_000_000])
def test_parts_merged_equal_one_job_byte_for_byte(tmp_path, max_bytes):
    sources = source_tree(tmp_path)
    settings = {**SETTINGS, "max_bytes": max_bytes}
    one = build_corpus(sources, tmp_path / "one", cache_dir=tmp_path / "cache", **settings)
    for parts in (2, 5):
        out, merged = in_parts(sources, tmp_path, parts, f"merged{parts}", **settings)
        for split in ("train", "val"):
            assert (out / f"{split}.jsonl").read_bytes() == (tmp_path / "one" / f"{split}.jsonl").read_bytes()
        assert {key: merged[key] for key in COUNTS} == {key: one[key] for key in COUNTS}
        assert merged["cap"]["cut_at"] == one["cap"]["cut_at"] and merged["parts"]["jobs"] == parts
        assert [s["sha256"] for s in merged["sources"]] == [s["sha256"] for s in one["sources"]]
        assert merged["sources"][0]["details"]["file_sha256"] == one["sources"][0]["details"]["file_sha256"]
        assert merged["dropped"]["duplicate"] == one["dropped"]["duplicate"] >= 11, "kept once across all parts"
        if max_bytes is None:
            assert merged["documents_in"] == one["documents_in"] and merged["dropped"] == one["dropped"]
            assert merged["parts"]["unread"] is None
        else:  # one job stops reading at the cut; the parts cannot know where it falls, and the manifest says so
            assert merged["documents_in"] > one["documents_in"] and "whole slices" in merged["parts"]["unread"]


def test_slices_are_contiguous_balanced_and_cover_every_file(tmp_path):
    sources = source_tree(tmp_path)
    plan = part_plan(sources, 4)
    for index in range(len(sources)):
        slices = [part[index] for part in plan if index in part]
        assert slices[0].start == 0 and all(a.stop == b.start for a, b in zip(slices, slices[1:]))
    assert sum(len(part) for part in plan) >= 4, "the standard library alone spans several parts"


def test_how_many_parts(tmp_path):
    sources = source_tree(tmp_path)
    assert corpus_parts(sources, None, 16) == 16 and corpus_parts(sources, 3, 16) == 3
    assert corpus_parts(sources[:1], None, 64) == 14, "at most one part per file"
    weighted = [{**source, "weight": 1} for source in sources]
    assert corpus_parts(weighted, 8, 16) == 1, "a weighted mixture is one seeded sequence"


def test_a_cap_that_stops_one_job_sooner_than_a_part_runs_one_job(tmp_path):
    sources = source_tree(tmp_path)
    total = sum(sum(source_units(source)) for source in sources)
    assert corpus_parts(sources, None, 2, max_bytes=total // 4) == 1, "one job reads a quarter, each part a half"
    assert corpus_parts(sources, None, 2, max_bytes=total) == 2, "the cap is past a part's share: parts are faster"
    assert corpus_parts(sources, 2, 2, max_bytes=total // 4) == 2, "an explicit corpus.jobs is kept"
    assert corpus_parts(sources, None, 2, max_bytes=None) == 2


def texts_in(split: str, val_fraction: float, count: int) -> list[str]:
    """`count` distinct documents whose content hash puts them all in `split`."""
    threshold, texts, number = int(val_fraction * 2**64), [], 0
    while len(texts) < count:
        text = f"document {number} of a corpus with one split only"
        score = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
        if (score < threshold) == (split == "val"):
            texts.append(text)
        number += 1
    return texts


@pytest.mark.parametrize("split", ["train", "val"])
def test_an_empty_split_gets_the_same_document_from_the_parts_and_one_job(tmp_path, split):
    """Every document falls into one split by hash: the one nearest the boundary moves to the other, wherever it lies
    in the parts' pieces, and the files equal the single job's."""
    texts = texts_in(split, 0.5, 24)
    folder = tmp_path / "tree"
    folder.mkdir()
    for number in range(4):
        (folder / f"{number}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[number::4]))
    sources = [{"uri": f"file://{folder}/*.jsonl"}]
    settings = {**SETTINGS, "val_fraction": 0.5, "max_bytes": None}
    one = build_corpus(sources, tmp_path / "one", cache_dir=tmp_path / "cache", **settings)
    assert one["split"]["fallback"]["moved"] == f"{split}->{'val' if split == 'train' else 'train'}"
    for parts in (2, 3):
        out, merged = in_parts(sources, tmp_path, parts, f"merged{parts}", **settings)
        for name in ("train", "val"):
            assert (out / f"{name}.jsonl").read_bytes() == (tmp_path / "one" / f"{name}.jsonl").read_bytes()
            assert merged[name] == one[name]
        assert merged["split"] == one["split"]


def test_the_merge_copies_the_parts_lines_as_bytes_and_hashes_what_it_wrote(tmp_path):
    """The merge decides from the parts' records alone and copies byte ranges of their pieces: lines it never
    parses (here upper-cased after the parts wrote them, lengths unchanged) come out as the pieces hold them."""
    sources = source_tree(tmp_path)
    folder = tmp_path / "parts"
    for part in range(2):
        clean_part(sources, folder, part=part, parts=2, cache_dir=tmp_path / "cache", max_bytes=None, **SETTINGS)
        for split in ("train", "val"):
            piece = part_paths(folder, part)[split]
            piece.write_bytes(piece.read_bytes().upper())
    build_corpus(sources, tmp_path / "one", cache_dir=tmp_path / "cache", max_bytes=None, **SETTINGS)
    merged = merge_parts(sources, folder, tmp_path / "merged", parts=2, max_bytes=None, **SETTINGS)
    for split in ("train", "val"):
        written = (tmp_path / "merged" / f"{split}.jsonl").read_bytes()
        assert written == (tmp_path / "one" / f"{split}.jsonl").read_bytes().upper()
        assert merged[split]["sha256"] == hashlib.sha256(written).hexdigest()


def test_the_part_jobs_and_the_merge_log_progress_with_rate_and_eta(tmp_path, monkeypatch, caplog):
    from pretrain_bench.core import progress

    monkeypatch.setattr(progress, "INTERVAL_S", 0.0)  # a line per update instead of one per 10 s
    caplog.set_level(logging.INFO, logger="pretrain_bench")
    sources = source_tree(tmp_path)
    out, _ = in_parts(sources, tmp_path, 2, "merged", max_bytes=None, **SETTINGS)
    lines = [record.getMessage() for record in caplog.records]
    for what in ("cleaning part 1/2 (bytes read): ", "cleaning part 2/2 (bytes read): ",
                 "assembling train.jsonl and val.jsonl (bytes hashed): "):
        assert any(line.startswith(what) and "MiB/s" in line and "ETA" in line for line in lines), (what, lines[-5:])
