"""pretrain_bench.corpus_parts: the corpus cleaned as part jobs and merged equals the one a single job writes."""
import json
from pathlib import Path

import pytest

from pretrain_bench.corpus import build_corpus
from pretrain_bench.corpus_parts import clean_part, corpus_parts, merge_parts, part_plan

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
