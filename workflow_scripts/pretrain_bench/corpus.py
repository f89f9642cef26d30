"""Corpus acquisition and cleaning: sources -> cleaned documents -> train/val split -> jsonl files + manifest.

Each document passes these steps in source order (or, when the sources carry a `weight`, in mixture order: each
next document is drawn from a source chosen at random in proportion to its weight, from a generator seeded with
`seed`, until every source is exhausted, so the kept prefix under `max_bytes` holds the sources in those
proportions; the manifest records the weights and the shares kept); every step is counted in manifest.json:
1) read from builtin://python-stdlib, hf://<dataset>, http(s)://… or file://path-or-glob and decode as UTF-8 under
   `encoding_errors` (strict: fail naming the file and byte offset; replace: substitute U+FFFD and count);
2) remove NUL characters (counted): they break C-string based tools downstream and carry no text;
3) drop documents shorter than `min_chars` characters, surrounding whitespace not counted (`too_short`);
4) drop exact duplicates by the sha256 of the UTF-8 text (`duplicate`, when `dedup`);
5) cap: the first document that would take the kept text past `max_bytes`, and every document after it, is cut
   (`over_cap`). The kept corpus is a prefix of the cleaned stream, so the same inputs always give the same cut.
   Input after the cap is still read so that the manifest can say how much was cut, except from `streaming: true`
   hf:// sources, which may be larger than the disk: those stop at the cap;
6) split by content hash: a document goes to val when the first 8 bytes of its sha256, read as a fraction of 2**64,
   fall below `val_fraction`. The split depends on the text alone, so appending a source never moves a document.

Because that split is a per-document coin toss, a small corpus can end with an empty val (or train) split. Then the
one document whose hash lies nearest the boundary moves into the empty split (`split.fallback` in the manifest);
fewer than two documents is an error, as is an empty corpus. The tiny CPU run needs a non-empty val.

Outputs in out_dir: train.jsonl and val.jsonl (one `{"text": ...}` object per line, documents in input order) and
manifest.json. Everything is written to `*.tmp` first and moved into place with os.replace only after every source
was read, so a failed build leaves no partial file; the old manifest is removed before the new files move in, so a
manifest on disk always describes the jsonl files beside it.
"""
from __future__ import annotations

import glob
import gzip
import random
import hashlib
import io
import json
import logging
import os
import platform
import re
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Iterator
from urllib.parse import urlsplit

from pretrain_bench.download import DownloadError, download
from pretrain_bench.io import atomic_write_text
from pretrain_bench.progress import Progress

log = logging.getLogger(__name__)

SPLITS = ("train", "val")
DROP_REASONS = ("too_short", "duplicate", "over_cap")
FORMATS = (".txt", ".jsonl", ".parquet")
COMPRESSIONS = (".gz", ".zst")
# Test packages are left out of the builtin corpus: distributions ship them or not (Debian splits them off) and
# their fixtures hold deliberately broken encodings, so the corpus would differ between installs of one version.
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
# The UTF-8 encoding of U+FFFD: replacement characters that were in the input already are not counted as replaced.
REPLACEMENT_BYTES = "\ufffd".encode()
LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# A blank line (possibly holding spaces or tabs) separates paragraphs in `split: paragraphs` text files.
PARAGRAPH_BREAK = re.compile(r"\r?\n(?:[ \t]*\r?\n)+")


class CorpusError(ValueError):
    """The corpus cannot be built as configured; the message names the source URI, file or config key."""


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


@dataclass
class SourceStats:
    """What one source contributed and lost; one entry of manifest["sources"]."""

    uri: str
    kind: str
    sha256: str | None = None  # of the fetched file (http/https); None where no single file was fetched
    documents_in: int = 0
    bytes_in: int = 0  # UTF-8 bytes of the documents as decoded, before cleaning
    documents_out: int = 0
    bytes_out: int = 0
    replaced_chars: int = 0  # U+FFFD substituted for undecodable bytes or lone surrogates
    nul_removed: int = 0
    dropped: dict = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    details: dict = field(default_factory=dict)  # kind-specific provenance: files, dataset fingerprint, ...


