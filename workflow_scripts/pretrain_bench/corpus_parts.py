"""Cleaning in parallel: the corpus stage as `corpus.jobs` part jobs over slices of the sources, and one merge.

The sources' files (builtin://, file:// globs; a dataset or a download is one indivisible unit) are cut into
contiguous slices of about equal bytes, in source order, one per part (`part_plan`). Each part job reads its slice
and does the per-document steps of corpus.py (NUL removal, encoding, min_chars, the sha256, exact duplicates within
the part), writing the surviving documents as jsonl lines plus, per document, its sha256, text bytes, source and
number within the source (`clean_part`). The merge reads the parts in order, which is the order one job reads the
sources in, and does what needs every document before it: exact de-duplication across parts (a duplicate inside a
part is one across parts too, so dropping it early changes nothing), the cap, and the content-hash split; it copies
the kept lines without decoding them again (`merge_parts`).

So the result is the single job's, byte for byte: the same documents in the same order in train.jsonl and
val.jsonl, the same split and manifest counts, except that the parts read their whole slices (where the cap falls is
known only when they are merged) and the manifest's `parts` says so. A weighted mixture draws documents from all
sources in one seeded sequence, which slices cannot reproduce: it is cleaned as one part, and `parts` says why.
"""
from __future__ import annotations

import json
import logging
import os
import struct
from dataclasses import asdict, fields
from pathlib import Path

from pretrain_bench.corpus import (
    CleaningSettings,
    _mixture_weights,
    _SplitFiles,
    checked_sources,
    clean_document,
    finish_corpus,
    jsonl_line,
)
from pretrain_bench.corpus_sources import SourceStats, listing_sha256, read_source, source_kind, source_units
from pretrain_bench.io import atomic_write_text
from pretrain_bench.progress import Progress

log = logging.getLogger(__name__)

# One record per document a part keeps: its sha256, text bytes, source index and number within that source, written
# as it goes (a part's memory stays flat).
PART_RECORD = struct.Struct("<32sQIQ")
MIXTURE_REASON = ("a weighted mixture draws every document from all sources in one seeded sequence, which slices of "
                  "the sources cannot reproduce: cleaned as one part")
CAP_REASON = ("the parts read their whole slices: where the cap falls is known only once they are merged "
              "(corpus.jobs: 1 reads the sources only up to the cap)")


def corpus_parts(sources: list[dict], jobs: int | None, cpus: int) -> int:
    """How many part jobs clean the corpus: corpus.jobs, or (null) `cpus`, at most one per file of the sources; 1 for
    a weighted mixture."""
    sources = checked_sources(sources)
    if _mixture_weights(sources) is not None:
        return 1
    units = sum(len(source_units(source)) for source in sources)
    return max(1, min(jobs or cpus, units))


def part_plan(sources: list[dict], parts: int) -> list[dict[int, slice]]:
    """Per part, {source index: the slice of its files the part reads}: contiguous in source order, about equal
    bytes (a unit goes to the part its middle byte falls in)."""
    units = [(index, size) for index, source in enumerate(sources) for size in source_units(source)]
    total = sum(size for _, size in units)
    plan: list[dict[int, slice]] = [{} for _ in range(parts)]
    before, position = 0, {}
    for number, (index, size) in enumerate(units):
        middle = (before + size / 2) / total if total else (number + 0.5) / len(units)
        part = min(parts - 1, int(middle * parts))
        start = position.setdefault(index, 0)
        current = plan[part].get(index)
        plan[part][index] = slice(current.start if current else start, start + 1)
        position[index] = start + 1
        before += size
    return plan


def part_paths(folder: Path, part: int) -> dict[str, Path]:
    """The three files part `part` writes in `folder`."""
    stem = Path(folder) / f"part-{part:05d}"
    return {"lines": stem.with_suffix(".jsonl"), "records": stem.with_suffix(".records"),
            "stats": stem.with_suffix(".json")}


def clean_part(sources: list[dict], folder: Path, *, part: int, parts: int, min_chars: int, dedup: bool,
               encoding_errors: str, cache_dir: Path, **_unused) -> dict:
    """Clean part `part` of `parts` of the sources into `folder` (see part_paths); returns its stats record.

    `_unused`: the corpus keys the merge applies (max_bytes, val_fraction, seed)."""
    settings = CleaningSettings(None, min_chars, dedup, 0.5, encoding_errors)
    sources = checked_sources(sources)
    selection = part_plan(sources, parts)[part]
    sizes = {index: source_units(sources[index])[select] for index, select in selection.items()}
    paths = part_paths(folder, part)
    paths["lines"].parent.mkdir(parents=True, exist_ok=True)
    all_stats = [SourceStats(uri=source["uri"], kind=source_kind(source["uri"])) for source in sources]
    kept, seen = 0, set()
    # file bytes as the total: of compressed or record files they differ from the text read, so the ETA is rough
    progress = Progress(f"cleaning part {part + 1}/{parts} (bytes read)", log,
                        total=sum(sum(units) for units in sizes.values()) or None)
    with open(paths["lines"], "wb") as lines, open(paths["records"], "wb") as records:
        for index, select in sorted(selection.items()):
            stats = all_stats[index]
            reader = read_source(sources[index], stats, encoding_errors, Path(cache_dir), select)
            for number, text in enumerate(reader):
                read_bytes, document = clean_document(text, stats, settings, stats.uri, number)
                progress.advance(read_bytes)
                if document is None:
                    continue
                text, data, digest = document
                if dedup and digest in seen:
                    stats.dropped["duplicate"] += 1
                    continue
                seen.add(digest)
                lines.write(jsonl_line(text))
                records.write(PART_RECORD.pack(digest, len(data), index, number))
                kept += 1
    progress.finish(f"{kept:,} documents kept")
    record = {"part": part, "parts": parts, "read": sorted(selection), "selection": {
        str(index): [select.start, select.stop] for index, select in selection.items()},
        "sources": [asdict(stats) for stats in all_stats]}
    atomic_write_text(paths["stats"], json.dumps(record, indent=1) + "\n")
    return record


