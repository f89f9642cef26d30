"""Corpus sources: each corpus.sources[] URI read as a stream of decoded documents, in a deterministic order.

builtin://python-stdlib (the running interpreter's standard-library .py files), hf://<dataset> (datasets.load_dataset,
optionally streamed), http(s)://… (downloaded through download.py into the cache, sha256-checked) and
file://path-or-glob. A file is .jsonl or .parquet by its name, optionally .gz or .zst compressed; a file of any other
name (.txt, .py, .md, .rst, .c, none ...) is one text document (or, with `split: paragraphs`, one per paragraph), as
datatrove's and litgpt's text readers take them. A text file whose first 8 KiB hold a NUL byte, or are mostly not
UTF-8, is binary (git's rule, plus the second test for NUL-free binaries): skipped and counted (`binary_skipped`).
Local files are checked when the workflow builds its DAG (`local_files`): readable, and a .gz/.zst file compressed
as its name says. Bytes are decoded as UTF-8 under `encoding_errors`; what each source was goes into the source's
SourceStats (the manifest): the sha256 of every local file, a downloaded file's sha256 and HTTP validators (ETag,
Last-Modified), the Hub commit an hf:// dataset resolved to. Cleaning, the cap and the split are corpus.py's.
"""
from __future__ import annotations

import codecs
import glob
import gzip
import hashlib
import io
import json
import os
import platform
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import BinaryIO
from urllib.parse import urlsplit

from pretrain_bench.data.download import DownloadError, download, http_validators, sha256_file

# Why a cleaning step dropped a document; SourceStats counts each per source.
DROP_REASONS = ("too_short", "duplicate", "over_cap")
# Files read as records by their name's suffix; every other file is text.
RECORD_FORMATS = (".jsonl", ".parquet")
TEXT = "text"
# Compressed files by suffix, and the magic bytes their data starts with (zstd: a frame, or a skippable frame).
COMPRESSIONS = {".gz": (b"\x1f\x8b",), ".zst": (b"\x28\xb5\x2f\xfd", b"\x50\x2a\x4d\x18")}
# How much of a text file decides whether it is binary (git looks at the first 8000 bytes).
BINARY_SNIFF_BYTES = 8192
# More invalid UTF-8 than this share of those bytes: binary, not text with some bad bytes (Latin-1 French is under
# 20 % accented letters; random bytes are over half invalid).
BINARY_INVALID_SHARE = 0.3
# Files named as binary in the manifest, per source (the count has them all).
BINARY_LISTED = 20
# Test packages are left out of the builtin corpus: distributions ship them or not (Debian splits them off) and
# their fixtures hold deliberately broken encodings, so the corpus would differ between installs of one version.
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
# The UTF-8 encoding of U+FFFD: replacement characters that were in the input already are not counted as replaced.
REPLACEMENT_BYTES = "\ufffd".encode()
# A blank line (possibly holding spaces or tabs) separates paragraphs in `split: paragraphs` text files.
PARAGRAPH_BREAK = re.compile(r"\r?\n(?:[ \t]*\r?\n)+")


class CorpusError(ValueError):
    """The corpus cannot be built as configured; the message names the source URI, file or config key."""


@dataclass
class SourceStats:
    """What one source contributed and lost; one entry of manifest["sources"]."""

    uri: str
    kind: str
    # http(s): of the fetched file; file://: of the one file, or of a glob's `sha256  path` lines (sha256sum's format,
    # paths sorted) with each file's own in details["file_sha256"]; None for builtin:// and hf://
    sha256: str | None = None
    documents_in: int = 0
    bytes_in: int = 0  # UTF-8 bytes of the documents as decoded, before cleaning
    documents_out: int = 0
    bytes_out: int = 0
    replaced_chars: int = 0  # U+FFFD substituted for undecodable bytes or lone surrogates
    nul_removed: int = 0
    binary_skipped: int = 0  # files of a text source skipped as binary (the first few in details["binary_files"])
    # files of a file:// glob skipped as hidden (include_hidden unset; the first few in details["hidden_files"])
    hidden_skipped: int = 0
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


