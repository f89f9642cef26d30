"""Cleaning in parallel: the corpus stage as `corpus.jobs` part jobs over slices of the sources, and one merge.

The sources' files (builtin://, file:// globs; a dataset or a download is one indivisible unit) are cut into
contiguous slices of about equal bytes, in source order, one per part (`part_plan`). Each part job reads its slice
and does every per-document step of corpus.py that needs the text: NUL removal, encoding, min_chars, the sha256,
exact duplicates within the part, the content-hash split and the JSON encoding. It writes its surviving documents'
jsonl lines into two pieces, one per split, in the order read, and per document a small record: the sha256, the
text's bytes, the line's bytes, the source and the number within it (`clean_part`).

The merge decides from the records alone, in part order, which is the order one job reads the sources in: exact
de-duplication across parts (the first copy in source order is kept; a duplicate inside a part is one across parts
too, so dropping it early changes nothing), the cap (the first document past it and everything after), and an
empty split's fallback. What it keeps is, per split, a list of byte ranges of the parts' pieces, usually one whole
piece per part; it assembles train.jsonl and val.jsonl from those ranges in order: the first part's piece is moved
into place (cut after what is kept), the others' ranges are copied after it (os.copy_file_range: the kernel copies,
nothing is parsed again), while a second thread hashes the same ranges for the manifest (`merge_parts`). Its work
per byte is that copy and the manifest's sha256, which no number of parts shares out: a sha256 runs from the first
byte of a file to the last.

So the result is the single job's, byte for byte: the same documents in the same order in train.jsonl and
val.jsonl, the same split and manifest counts, except that the parts read their whole slices (where the cap falls is
known only when they are merged) and the manifest's `parts` says so. A weighted mixture draws documents from all
sources in one seeded sequence, which slices cannot reproduce: it is cleaned as one part, and `parts` says why.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import struct
import threading
from dataclasses import asdict, fields
from pathlib import Path

from pretrain_bench.core.io import atomic_write_text
from pretrain_bench.core.progress import Progress
from pretrain_bench.data.corpus import (
    SPLITS,
    CleaningSettings,
    Writeback,
    _mixture_weights,
    checked_sources,
    clean_document,
    count_move,
    finish_corpus,
    jsonl_line,
    split_place,
    val_threshold,
)
from pretrain_bench.data.sources import SourceStats, listing_sha256, read_source, source_kind, source_units

log = logging.getLogger(__name__)

# One record per document a part keeps, in the order read: its text's sha256, the text's UTF-8 bytes, its jsonl
# line's bytes, the source index and its number within that source. Written as the part goes (its memory stays
# flat); the merge needs nothing else to decide what it keeps.
PART_RECORD = struct.Struct("<32sQQIQ")
# The merge hashes the ranges it copies in pieces of this size (hashlib releases the GIL on each).
HASH_CHUNK_BYTES = 4 << 20
MIXTURE_REASON = ("a weighted mixture draws every document from all sources in one seeded sequence, which slices of "
                  "the sources cannot reproduce: cleaned as one part")
CAP_REASON = ("the parts read their whole slices: where the cap falls is known only once they are merged "
              "(corpus.jobs: 1 reads the sources only up to the cap)")


def corpus_parts(sources: list[dict], jobs: int | None, cpus: int, max_bytes: int | None = None) -> int:
    """How many part jobs clean the corpus: corpus.jobs, or (null) `cpus`, at most one per file of the sources; 1 for
    a weighted mixture. With a cap and jobs null, also 1 where one job, which stops reading at the cap, reads no more
    than each part would (the parts read their whole slices: where the cap falls is known only at the merge)."""
    sources = checked_sources(sources)
    if _mixture_weights(sources) is not None:
        return 1
    sizes = [size for source in sources for size in source_units(source)]
    parts = max(1, min(jobs or cpus, len(sizes)))
    sized = all(source_kind(source["uri"]) in ("builtin", "file") for source in sources)  # a download's size is unknown
    if jobs is None and max_bytes is not None and sized and sum(sizes) / parts >= max_bytes:
        return 1
    return parts


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
    """The four files part `part` writes in `folder`: its train and val pieces, its records and its stats."""
    stem = Path(folder) / f"part-{part:05d}"
    return {"train": stem.with_suffix(".train.jsonl"), "val": stem.with_suffix(".val.jsonl"),
            "records": stem.with_suffix(".records"), "stats": stem.with_suffix(".json")}


def clean_part(sources: list[dict], folder: Path, *, part: int, parts: int, min_chars: int, dedup: bool,
               val_fraction: float, encoding_errors: str, cache_dir: Path, **_unused) -> dict:
    """Clean part `part` of `parts` of the sources into `folder` (see part_paths); returns its stats record.

    `_unused`: the corpus keys the merge applies (max_bytes) or that order only a mixture (seed)."""
    settings = CleaningSettings(None, min_chars, dedup, val_fraction, encoding_errors)
    threshold = val_threshold(val_fraction)
    sources = checked_sources(sources)
    selection = part_plan(sources, parts)[part]
    sizes = {index: source_units(sources[index])[select] for index, select in selection.items()}
    paths = part_paths(folder, part)
    paths["records"].parent.mkdir(parents=True, exist_ok=True)
    all_stats = [SourceStats(uri=source["uri"], kind=source_kind(source["uri"])) for source in sources]
    kept, seen = 0, set()
    # file bytes as the total: of compressed or record files they differ from the text read, so the ETA is rough
    progress = Progress(f"cleaning part {part + 1}/{parts} (bytes read)", log,
                        total=sum(sum(units) for units in sizes.values()) or None)
    with (open(paths["train"], "wb") as train, open(paths["val"], "wb") as val,
          open(paths["records"], "wb") as records):
        pieces = {"train": train, "val": val}
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
                line = jsonl_line(text)
                pieces[split_place(digest, threshold)[0]].write(line)
                records.write(PART_RECORD.pack(digest, len(data), len(line), index, number))
                kept += 1
    progress.finish(f"{kept:,} documents kept")
    record = {"part": part, "parts": parts, "read": sorted(selection), "selection": {
        str(index): [select.start, select.stop] for index, select in selection.items()},
        "sources": [asdict(stats) for stats in all_stats]}
    atomic_write_text(paths["stats"], json.dumps(record, indent=1) + "\n")
    return record


def merge_parts(sources: list[dict], folder: Path, out_dir: Path, *, parts: int, max_bytes: int | None,
                min_chars: int, dedup: bool, val_fraction: float, encoding_errors: str, **_unused) -> dict:
    """Merge the parts in `folder` into out_dir/{train,val}.jsonl and manifest.json (the module docstring). The
    parts are spent: the first one's pieces become the start of the files."""
    settings = CleaningSettings(max_bytes, min_chars, dedup, val_fraction, encoding_errors)
    sources = checked_sources(sources)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    part_stats = [json.loads(part_paths(folder, part)["stats"].read_text()) for part in range(parts)]
    all_stats = _merged_stats(sources, part_stats)
    files = _Assembly(out_dir, Path(folder), parts, val_fraction)
    try:
        cap = _merge_documents(files, part_stats, all_stats, settings)
        record = {"jobs": parts, "unread": CAP_REASON if max_bytes is not None else None}
        manifest = finish_corpus(files, out_dir, all_stats, settings, cap, None, record)
    except BaseException:
        files.discard()
        raise
    log.info("corpus: %d documents, %d bytes (train %d, val %d) from %d parts in %s", manifest["documents"],
             manifest["bytes"], manifest["train"]["documents"], manifest["val"]["documents"], parts, out_dir)
    return manifest