class _Decoder:
    """UTF-8 decoding under the encoding_errors policy, counting replacements into the source's stats."""

    def __init__(self, errors: str, stats: SourceStats):
        self.errors, self.stats = errors, stats

    def __call__(self, data: bytes, where: str, offset: int = 0) -> str:
        try:
            return data.decode("utf-8")  # the fast path: valid UTF-8 needs no counting
        except UnicodeDecodeError as error:
            if self.errors == "strict":
                raise CorpusError(
                    f"{where}: invalid UTF-8 at byte offset {offset + error.start} ({error.reason}); "
                    "set corpus.encoding_errors: replace to substitute U+FFFD instead"
                ) from None
        text = data.decode("utf-8", "replace")
        self.stats.replaced_chars += text.count("\ufffd") - data.count(REPLACEMENT_BYTES)
        return text


def build_corpus(sources: list[dict], out_dir: Path, *, max_bytes: int | None, min_chars: int, dedup: bool,
                 val_fraction: float, encoding_errors: str, cache_dir: Path, seed: int = 1234) -> dict:
    """Read, clean, de-duplicate, cap and split `sources` into out_dir/{train,val}.jsonl; return the manifest.

    `seed` orders a weighted mixture (sources with `weight`); it is unused when no source has one."""
    settings = CleaningSettings(max_bytes, min_chars, dedup, val_fraction, encoding_errors)
    if not sources:
        raise CorpusError("corpus.sources is empty: name at least one source")
    for number, source in enumerate(sources):
        if not isinstance(source, dict) or not isinstance(source.get("uri"), str):
            raise CorpusError(f"corpus.sources[{number}] needs a 'uri' string, got {source!r}")
    weights = _mixture_weights(sources)
    out_dir, cache_dir = Path(out_dir), Path(cache_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = _SplitFiles(out_dir, val_fraction)
    try:
        all_stats, cap = _clean_all(sources, settings, files, cache_dir, weights, seed)
        fallback = _fill_empty_split(files, all_stats)
        files.close()
        manifest = _manifest(all_stats, settings, files, cap, fallback)
        manifest["mixture"] = _mixture_record(weights, seed, all_stats)
        (out_dir / "manifest.json").unlink(missing_ok=True)
        for split in SPLITS:
            os.replace(files.tmp[split], out_dir / f"{split}.jsonl")
        atomic_write_text(out_dir / "manifest.json", json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    except BaseException:
        files.discard()
        raise
    log.info("corpus: %d documents, %d bytes (train %d, val %d) in %s", manifest["documents"], manifest["bytes"],
             manifest["train"]["documents"], manifest["val"]["documents"], out_dir)
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


def _mixture_record(weights: list[float] | None, seed: int, all_stats: list["SourceStats"]) -> dict | None:
    """manifest["mixture"]: the weights asked for and the share of kept bytes each source got."""
    if weights is None:
        return None
    kept = sum(stats.bytes_out for stats in all_stats) or 1
    return {"method": "each document drawn from a source chosen with probability weight / sum of the weights of "
                      "the sources not yet exhausted (random.Random(seed))",
            "seed": seed,
            "sources": [{"uri": stats.uri, "weight": weight, "share_asked": weight / sum(weights),
                         "share_kept_bytes": stats.bytes_out / kept} for weight, stats in zip(weights, all_stats)]}


def _documents(readers: list, weights: list[float] | None, seed: int, closed: set[int]):
    """(source index, document number within it, text): sources in order, or drawn by weight (seeded)."""
    counts = [0] * len(readers)
    active = list(range(len(readers)))
    rng = random.Random(seed)
    while active:
        active = [i for i in active if i not in closed]
        if not active:
            return
        i = rng.choices(active, weights=[weights[j] for j in active])[0] if weights else active[0]
        try:
            text = next(readers[i])
        except StopIteration:
            active.remove(i)
            continue
        yield i, counts[i], text
        counts[i] += 1


def _clean_all(sources, settings: CleaningSettings, files: "_SplitFiles", cache_dir: Path,
               weights: list[float] | None = None, seed: int = 1234):
    """Steps 2-6 of the module docstring over every source; returns per-source stats and where the cap cut."""
    seen: set[bytes] = set()
    kept_bytes, cut_at = 0, None
    all_stats = [SourceStats(uri=source["uri"], kind=_kind(source["uri"])) for source in sources]
    readers = [_read_source(source, stats, settings.encoding_errors, cache_dir)
               for source, stats in zip(sources, all_stats)]
    streaming = {i for i, source in enumerate(sources) if source.get("streaming")}
    closed: set[int] = set()  # streaming sources stop being read once the cap is reached
    progress = Progress("cleaning (kept bytes)" if settings.max_bytes else "cleaning (bytes read)", log,
                        total=settings.max_bytes)

    def documents_read() -> str:
        return f"{sum(s.documents_in for s in all_stats):,} documents read"

    for i, number, text in _documents(readers, weights, seed, closed):
        source, stats = sources[i], all_stats[i]
        uri = source["uri"]
        stats.documents_in += 1
        if "\x00" in text:
            nuls = text.count("\x00")
            stats.nul_removed += nuls
            stats.bytes_in += nuls  # NUL is one UTF-8 byte
            text = text.replace("\x00", "")
        text, data = _encode(text, stats, settings.encoding_errors, uri, number)
        stats.bytes_in += len(data)
        if not settings.max_bytes:
            progress.advance(len(data), documents_read)
        if len(text.strip()) < settings.min_chars:
            stats.dropped["too_short"] += 1
            continue
        digest = hashlib.sha256(data).digest()
        if settings.dedup:
            if digest in seen:
                stats.dropped["duplicate"] += 1
                continue
            seen.add(digest)
        if cut_at is None and settings.max_bytes is not None and kept_bytes + len(data) > settings.max_bytes:
            cut_at = {"source": uri, "document_index": number}
            for j in streaming:  # a streamed dataset may not fit on disk: read no further than the cap
                closed.add(j)
                all_stats[j].details["stopped_at_cap"] = True
        if cut_at is not None:
            stats.dropped["over_cap"] += 1
            continue
        kept_bytes += len(data)
        files.add(text, len(data), digest)
        stats.documents_out += 1
        stats.bytes_out += len(data)
        if settings.max_bytes:
            progress.advance(len(data), documents_read)
    progress.finish()
    for stats in all_stats:
        log.info("%s: %d documents in, %d kept (%d bytes); dropped %s; replaced %d chars, removed %d NULs",
                 stats.uri, stats.documents_in, stats.documents_out, stats.bytes_out, stats.dropped,
                 stats.replaced_chars, stats.nul_removed)
    return all_stats, {"max_bytes": settings.max_bytes, "reached": cut_at is not None, "cut_at": cut_at}


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


class _SplitFiles:
    """The two temporary jsonl files, their counts, and per split the document nearest the train/val boundary."""

    def __init__(self, out_dir: Path, val_fraction: float):
        self.threshold = int(val_fraction * 2**64)
        self.tmp = {split: out_dir / f"{split}.jsonl.tmp" for split in SPLITS}
        self.rewrite = {split: out_dir / f"{split}.jsonl.tmp.rewrite" for split in SPLITS}  # see move_nearest
        self.handles = {split: open(self.tmp[split], "wb") for split in SPLITS}
        self.documents = dict.fromkeys(SPLITS, 0)
        self.bytes = dict.fromkeys(SPLITS, 0)
        self.nearest = dict.fromkeys(SPLITS)  # split -> (distance, line index, jsonl line, text bytes, digest)
        # sha256 of each file as written, for the manifest: cheaper than reading the files back afterwards.
        self.file_digests = {split: hashlib.sha256() for split in SPLITS}

    def add(self, text: str, text_bytes: int, digest: bytes) -> None:
        score = int.from_bytes(digest[:8], "big")
        split = "val" if score < self.threshold else "train"
        distance = self.threshold - score if split == "val" else score - self.threshold
        line = jsonl_line(text)
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
        self.documents[source] -= 1
        self.bytes[source] -= text_bytes
        self.documents[target] += 1
        self.bytes[target] += text_bytes
        return {"moved": f"{source}->{target}", "document_sha256": digest.hex(),
                "reason": f"no document fell into {target} by hash"}

    def close(self) -> None:
        for handle in self.handles.values():
            handle.flush()
            os.fsync(handle.fileno())  # durable before the rename makes it visible
            handle.close()

    def discard(self) -> None:
        for handle in self.handles.values():
            handle.close()
        for path in (*self.tmp.values(), *self.rewrite.values()):
            path.unlink(missing_ok=True)


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
    """`{"text": ...}` plus newline, byte-identical to json.dumps(..., ensure_ascii=False).

    The ASCII-only C encoder is ~40% faster and gives the same output on ASCII text without DEL (which it escapes),
    and most corpora are mostly that; JSON encoding is the largest cost of cleaning (bench/bench_corpus.py).
    """
    if text.isascii() and "\x7f" not in text:
        return b'{"text": ' + json.encoder.encode_basestring_ascii(text).encode("ascii") + b"}\n"
    return b'{"text": ' + json.encoder.encode_basestring(text).encode("utf-8") + b"}\n"


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
        "settings": asdict(settings),
        "cap": cap,
        "split": {"method": "val when int(sha256(utf8 text)[:8], big-endian) < val_fraction * 2**64",
                  "fallback": fallback},
        "sources": [asdict(stats) for stats in all_stats],
        "format": 'jsonl, one {"text": ...} object per line, documents in input order',
        "python": platform.python_version(),
    }


# ---------------------------------------------------------------------------------------------------------- readers


def _kind(uri: str) -> str:
    return uri.split("://", 1)[0] if "://" in uri else "unknown"


def _read_source(source: dict, stats: SourceStats, errors: str, cache_dir: Path) -> Iterator[str]:
    """Documents of one source, in a deterministic order."""
    uri, kind = source["uri"], stats.kind
    decode = _Decoder(errors, stats)
    if source.get("sha256") and kind not in ("http", "https"):
        raise CorpusError(f"{uri}: 'sha256' applies to http(s) sources only")
    if kind == "builtin":
        return _read_builtin(uri, stats, decode)
    if kind == "hf":
        return _read_hf(source, stats, cache_dir)
    if source.get("split") not in (None, "paragraphs"):
        raise CorpusError(f"{uri}: split {source['split']!r} is for hf:// sources; file sources accept 'paragraphs'")
    if kind in ("http", "https"):
        return _read_http(source, stats, decode, cache_dir)
    if kind == "file":
        return _read_files(source, stats, decode)
    raise CorpusError(f"{uri}: unknown source kind; use builtin://python-stdlib, hf://, http(s):// or file://")


def stdlib_files() -> tuple[str, list[str]]:
    """The running interpreter's standard-library folder and its .py files (relative paths, sorted as strings).

    Plain strings rather than pathlib: Path arithmetic per file cost a third of the builtin corpus's cleaning time.
    """
    root = sysconfig.get_paths()["stdlib"]
    relative = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [name for name in dirs if name not in STDLIB_SKIP_DIRS]
        prefix = os.path.relpath(folder, root).replace(os.sep, "/")
        relative.extend(name if prefix == "." else f"{prefix}/{name}" for name in names if name.endswith(".py"))
    return root, sorted(relative)


def _read_builtin(uri: str, stats: SourceStats, decode: _Decoder) -> Iterator[str]:
    """builtin://python-stdlib: one document per standard-library .py file, in sorted relative-path order."""
    if uri != "builtin://python-stdlib":
        raise CorpusError(f"{uri}: unknown builtin corpus; the one builtin is builtin://python-stdlib")
    root, relative = stdlib_files()
    if not relative:
        raise CorpusError(f"{uri}: no .py files under the standard library folder {root}")
    stats.details.update(root=root, python=platform.python_version(), files=len(relative))
    for name in relative:
        path = os.path.join(root, name)
        with open(path, "rb") as handle:
            data = handle.read()
        yield decode(data, f"{path} ({uri})")


def _read_files(source: dict, stats: SourceStats, decode: _Decoder) -> Iterator[str]:
    """file://path or file://glob (sorted); relative paths are relative to the working directory."""
    uri = source["uri"]
    pattern = uri[len("file://"):]
    if any(char in pattern for char in "*?["):
        paths = sorted(path for path in glob.glob(pattern, recursive=True) if os.path.isfile(path))
        if not paths:
            raise CorpusError(f"{uri}: the glob matched no files")
    elif os.path.isdir(pattern):
        raise CorpusError(f"{uri}: is a folder; name files with a glob such as {pattern.rstrip('/')}/*.txt")
    elif not os.path.isfile(pattern):
        raise CorpusError(f"{uri}: no such file: {pattern}")
    else:
        paths = [pattern]
    for path in paths:
        _format_of(path, uri)  # fail on an unsupported file before reading any
    stats.details["files"] = len(paths)
    for path in paths:
        yield from _read_file(Path(path), f"{path} ({uri})", source, decode)


def _read_http(source: dict, stats: SourceStats, decode: _Decoder, cache_dir: Path) -> Iterator[str]:
    """Download (see download.py) into cache_dir/http, then read like a local file by the URL's extension."""
    url = source["uri"]
    name = PurePosixPath(urlsplit(url).path).name
    _format_of(name, url)  # before downloading: a wrong extension should not cost a download
    dest = cache_dir / "http" / f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{name}"
    try:
        stats.sha256 = download(url, dest, sha256=source.get("sha256"))
    except DownloadError as error:
        raise CorpusError(str(error)) from error
    stats.details["cached_at"] = str(dest)
    yield from _read_file(dest, f"{url} (cached at {dest})", source, decode)


def _format_of(name: str, uri: str) -> tuple[str, str | None]:
    """('.jsonl', '.gz') for 'x.jsonl.gz'; a CorpusError naming the URI for anything unsupported."""
    lowered, compression = str(name).lower(), None
    for suffix in COMPRESSIONS:
        if lowered.endswith(suffix):
            lowered, compression = lowered[: -len(suffix)], suffix
    for suffix in FORMATS:
        if lowered.endswith(suffix):
            return suffix, compression
    raise CorpusError(f"{uri}: unsupported file {name!r}; expected .txt, .jsonl or .parquet, optionally .gz or .zst")


def _read_file(path: Path, label: str, source: dict, decode: _Decoder) -> Iterator[str]:
    """One local file: .txt (whole file, or paragraphs), .jsonl or .parquet, optionally .gz/.zst compressed."""
    fmt, compression = _format_of(path.name, source["uri"])
    field_name = source.get("text_field", "text")
    try:
        with _open_decompressed(path, compression) as stream:
            if fmt == ".txt":
                text = decode(stream.read(), label)
                if source.get("split") == "paragraphs":
                    yield from (block.strip("\r\n") for block in PARAGRAPH_BREAK.split(text) if block.strip())
                else:
                    yield text
            elif fmt == ".jsonl":
                yield from _read_jsonl(stream, label, field_name, decode)
            else:
                yield from _read_parquet(stream, label, field_name, compression)
    except (OSError, EOFError) as error:  # gzip/zstd corruption, truncated files
        raise CorpusError(f"{label}: cannot read: {error}") from error


def _open_decompressed(path: Path, compression: str | None) -> BinaryIO:
    if compression == ".gz":
        return gzip.open(path, "rb")
    if compression == ".zst":
        try:
            import zstandard
        except ImportError as error:
            raise CorpusError(f"{path}: reading .zst needs the 'zstandard' package (pip install zstandard)") from error
        raw = open(path, "rb")
        # read_across_frames: files concatenated from several zstd frames are common (e.g. `cat a.zst b.zst`).
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=True)
        return io.BufferedReader(reader, 1 << 20)
    return open(path, "rb")