def source_kind(uri: str) -> str:
    """The scheme of a source URI (builtin, hf, http, https, file), 'unknown' without one."""
    return uri.split("://", 1)[0] if "://" in uri else "unknown"


def read_source(source: dict, stats: SourceStats, errors: str, cache_dir: Path,
                select: slice | None = None) -> Iterator[str]:
    """Documents of one source, in a deterministic order; `select`: of a source of several files (builtin://,
    file:// globs, see source_units), only the files in that slice of its list."""
    uri, kind = source["uri"], stats.kind
    decode = _Decoder(errors, stats)
    if source.get("sha256") and kind not in ("http", "https"):
        raise CorpusError(f"{uri}: 'sha256' applies to http(s) sources only")
    if kind == "builtin":
        return _read_builtin(uri, stats, decode, select)
    if kind == "hf":
        return _read_hf(source, stats, cache_dir)
    if source.get("split") not in (None, "paragraphs"):
        raise CorpusError(f"{uri}: split {source['split']!r} is for hf:// sources; file sources accept 'paragraphs'")
    if kind in ("http", "https"):
        return _read_http(source, stats, decode, cache_dir)
    if kind == "file":
        return _read_files(source, stats, decode, select)
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


def _read_builtin(uri: str, stats: SourceStats, decode: _Decoder, select: slice | None = None) -> Iterator[str]:
    """builtin://python-stdlib: one document per standard-library .py file, in sorted relative-path order."""
    root, relative = _builtin_files(uri)
    stats.details.update(root=root, python=platform.python_version(), files=len(relative))
    for name in relative[select or slice(None)]:
        path = os.path.join(root, name)
        with open(path, "rb") as handle:
            data = handle.read()
        yield decode(data, f"{path} ({uri})")


def _builtin_files(uri: str) -> tuple[str, list[str]]:
    if uri != "builtin://python-stdlib":
        raise CorpusError(f"{uri}: unknown builtin corpus; the one builtin is builtin://python-stdlib")
    root, relative = stdlib_files()
    if not relative:
        raise CorpusError(f"{uri}: no .py files under the standard library folder {root}")
    return root, relative


def source_units(source: dict) -> list[int]:
    """The sizes in bytes of the files a source reads in order, for sources of several files (builtin://, file://),
    which parallel cleaning may divide; [0] (one unit of unknown size) for a dataset or a download."""
    kind = source_kind(source["uri"])
    if kind == "builtin":
        root, relative = _builtin_files(source["uri"])
        return [os.path.getsize(os.path.join(root, name)) for name in relative]
    if kind == "file":
        return [os.path.getsize(path) for path in local_files(source["uri"], source.get("include_hidden", False))]
    return [0]


def _glob_files(pattern: str, include_hidden: bool) -> list[str]:
    return sorted(path for path in glob.glob(pattern, recursive=True, include_hidden=include_hidden)
                  if os.path.isfile(path))


def hidden_files(uri: str) -> list[str]:
    """The files a file:// glob matches only with include_hidden (a name, or a folder on the path, starting with
    "."): what it skips unless the source sets include_hidden."""
    pattern = uri[len("file://"):]
    if not any(char in pattern for char in "*?["):
        return []
    return sorted(set(_glob_files(pattern, True)) - set(_glob_files(pattern, False)))