def _merge_documents(files: _Assembly, part_stats: list[dict], all_stats: list[SourceStats],
                     settings: CleaningSettings) -> dict:
    """Every part's records in order: duplicates across parts, the cap, the split, each kept document's byte range
    in its part's piece. Returns the manifest's cap."""
    seen: set[bytes] = set()
    kept_bytes, cut_at = 0, None
    offsets = [0] * len(all_stats)  # documents of each source read by the parts before this one
    for part in range(len(part_stats)):
        position = dict.fromkeys(SPLITS, 0)  # where the next line of each piece starts
        for digest, text_bytes, line_bytes, index, number in PART_RECORD.iter_unpack(
                part_paths(files.folder, part)["records"].read_bytes()):
            split, distance = split_place(digest, files.threshold)
            start = position[split]
            position[split] += line_bytes
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
            files.add(split, distance, files.piece_of[split][part], start, start + line_bytes, text_bytes, digest)
            stats.documents_out += 1
            stats.bytes_out += text_bytes
        if cut_at is not None:
            break
        for index, source in enumerate(part_stats[part]["sources"]):
            offsets[index] += source["documents_in"]
    return {"max_bytes": settings.max_bytes, "reached": cut_at is not None, "cut_at": cut_at}


class _Assembly:
    """train.jsonl and val.jsonl as the merge builds them: per split, the byte ranges [piece, start, stop] of the
    parts' pieces to copy, in order (a piece is a number into `pieces`), with the counts and the document nearest
    the train/val boundary; the files are written on close(). finish_corpus treats it as corpus._SplitFiles."""

    def __init__(self, out_dir: Path, folder: Path, parts: int, val_fraction: float):
        self.folder, self.threshold = folder, val_threshold(val_fraction)
        self.pieces = [part_paths(folder, part)[split] for split in SPLITS for part in range(parts)]
        self.piece_of = {split: [number * parts + part for part in range(parts)] for number, split in enumerate(SPLITS)}
        self.tmp = {split: out_dir / f"{split}.jsonl.tmp" for split in SPLITS}
        self.ranges: dict[str, list[list[int]]] = {split: [] for split in SPLITS}
        self.documents = dict.fromkeys(SPLITS, 0)
        self.bytes = dict.fromkeys(SPLITS, 0)
        self.nearest = dict.fromkeys(SPLITS)  # split -> (distance, line index, (piece, start, stop), text bytes, sha)
        self.file_digests: dict[str, hashlib._Hash] = {}

    def add(self, split: str, distance: int, piece: int, start: int, stop: int, text_bytes: int,
            digest: bytes) -> None:
        """A kept document: its split, its distance from the boundary, its line's range, text bytes and sha256."""
        nearest = self.nearest[split]
        if nearest is None or distance < nearest[0]:  # the first of equals, as _SplitFiles keeps it
            self.nearest[split] = (distance, self.documents[split], (piece, start, stop), text_bytes, digest)
        ranges = self.ranges[split]
        if ranges and ranges[-1][0] == piece and ranges[-1][2] == start:
            ranges[-1][2] = stop  # the next line of the same piece: one longer copy
        else:
            ranges.append([piece, start, stop])
        self.documents[split] += 1
        self.bytes[split] += text_bytes

    def move_nearest(self, source: str, target: str) -> dict:
        """Move `source`'s document nearest the boundary to the end of `target` (corpus._SplitFiles.move_nearest)."""
        _, _, (moved, start, stop), text_bytes, digest = self.nearest[source]
        kept = []
        for piece, first, last in self.ranges[source]:
            if piece == moved and first <= start and stop <= last:  # cut the line out of its range
                kept += [[piece, first, start]] * (first < start) + [[piece, stop, last]] * (stop < last)
            else:
                kept.append([piece, first, last])
        self.ranges[source] = kept
        self.ranges[target].append([moved, start, stop])
        return count_move(self.documents, self.bytes, source, target, text_bytes, digest)

    def close(self) -> None:
        """Write both files: a thread copies the ranges and syncs the files while this one hashes the same bytes. A
        piece that starts its file and is read nowhere else (the first part's, unless the fallback took a line out
        of it) is moved into place and cut to its kept length instead of copied: the part's files are spent then."""
        total = sum(stop - start for ranges in self.ranges.values() for _, start, stop in ranges)
        progress = Progress("assembling train.jsonl and val.jsonl (bytes hashed)", log, total=total or None)
        handles = {}
        try:
            sources = {split: [_opened(self.pieces[piece], handles) for piece, _, _ in self.ranges[split]]
                       for split in SPLITS}
            in_place = {split: self._move_first_piece(split) for split in SPLITS}
            copier = _Copier(self.tmp, sources, self.ranges, in_place)
            copier.start()
            for split in SPLITS:
                self.file_digests[split] = _hash_ranges(sources[split], self.ranges[split], progress)
            copier.join()
            copier.check()
        finally:
            for handle in handles.values():
                os.close(handle)
        progress.finish()

    def _move_first_piece(self, split: str) -> bool:
        """Move the piece of `split`'s first range into place as the start of its file when the range starts the
        piece and no other range reads it; cut it after the range. Whether it was moved."""
        ranges = self.ranges[split]
        if not ranges or ranges[0][1] != 0:
            return False
        piece, _, stop = ranges[0]
        if any(other[0] == piece for name in SPLITS for other in self.ranges[name] if other is not ranges[0]):
            return False
        try:
            os.replace(self.pieces[piece], self.tmp[split])
        except OSError as error:  # the output on another file system: copy it like the rest
            if error.errno != errno.EXDEV:
                raise
            return False
        os.truncate(self.tmp[split], stop)
        return True

    def discard(self) -> None:
        for path in self.tmp.values():
            path.unlink(missing_ok=True)