def _read_jsonl(stream: BinaryIO, label: str, field_name: str, decode: _Decoder) -> Iterator[str]:
    """One document per non-blank line: the string under `field_name` (null counts as an empty document)."""
    offset = 0
    for number, raw in enumerate(stream, 1):
        start, offset = offset, offset + len(raw)
        if not raw.strip():
            continue
        where = f"{label} line {number}"
        try:
            record = json.loads(decode(raw, where, start))
        except json.JSONDecodeError as error:
            raise CorpusError(f"{where}: invalid JSON ({error.msg} at column {error.colno})") from None
        yield _text_value(record.get(field_name, _MISSING) if isinstance(record, dict) else _MISSING,
                          where, field_name, record)


_MISSING = object()


def _text_value(value, where: str, field_name: str, record=None) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if value is _MISSING:
        keys = sorted(record)[:10] if isinstance(record, dict) else type(record).__name__
        raise CorpusError(f"{where}: no {field_name!r} key (text_field); found {keys}")
    raise CorpusError(f"{where}: {field_name!r} (text_field) holds {type(value).__name__}, not text")


def _read_parquet(stream: BinaryIO, label: str, field_name: str, compression: str | None) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Parquet needs random access; a .gz/.zst wrapped file is decompressed into memory first.
    source = io.BytesIO(stream.read()) if compression else stream
    try:
        parquet = pq.ParquetFile(source)
        if field_name not in parquet.schema_arrow.names:
            raise CorpusError(f"{label}: no column {field_name!r} (text_field); columns {parquet.schema_arrow.names}")
        column_type = parquet.schema_arrow.field(field_name).type
        if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
            raise CorpusError(f"{label}: column {field_name!r} (text_field) is {column_type}, not a string column")
        for batch in parquet.iter_batches(batch_size=1024, columns=[field_name]):
            yield from ("" if value is None else value for value in batch.column(0).to_pylist())
    except pa.ArrowException as error:
        raise CorpusError(f"{label}: not a readable parquet file: {error}") from error