def local_files(uri: str, include_hidden: bool = False) -> list[str]:
    """The files a file://path or file://glob source names (a glob's sorted; hidden ones only with include_hidden);
    relative paths are relative to the working directory. Also what the workflow declares as the corpus's inputs, so
    that editing one reruns it."""
    pattern = uri[len("file://"):]
    if any(char in pattern for char in "*?["):
        paths = _glob_files(pattern, include_hidden)
        if not paths:
            raise CorpusError(f"{uri}: the glob matched no files")
    elif os.path.isdir(pattern):
        raise CorpusError(f"{uri}: is a folder; name files with a glob such as {pattern.rstrip('/')}/*.txt")
    elif not os.path.isfile(pattern):
        raise CorpusError(f"{uri}: no such file: {pattern}")
    else:
        paths = [pattern]
    for path in paths:
        check_outside_results(path, uri)
        check_local_file(path, uri)
    return paths


# The pipeline's own outputs, relative to the working directory (the workflow's results/).
RESULTS_FOLDER = "results"


def check_outside_results(path: str, uri: str) -> None:
    """A CorpusError naming `uri` when `path` lies under the working directory's results/: the pipeline's own outputs
    (a corpus, shards, another run's files) as a source would make the corpus an input of itself, which Snakemake
    deletes and rebuilds on the next run, taking the source with it."""
    results = os.path.abspath(RESULTS_FOLDER)
    if os.path.commonpath([os.path.abspath(path), results]) == results:
        raise CorpusError(f"{uri}: {path} is under {RESULTS_FOLDER}/, the pipeline's own outputs, which the pipeline "
                          "deletes and rebuilds; a corpus cannot read them. Copy the files you mean outside "
                          f"{RESULTS_FOLDER}/ and name that copy")


def check_local_file(path: str, uri: str) -> None:
    """A CorpusError naming `uri` unless `path` can be read and is compressed exactly when its name says so."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(4)
    except OSError as error:
        raise CorpusError(f"{uri}: cannot read {path}: {error.strerror}") from None
    _, compression = _format_of(path, uri)
    magic = next((suffix for suffix, starts in COMPRESSIONS.items() if head.startswith(starts)), None)
    if compression and magic != compression:
        raise CorpusError(f"{uri}: {path} is named {compression} but does not hold {compression} data (it starts "
                          f"with {head!r})")
    if magic and not compression:
        raise CorpusError(f"{uri}: {path} holds {magic} compressed data but its name does not end in {magic}: "
                          f"rename it to {os.path.basename(path)}{magic}")


def looks_binary(data: bytes) -> bool:
    """Whether a text file's bytes are binary: a NUL in the first BINARY_SNIFF_BYTES, or more than
    BINARY_INVALID_SHARE of them invalid UTF-8 (a character cut at the end of the window does not count)."""
    head = data[:BINARY_SNIFF_BYTES]
    if b"\x00" in head:
        return True
    decoded = codecs.getincrementaldecoder("utf-8")("replace").decode(head, final=False)
    return decoded.count("\ufffd") - head.count(REPLACEMENT_BYTES) > BINARY_INVALID_SHARE * len(head)


def local_source_files(sources: list[dict]) -> list[str]:
    """Every file the file:// entries of corpus.sources name, globs expanded now: the workflow declares them inputs
    of the corpus, so editing one (or a new file matching a glob) rebuilds it and everything after it."""
    return [path for source in sources if source_kind(source["uri"]) == "file"
            for path in local_files(source["uri"], source.get("include_hidden", False))]


def _read_files(source: dict, stats: SourceStats, decode: _Decoder, select: slice | None = None) -> Iterator[str]:
    """file://path or file://glob: each file in order, its sha256 recorded before it is read. Closed early (the cap),
    the source's sha256 covers the files read, and details.files_read counts them."""
    uri = source["uri"]
    paths = local_files(uri, source.get("include_hidden", False))
    stats.details["files"] = len(paths)
    if not source.get("include_hidden") and (select is None or not select.start):  # once per source, not per part
        if hidden := hidden_files(uri):
            stats.hidden_skipped = len(hidden)
            stats.details["hidden_files"] = hidden[:BINARY_LISTED]
    # Hashed in a pass of their own (the read after it comes from the page cache): the decompressors and parquet's
    # random access read the bytes in no order a running hash could follow.
    digests = stats.details["file_sha256"] = {}
    try:
        for path in paths[select or slice(None)]:
            digests[path] = sha256_file(Path(path))
            yield from _read_file(Path(path), f"{path} ({uri})", source, decode)
    finally:
        if digests:
            stats.sha256 = digests[paths[0]] if len(paths) == 1 else listing_sha256(digests)
        stats.details["files_read"] = len(digests)