def _opened(path: Path, handles: dict[Path, int]) -> int:
    """A read descriptor on `path`, opened once."""
    if path not in handles:
        handles[path] = os.open(path, os.O_RDONLY)
    return handles[path]


class _Copier(threading.Thread):
    """Copies each split's ranges into its temporary file (after its first range where that is in place already),
    its pages written to disk as it goes (Writeback), then syncs it (durable before the rename)."""

    def __init__(self, targets: dict[str, Path], sources: dict[str, list[int]], ranges: dict[str, list[list]],
                 in_place: dict[str, bool]):
        super().__init__(name="corpus merge copier", daemon=True)
        self.targets, self.sources, self.ranges, self.in_place = targets, sources, ranges, in_place
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for split, target in self.targets.items():
                skip = int(self.in_place[split])
                # not append mode: copy_file_range refuses a descriptor opened with O_APPEND
                with open(target, "r+b" if skip else "wb") as out:
                    out.seek(0, os.SEEK_END)
                    writeback = Writeback([out.fileno()])
                    try:
                        for source, (_, start, stop) in list(zip(self.sources[split], self.ranges[split]))[skip:]:
                            _copy_range(source, out.fileno(), start, stop - start)
                    finally:
                        writeback.stop()
                    os.fsync(out.fileno())
        except BaseException as error:  # raised again in the merging thread
            self.error = error

    def check(self) -> None:
        if self.error is not None:
            raise self.error