def _read_hf(source: dict, stats: SourceStats, cache_dir: Path) -> Iterator[str]:
    """hf://<dataset> through datasets.load_dataset, cached under cache_dir/hf; fails fast and helpfully offline."""
    uri = source["uri"]
    name, config = uri[len("hf://"):], source.get("config")
    split, field_name = source.get("split", "train"), source.get("text_field", "text")
    revision, streaming = source.get("revision"), bool(source.get("streaming", False))
    hf_cache = str(cache_dir / "hf")
    stats.details.update(dataset=name, config=config, split=split, text_field=field_name, revision=revision,
                         streaming=streaming)
    try:
        import datasets

        dataset = datasets.load_dataset(name, config, split=split, cache_dir=hf_cache, revision=revision,
                                        streaming=streaming)
    except Exception as error:  # datasets raises a zoo of types (ConnectionError, FileNotFoundError, ValueError, ...)
        raise CorpusError(_hf_failure_message(uri, name, config, split, hf_cache, error, revision)) from error
    if streaming:
        # Rows arrive as they are downloaded and are written out one by one; nothing is cached whole on disk.
        stats.details.update(datasets_version=datasets.__version__)
        for number, row in enumerate(dataset):
            if field_name not in row:
                raise CorpusError(f"{uri} ({split}) row {number}: no column {field_name!r} (text_field); "
                                  f"columns {sorted(row)}")
            yield _text_value(row[field_name], f"{uri} ({split})", field_name)
        return
    if field_name not in dataset.column_names:
        raise CorpusError(f"{uri}: no column {field_name!r} (text_field); columns {dataset.column_names}")
    # datasets' fingerprint identifies the cached Arrow data; it is the closest thing to a sha256 of what was fetched.
    stats.details.update(rows=dataset.num_rows, fingerprint=getattr(dataset, "_fingerprint", None),
                         datasets_version=datasets.__version__)
    for batch in dataset.select_columns([field_name]).iter(batch_size=1024):
        for value in batch[field_name]:
            yield _text_value(value, f"{uri} ({split})", field_name)


def _hf_failure_message(uri, name, config, split, hf_cache, error, revision=None) -> str:
    offline = any(os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on")
                  for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    why = ("offline mode is on (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) and the dataset is not in the cache"
           if offline else "could not download it")
    command = (f"HF_HUB_OFFLINE=0 HF_DATASETS_OFFLINE=0 python -c \"import datasets; datasets.load_dataset("
               f"{name!r}, {config!r}, split={split!r}, cache_dir={hf_cache!r}"
               + (f", revision={revision!r}" if revision else "") + ")\"")
    return (f"{uri}: cannot load dataset {name!r} (config {config!r}, split {split!r}): {why}. "
            f"{type(error).__name__}: {error}. To pre-download it, run on a machine with network access, in the "
            f"workflow's working directory (or copy {hf_cache} there afterwards):\n  {command}")