def merge_parts(sources: list[dict], folder: Path, out_dir: Path, *, parts: int, max_bytes: int | None,
                min_chars: int, dedup: bool, val_fraction: float, encoding_errors: str, **_unused) -> dict:
    """Merge the parts in `folder` into out_dir/{train,val}.jsonl and manifest.json (the module docstring)."""
    settings = CleaningSettings(max_bytes, min_chars, dedup, val_fraction, encoding_errors)
    sources = checked_sources(sources)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    part_stats = [json.loads(part_paths(folder, part)["stats"].read_text()) for part in range(parts)]
    all_stats = _merged_stats(sources, part_stats)
    files = _SplitFiles(out_dir, val_fraction)
    try:
        cap = _merge_documents(folder, parts, part_stats, all_stats, settings, files)
        record = {"jobs": parts, "unread": CAP_REASON if max_bytes is not None else None}
        manifest = finish_corpus(files, out_dir, all_stats, settings, cap, None, record)
    except BaseException:
        files.discard()
        raise
    log.info("corpus: %d documents, %d bytes (train %d, val %d) from %d parts in %s", manifest["documents"],
             manifest["bytes"], manifest["train"]["documents"], manifest["val"]["documents"], parts, out_dir)
    return manifest


def _merge_documents(folder: Path, parts: int, part_stats: list[dict], all_stats: list[SourceStats],
                     settings: CleaningSettings, files: _SplitFiles) -> dict:
    """Every part's documents in order: duplicates across parts, the cap, the split. Returns the manifest's cap."""
    seen: set[bytes] = set()
    kept_bytes, cut_at = 0, None
    offsets = [0] * len(all_stats)  # documents of each source read by the parts before this one
    progress = Progress("merging parts (kept bytes)", log, total=settings.max_bytes)
    for part in range(parts):
        paths = part_paths(folder, part)
        records = PART_RECORD.iter_unpack(paths["records"].read_bytes())
        with open(paths["lines"], "rb") as lines:
            for (digest, text_bytes, index, number), line in zip(records, lines, strict=True):
                stats = all_stats[index]
                if settings.dedup and digest in seen:
                    stats.dropped["duplicate"] += 1
                    continue
                seen.add(digest)
                if settings.max_bytes is not None and kept_bytes + text_bytes > settings.max_bytes:
                    cut_at = {"source": stats.uri, "document_index": offsets[index] + number}
                    stats.dropped["over_cap"] += 1
                    break
                kept_bytes += text_bytes
                files.add_line(line, text_bytes, digest)
                stats.documents_out += 1
                stats.bytes_out += text_bytes
                progress.advance(text_bytes)
        if cut_at is not None:
            break
        for index, source in enumerate(part_stats[part]["sources"]):
            offsets[index] += source["documents_in"]
    progress.finish()
    return {"max_bytes": settings.max_bytes, "reached": cut_at is not None, "cut_at": cut_at}


def _merged_stats(sources: list[dict], part_stats: list[dict]) -> list[SourceStats]:
    """Per source, the parts' counts summed and their details joined (files hashed, binary files, provenance)."""
    merged = [SourceStats(uri=source["uri"], kind=source_kind(source["uri"])) for source in sources]
    counters = [f.name for f in fields(SourceStats) if f.type == "int" and f.name not in ("documents_out", "bytes_out")]
    for record in part_stats:
        for index in record["read"]:
            stats, part = merged[index], record["sources"][index]
            for name in counters:
                setattr(stats, name, getattr(stats, name) + part[name])
            for reason, count in part["dropped"].items():
                stats.dropped[reason] += count
            _join_details(stats.details, part["details"])
            stats.sha256 = stats.sha256 or part["sha256"]
    for stats in merged:
        hashed = stats.details.get("file_sha256")
        if hashed and len(hashed) > 1:
            stats.sha256 = listing_sha256(hashed)
    return merged


def _join_details(into: dict, part: dict) -> None:
    for key, value in part.items():
        if key == "file_sha256":
            into.setdefault(key, {}).update(value)
        elif key == "files_read":
            into[key] = into.get(key, 0) + value
        elif key == "binary_files":
            into[key] = (into.get(key, []) + value)[:20]
        else:
            into.setdefault(key, value)


def machine_cpus() -> int:
    """The CPUs this process may run on (its affinity, which a container or `taskset` narrows), else the count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