def _copy_range(source: int, target: int, start: int, length: int) -> None:
    """Append `length` bytes of `source` from `start` to `target`: os.copy_file_range (the kernel copies, or
    shares the blocks where the file system can), else read and write where it is not available."""
    try:
        while length:
            copied = os.copy_file_range(source, target, length, start)
            if copied == 0:
                raise OSError(errno.EIO, f"a part's piece ended {length} bytes early")
            start, length = start + copied, length - copied
        return
    except AttributeError:  # not Linux
        pass
    except OSError as error:
        if error.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
    while length:
        data = os.pread(source, min(length, HASH_CHUNK_BYTES), start)
        if not data:
            raise OSError(errno.EIO, f"a part's piece ended {length} bytes early")
        os.write(target, data)
        start, length = start + len(data), length - len(data)


def _hash_ranges(sources: list[int], ranges: list[list], progress: Progress):
    """The sha256 of the bytes `ranges` of `sources` hold, in order: the file the copier writes."""
    digest = hashlib.sha256()
    buffer = bytearray(HASH_CHUNK_BYTES)
    view = memoryview(buffer)
    for source, (_, start, stop) in zip(sources, ranges):
        while start < stop:
            count = os.preadv(source, [view[:min(stop - start, HASH_CHUNK_BYTES)]], start)
            if count == 0:
                raise OSError(errno.EIO, f"a part's piece ended {stop - start} bytes early")
            digest.update(view[:count])
            start += count
            progress.advance(count)
    return digest


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