def listing_sha256(digests: dict[str, str]) -> str:
    """A glob's sha256: of its files' `sha256  path` lines, as sha256sum prints them, in the order read."""
    return hashlib.sha256("".join(f"{digest}  {path}\n" for path, digest in digests.items()).encode()).hexdigest()


def _read_http(source: dict, stats: SourceStats, decode: _Decoder, cache_dir: Path) -> Iterator[str]:
    """Download (see download.py) into cache_dir/http, then read like a local file by the URL's extension."""
    url = source["uri"]
    name = PurePosixPath(urlsplit(url).path).name
    dest = cache_dir / "http" / f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{name}"
    try:
        stats.sha256 = download(url, dest, sha256=source.get("sha256"))
    except DownloadError as error:
        raise CorpusError(str(error)) from error
    stats.details.update(cached_at=str(dest), **http_validators(dest))
    yield from _read_file(dest, f"{url} (cached at {dest})", source, decode)


def _format_of(name: str, uri: str) -> tuple[str, str | None]:
    """('.jsonl', '.gz') for 'x.jsonl.gz', ('text', None) for 'x.py': records by the name, else text."""
    lowered, compression = str(name).lower(), None
    for suffix in COMPRESSIONS:
        if lowered.endswith(suffix):
            lowered, compression = lowered[: -len(suffix)], suffix
    return next((suffix for suffix in RECORD_FORMATS if lowered.endswith(suffix)), TEXT), compression


def _read_file(path: Path, label: str, source: dict, decode: _Decoder) -> Iterator[str]:
    """One local file: .jsonl or .parquet, else text (whole, or paragraphs), optionally .gz/.zst compressed."""
    fmt, compression = _format_of(path.name, source["uri"])
    field_name = source["text_field"]
    try:
        with _open_decompressed(path, compression) as stream:
            if fmt == TEXT:
                data = stream.read()
                if looks_binary(data):
                    _skip_binary(decode.stats, label)
                    return
                text = decode(data, label)
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


def _skip_binary(stats: SourceStats, label: str) -> None:
    stats.binary_skipped += 1
    listed = stats.details.setdefault("binary_files", [])
    if len(listed) < BINARY_LISTED:
        listed.append(label)


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


# The split an hf:// source reads when it names none. Not a schema default: `split` means something else (or nothing)
# for the other kinds of source, so the schema cannot fill it in for all of them.
HF_DEFAULT_SPLIT = "train"


def _read_hf(source: dict, stats: SourceStats, cache_dir: Path) -> Iterator[str]:
    """hf://<dataset> through datasets.load_dataset, cached under cache_dir/hf; fails fast and helpfully offline."""
    uri = source["uri"]
    name, config = uri[len("hf://"):], source.get("config")
    split, field_name = source.get("split", HF_DEFAULT_SPLIT), source["text_field"]
    revision, streaming = source.get("revision"), source["streaming"]
    hf_cache = str(cache_dir / "hf")
    stats.details.update(dataset=name, config=config, split=split, text_field=field_name, revision=revision,
                         streaming=streaming)
    try:
        import datasets

        # load_dataset's own steps, through the builder, whose hash is the Hub commit the revision resolved to
        builder = datasets.load_dataset_builder(name, config, cache_dir=hf_cache, revision=revision)
        stats.details["resolved_revision"] = builder.hash
        if streaming:
            dataset = builder.as_streaming_dataset(split=split)
        else:
            builder.download_and_prepare()
            dataset = builder.as_dataset(split=split)
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
