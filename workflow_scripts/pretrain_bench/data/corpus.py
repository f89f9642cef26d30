"""Corpus cleaning: sources (read by sources.py) -> cleaned documents -> train/val split -> jsonl + manifest.

Each document passes these steps in source order (or, when the sources carry a `weight`, in mixture order: each
next document is drawn from a source chosen at random in proportion to its weight, from a generator seeded with
`seed`, until every source is exhausted, so the kept prefix under `max_bytes` holds the sources in those
proportions; the manifest records the weights and the shares kept); every step is counted in manifest.json:
1) read from builtin://python-stdlib, hf://<dataset>, http(s)://… or file://path-or-glob and decode as UTF-8 under
   `encoding_errors` (strict: fail naming the file and byte offset; replace: substitute U+FFFD and count);
2) remove NUL characters (counted): they break C-string based tools downstream and carry no text;
3) drop documents shorter than `min_chars` characters, surrounding whitespace not counted (`too_short`);
4) drop exact duplicates by the sha256 of the UTF-8 text (`duplicate`, when `dedup`);
5) cap: the first document that would take the kept text past `max_bytes`, and every document after it, is cut. The
   kept corpus is a prefix of the cleaned stream (of the sources in order, or of the mixture's seeded draws), so the
   same inputs always give the same cut, and nothing after the cut can be kept: reading stops there. That document
   counts as `over_cap`; the rest is never read (no later file is opened, no more rows are downloaded), and the
   manifest's `cap` says so, with `documents_in` / `bytes_in` counting what was read;
6) split by content hash: a document goes to val when the first 8 bytes of its sha256, read as a fraction of 2**64,
   fall below `val_fraction`. The split depends on the text alone, so appending a source never moves a document.

Because that split is a per-document coin toss, a small corpus can end with an empty val (or train) split. Then the
one document whose hash lies nearest the boundary moves into the empty split (`split.fallback` in the manifest);
fewer than two documents is an error, as is an empty corpus. The tiny CPU run needs a non-empty val.

With corpus.jobs above 1 the workflow runs steps 1-4 as part jobs over slices of the sources and merges them
(corpus_parts.py); the merge gives this single pass's train.jsonl and val.jsonl byte for byte.

Outputs in out_dir: train.jsonl and val.jsonl (one compact `{"text":...}` object per line, documents in input order) and
manifest.json. Everything is written to `*.tmp` first and moved into place with os.replace only after every source
was read, so a failed build leaves no partial file; the old manifest is removed before the new files move in, so a
manifest on disk always describes the jsonl files beside it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import random
import re
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

from pretrain_bench.config.schema import corpus_source, schema_default
from pretrain_bench.core.io import atomic_write_text
from pretrain_bench.core.progress import Progress
from pretrain_bench.data.sources import DROP_REASONS, CorpusError, SourceStats, read_source, source_kind

log = logging.getLogger(__name__)

SPLITS = ("train", "val")
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class CleaningSettings:
    """The cleaning knobs (the corpus.* config keys), validated once and recorded in manifest.json."""

    max_bytes: int | None  # cap on kept UTF-8 text bytes over all sources; None = no cap
    min_chars: int  # documents with fewer characters (surrounding whitespace not counted) are dropped
    dedup: bool  # drop exact duplicates: same sha256 of the UTF-8 text
    val_fraction: float  # share of documents, chosen by content hash, held out for validation
    encoding_errors: str  # strict: invalid UTF-8 is an error; replace: substitute U+FFFD and count

    def __post_init__(self) -> None:
        if self.max_bytes is not None and (not isinstance(self.max_bytes, int) or self.max_bytes < 1):
            raise CorpusError(f"corpus.max_bytes must be a positive integer or null, got {self.max_bytes!r}")
        if not isinstance(self.min_chars, int) or self.min_chars < 0:
            raise CorpusError(f"corpus.min_chars must be an integer >= 0, got {self.min_chars!r}")
        if not 0 < self.val_fraction <= 0.5:
            raise CorpusError(f"corpus.val_fraction must be in (0, 0.5], got {self.val_fraction!r}")
        if self.encoding_errors not in ("strict", "replace"):
            raise CorpusError(f"corpus.encoding_errors must be 'strict' or 'replace', got {self.encoding_errors!r}")


def build_corpus(sources: list[dict], out_dir: Path, *, max_bytes: int | None, min_chars: int, dedup: bool,
                 val_fraction: float, encoding_errors: str, cache_dir: Path,
                 seed: int = schema_default("corpus", "seed")) -> dict:
    """Read, clean, de-duplicate, cap and split `sources` into out_dir/{train,val}.jsonl; return the manifest.

    `seed` orders a weighted mixture (sources with `weight`); it is unused when no source has one."""
    settings = CleaningSettings(max_bytes, min_chars, dedup, val_fraction, encoding_errors)
    sources = checked_sources(sources)
    weights = _mixture_weights(sources)
    out_dir, cache_dir = Path(out_dir), Path(cache_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = _SplitFiles(out_dir, val_fraction)
    try:
        all_stats, cap = _clean_all(sources, settings, files, cache_dir, weights, seed)
        manifest = finish_corpus(files, out_dir, all_stats, settings, cap, _mixture_record(weights, seed, all_stats))
    except BaseException:
        files.discard()
        raise
    log.info("corpus: %d documents, %d bytes (train %d, val %d) in %s", manifest["documents"], manifest["bytes"],
             manifest["train"]["documents"], manifest["val"]["documents"], out_dir)
    return manifest


def checked_sources(sources: list[dict]) -> list[dict]:
    """corpus.sources with the schema's defaults filled in; a CorpusError for an empty list or an entry without uri."""
    if not sources:
        raise CorpusError("corpus.sources is empty: name at least one source")
    for number, source in enumerate(sources):
        if not isinstance(source, dict) or not isinstance(source.get("uri"), str):
            raise CorpusError(f"corpus.sources[{number}] needs a 'uri' string, got {source!r}")
    return [corpus_source(source) for source in sources]


def finish_corpus(files: _SplitFiles, out_dir: Path, all_stats: list[SourceStats], settings: CleaningSettings,
                  cap: dict, mixture: dict | None, parts: dict | None = None) -> dict:
    """Fill an empty split, close the files, move them into place and write the manifest; returns it."""
    fallback = _fill_empty_split(files, all_stats)
    files.close()
    manifest = _manifest(all_stats, settings, files, cap, fallback)
    manifest["mixture"] = mixture
    manifest["parts"] = parts
    (out_dir / "manifest.json").unlink(missing_ok=True)
    for split in SPLITS:
        os.replace(files.tmp[split], out_dir / f"{split}.jsonl")
    atomic_write_text(out_dir / "manifest.json", json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    return manifest


def _mixture_weights(sources: list[dict]) -> list[float] | None:
    """Per-source weights when the sources form a mixture (all carry `weight`), None when none does."""
    weighted = [source.get("weight") is not None for source in sources]
    if not any(weighted):
        return None
    if not all(weighted):
        missing = [number for number, has in enumerate(weighted) if not has]
        raise CorpusError(f"corpus.sources{missing} have no weight while others do: give every source a weight "
                          "(a mixture) or none (concatenated in order)")
    for number, source in enumerate(sources):
        if not source["weight"] > 0:
            raise CorpusError(f"corpus.sources[{number}].weight must be > 0, got {source['weight']!r}")
    return [float(source["weight"]) for source in sources]


def _mixture_record(weights: list[float] | None, seed: int, all_stats: list[SourceStats]) -> dict | None:
    """manifest["mixture"]: the weights asked for and the share of kept bytes each source got."""
    if weights is None:
        return None
    kept = sum(stats.bytes_out for stats in all_stats) or 1
    return {"method": "each document drawn from a source chosen with probability weight / sum of the weights of "
                      "the sources not yet exhausted (random.Random(seed))",
            "seed": seed,
            "sources": [{"uri": stats.uri, "weight": weight, "share_asked": weight / sum(weights),
                         "share_kept_bytes": stats.bytes_out / kept} for weight, stats in zip(weights, all_stats)]}


def _documents(readers: list, weights: list[float] | None, seed: int, ended: set[int]):
    """(source index, document number within it, text): sources in order, or drawn by weight (seeded). A source read
    to its end joins `ended`."""
    counts = [0] * len(readers)
    active = list(range(len(readers)))
    rng = random.Random(seed)
    while active:
        i = rng.choices(active, weights=[weights[j] for j in active])[0] if weights else active[0]
        try:
            text = next(readers[i])
        except StopIteration:
            active.remove(i)
            ended.add(i)
            continue
        yield i, counts[i], text
        counts[i] += 1


def _clean_all(sources, settings: CleaningSettings, files: _SplitFiles, cache_dir: Path,
               weights: list[float] | None, seed: int):
    """Steps 2-6 of the module docstring over every source; returns per-source stats and where the cap cut."""
    seen: set[bytes] = set()
    kept_bytes, cut_at = 0, None
    all_stats = [SourceStats(uri=source["uri"], kind=source_kind(source["uri"])) for source in sources]
    readers = [read_source(source, stats, settings.encoding_errors, cache_dir)
               for source, stats in zip(sources, all_stats)]
    ended: set[int] = set()  # sources read to their end
    progress = Progress("cleaning (kept bytes)" if settings.max_bytes else "cleaning (bytes read)", log,
                        total=settings.max_bytes)

    def documents_read() -> str:
        return f"{sum(s.documents_in for s in all_stats):,} documents read"

    for i, number, text in _documents(readers, weights, seed, ended):
        source, stats = sources[i], all_stats[i]
        uri = source["uri"]
        read_bytes, document = clean_document(text, stats, settings, uri, number)
        if not settings.max_bytes:
            progress.advance(read_bytes, documents_read)
        if document is None:
            continue
        text, data, digest = document
        if settings.dedup:
            if digest in seen:
                stats.dropped["duplicate"] += 1
                continue
            seen.add(digest)
        if settings.max_bytes is not None and kept_bytes + len(data) > settings.max_bytes:
            cut_at = {"source": uri, "document_index": number}
            stats.dropped["over_cap"] += 1
            break  # nothing after the cut can be kept
        kept_bytes += len(data)
        files.add(text, len(data), digest)
        stats.documents_out += 1
        stats.bytes_out += len(data)
        if settings.max_bytes:
            progress.advance(len(data), documents_read)
    progress.finish()
    for i, (reader, stats) in enumerate(zip(readers, all_stats)):
        if i not in ended:  # stopped at the cap: release its file or stream, and say it was not read to the end
            reader.close()
            stats.details["stopped_at_cap"] = True
    for stats in all_stats:
        log.info("%s: %d documents in, %d kept (%d bytes); dropped %s; replaced %d chars, removed %d NULs",
                 stats.uri, stats.documents_in, stats.documents_out, stats.bytes_out, stats.dropped,
                 stats.replaced_chars, stats.nul_removed)
    cap = {"max_bytes": settings.max_bytes, "reached": cut_at is not None, "cut_at": cut_at}
    if cut_at is not None:
        cap["unread"] = ("reading stopped at the cut: the documents after it were never read (documents_in and "
                         "bytes_in count what was), and sources marked details.stopped_at_cap were not read to "
                         "their end")
    return all_stats, cap


def clean_document(text: str, stats: SourceStats, settings: CleaningSettings, uri: str,
                   number: int) -> tuple[int, tuple[str, bytes, bytes] | None]:
    """Steps 2-3 of the module docstring on one document read from `uri` (its `number` there), counted into `stats`:
    (its UTF-8 bytes as read, then (text, its UTF-8 bytes, their sha256), or None when too short)."""
    stats.documents_in += 1
    nuls = 0
    if "\x00" in text:
        nuls = text.count("\x00")
        stats.nul_removed += nuls
        text = text.replace("\x00", "")
    text, data = _encode(text, stats, settings.encoding_errors, uri, number)
    read_bytes = len(data) + nuls  # NUL is one UTF-8 byte
    stats.bytes_in += read_bytes
    if len(text.strip()) < settings.min_chars:
        stats.dropped["too_short"] += 1
        return read_bytes, None
    return read_bytes, (text, data, hashlib.sha256(data).digest())


def _encode(text: str, stats: SourceStats, errors: str, uri: str, number: int) -> tuple[str, bytes]:
    """UTF-8 bytes of `text`; lone surrogates (JSON \\ud800 escapes) are an encoding error like invalid bytes."""
    try:
        return text, text.encode("utf-8")
    except UnicodeEncodeError as error:
        if errors == "strict":
            raise CorpusError(f"{uri} document index {number}: lone surrogate {text[error.start]!r} at character "
                              f"{error.start}; set corpus.encoding_errors: replace to substitute U+FFFD instead"
                              ) from None
    text, replaced = LONE_SURROGATE.subn("\ufffd", text)
    stats.replaced_chars += replaced
    return text, text.encode("utf-8")


def val_threshold(val_fraction: float) -> int:
    """Step 6's boundary: a document whose split score (split_place) is below it goes to val."""
    return int(val_fraction * 2**64)


def split_place(digest: bytes, threshold: int) -> tuple[str, int]:
    """Step 6 for a document's sha256: its split, and how far its score (the first 8 bytes, big-endian) lies from
    the boundary (the document nearest it moves when a split would be empty)."""
    score = int.from_bytes(digest[:8], "big")
    return ("val", threshold - score) if score < threshold else ("train", score - threshold)


def count_move(documents: dict[str, int], sizes: dict[str, int], source: str, target: str, text_bytes: int,
               digest: bytes) -> dict:
    """Count one document moved from split `source` to `target` (the empty-split fallback) in the per-split document
    and byte counts; returns the manifest's record of the move."""
    documents[source] -= 1
    sizes[source] -= text_bytes
    documents[target] += 1
    sizes[target] += text_bytes
    return {"moved": f"{source}->{target}", "document_sha256": digest.hex(),
            "reason": f"no document fell into {target} by hash"}


class _SplitFiles:
    """The two temporary jsonl files, their counts, and per split the document nearest the train/val boundary."""

    def __init__(self, out_dir: Path, val_fraction: float):
        self.threshold = val_threshold(val_fraction)
        self.tmp = {split: out_dir / f"{split}.jsonl.tmp" for split in SPLITS}
        self.rewrite = {split: out_dir / f"{split}.jsonl.tmp.rewrite" for split in SPLITS}  # see move_nearest
        self.handles = {split: open(self.tmp[split], "wb") for split in SPLITS}
        self.writeback = Writeback([handle.fileno() for handle in self.handles.values()])
        self.documents = dict.fromkeys(SPLITS, 0)
        self.bytes = dict.fromkeys(SPLITS, 0)
        self.nearest = dict.fromkeys(SPLITS)  # split -> (distance, line index, jsonl line, text bytes, digest)
        # sha256 of each file as written, for the manifest: cheaper than reading the files back afterwards.
        self.file_digests = {split: hashlib.sha256() for split in SPLITS}

    def add(self, text: str, text_bytes: int, digest: bytes) -> None:
        self.add_line(jsonl_line(text), text_bytes, digest)

    def add_line(self, line: bytes, text_bytes: int, digest: bytes) -> None:
        """A document as its jsonl line (jsonl_line), its text's UTF-8 bytes and their sha256."""
        split, distance = split_place(digest, self.threshold)
        nearest = self.nearest[split]
        if nearest is None or distance < nearest[0]:
            self.nearest[split] = (distance, self.documents[split], line, text_bytes, digest)
        self.handles[split].write(line)
        self.file_digests[split].update(line)
        self.documents[split] += 1
        self.bytes[split] += text_bytes

    def move_nearest(self, source: str, target: str) -> dict:
        """Move `source`'s document nearest the boundary to the end of `target` (rewrites `source`'s file)."""
        _, index, line, text_bytes, digest = self.nearest[source]
        self.writeback.stop()  # it holds the descriptor this closes
        for handle in self.handles.values():
            handle.flush()
        rewritten = self.rewrite[source]
        with open(self.tmp[source], "rb") as old, open(rewritten, "wb") as new:
            new.writelines(row for number, row in enumerate(old) if number != index)
        self.handles[source].close()
        os.replace(rewritten, self.tmp[source])
        self.handles[source] = open(self.tmp[source], "ab")
        self.handles[target].write(line)
        self.handles[target].flush()
        for split in SPLITS:  # rare path: hash the rewritten files again
            with open(self.tmp[split], "rb") as handle:
                self.file_digests[split] = hashlib.file_digest(handle, "sha256")
        return count_move(self.documents, self.bytes, source, target, text_bytes, digest)

    def close(self) -> None:
        self.writeback.stop()
        for handle in self.handles.values():
            handle.flush()
            os.fsync(handle.fileno())  # durable before the rename makes it visible
            handle.close()

    def discard(self) -> None:
        self.writeback.stop()
        for handle in self.handles.values():
            handle.close()
        for path in (*self.tmp.values(), *self.rewrite.values()):
            path.unlink(missing_ok=True)


class Writeback(threading.Thread):
    """Writes the pages of files being written to disk every INTERVAL_S seconds from a thread of its own, so that
    the fsync that makes them durable before the rename finds little left to write: the disk works while the
    cleaning goes on instead of after it (on a 600 MB corpus the final fsync otherwise waits about 0.4 s)."""

    INTERVAL_S = 0.25

    def __init__(self, descriptors: list[int]):
        super().__init__(name="corpus writeback", daemon=True)
        self.descriptors, self.done = descriptors, threading.Event()
        self.start()

    def run(self) -> None:
        while not self.done.wait(self.INTERVAL_S):
            for descriptor in self.descriptors:
                try:
                    os.fdatasync(descriptor)
                except OSError:  # the final fsync reports what matters, from the writing thread
                    return

    def stop(self) -> None:
        """Stop before the descriptors are closed (idempotent)."""
        self.done.set()
        if self.is_alive():
            self.join()


def _fill_empty_split(files: _SplitFiles, all_stats: list[SourceStats]) -> dict | None:
    """Refuse an empty corpus; give an empty val (or train) split the one document nearest the boundary."""
    total = sum(files.documents.values())
    if total < 2:
        read = sum(stats.documents_in for stats in all_stats)
        dropped = {reason: sum(stats.dropped[reason] for stats in all_stats) for reason in DROP_REASONS}
        what = "no training text after cleaning" if total == 0 else "only 1 document left after cleaning"
        raise CorpusError(
            f"{what} (need at least 2 for a train and a val split): {read} documents read from "
            f"{[stats.uri for stats in all_stats]}, dropped {dropped}; check the sources and corpus.min_chars, "
            "corpus.max_bytes, corpus.dedup"
        )
    for empty, full in (("val", "train"), ("train", "val")):
        if files.documents[empty] == 0:
            log.warning("no document fell into %s by hash; moving the one nearest the boundary from %s", empty, full)
            return files.move_nearest(full, empty)
    return None


def jsonl_line(text: str) -> bytes:
    """`{"text":...}` plus newline: one compact JSON object per line, non-ASCII as UTF-8 (orjson, whose writer is
    about 5x json's on source code; JSON encoding was the largest cost of cleaning, bench/bench_corpus.py). `text` is
    valid Unicode: _encode has replaced or refused lone surrogates, which orjson would refuse too."""
    return orjson.dumps({"text": text}) + b"\n"


def _manifest(all_stats, settings: CleaningSettings, files: _SplitFiles, cap: dict, fallback: dict | None) -> dict:
    """manifest.json: totals first, then per split, losses, settings and per-source detail."""
    documents_in = sum(stats.documents_in for stats in all_stats)
    return {
        "documents": sum(files.documents.values()),
        "bytes": sum(files.bytes.values()),  # UTF-8 bytes of the texts written (not of the jsonl lines)
        **{split: {"file": f"{split}.jsonl", "documents": files.documents[split], "bytes": files.bytes[split],
                   "sha256": files.file_digests[split].hexdigest()} for split in SPLITS},
        "documents_in": documents_in,
        "bytes_in": sum(stats.bytes_in for stats in all_stats),
        "dropped": {reason: sum(stats.dropped[reason] for stats in all_stats) for reason in DROP_REASONS},
        "replaced_chars": sum(stats.replaced_chars for stats in all_stats),
        "nul_removed": sum(stats.nul_removed for stats in all_stats),
        "binary_skipped": sum(stats.binary_skipped for stats in all_stats),
        # files not read, by reason: binary text files, and files under hidden names a glob skips (include_hidden)
        "skipped": {"binary": sum(stats.binary_skipped for stats in all_stats),
                    "hidden": sum(stats.hidden_skipped for stats in all_stats)},
        "settings": asdict(settings),
        "cap": cap,
        "split": {"method": "val when int(sha256(utf8 text)[:8], big-endian) < val_fraction * 2**64",
                  "fallback": fallback},
        "sources": [asdict(stats) for stats in all_stats],
        "format": 'jsonl, one {"text":...} object per line (compact, UTF-8), documents in input order',
        "python": platform.python_version(),
    }
