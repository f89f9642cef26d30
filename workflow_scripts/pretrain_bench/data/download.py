"""HTTP(S) download of corpus files: streamed, resumable, retried, checksummed and atomic.

Why this is hand-written: Snakemake's http storage plugin fetches a URL in one request and has no resume after a
dropped connection, no `Range` handling, no backoff on 5xx answers and no sha256 check. Corpus files are large and
links are flaky, so a half-downloaded or silently corrupted file must never reach the cleaner. This is the one place
in pretrain-bench where a downloader of our own is justified; everything else uses Snakemake's machinery.

What `download()` guarantees:
1) the body streams into `<dest>.part` with connect/read timeouts;
2) connection errors, timeouts, truncated bodies and 5xx answers are retried with exponential backoff, resuming with
   `Range: bytes=<size of .part>-`; a server that ignores `Range` (answers 200) restarts the file from zero;
3) 4xx answers fail at once (retrying a 404 forever helps nobody);
4) the finished file's sha256 is checked when one is given; a mismatch deletes the `.part` and names URL, expected
   and actual digest;
5) only then is `.part` renamed onto `dest` (os.replace), so `dest` exists only complete and verified;
6) a download that fails for good leaves nothing behind: its `.part` and its lock file are removed (a rerun starts
   that file from zero; only an interrupted or killed download leaves a `.part`, which the next run resumes).
7) the server's validators (ETag, Last-Modified) are kept beside the file in `<dest>.http.json`, for the manifest
   (`http_validators`) and for resuming: a resumed request carries `If-Range`, so a file changed on the server since
   the `.part` was started is fetched whole again rather than spliced from two versions.
A lock file serialises concurrent downloads of one URL (two Snakemake jobs sharing resources/corpus-cache).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pretrain_bench.core.progress import Progress

if TYPE_CHECKING:
    import requests

log = logging.getLogger(__name__)

# Hashing in 1 MiB pieces keeps memory flat for multi-GB files.
CHUNK_BYTES = 1 << 20
# Bodies stream in 64 KiB pieces: urllib3 discards a short final read when the connection drops, so this bounds
# what a dropped connection costs on resume.
STREAM_CHUNK_BYTES = 1 << 16
# Never sleep longer than this between attempts, however many retries are configured.
MAX_BACKOFF_S = 60.0


class DownloadError(RuntimeError):
    """A download failed for good: a 4xx answer, retries used up, or a sha256 mismatch."""


class _Retryable(Exception):
    """A transient failure (5xx, truncated body, odd Content-Range): worth another attempt."""


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks (also used for the corpus manifest's split digests)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def validators_path(dest: Path) -> Path:
    """Where the server's ETag and Last-Modified for `dest` (or its `.part`) are kept."""
    return dest.with_name(dest.name + ".http.json")


def http_validators(dest: Path) -> dict:
    """{"etag", "last_modified"} as the server sent them with `dest`'s bytes; None each where it sent none (or the
    file was downloaded before they were kept)."""
    try:
        info = json.loads(validators_path(Path(dest)).read_text())
    except (OSError, ValueError):
        info = {}
    return {"etag": info.get("etag"), "last_modified": info.get("last_modified")}


def download(
    url: str,
    dest: Path,
    *,
    sha256: str | None = None,
    connect_timeout_s: float = 10.0,
    read_timeout_s: float = 60.0,
    retries: int = 5,
    backoff_s: float = 1.0,
    session: requests.Session | None = None,
) -> str:
    """Download `url` to `dest` (see the module docstring) and return the file's hex sha256.

    An existing `dest` is reused when it matches `sha256` (or when no sha256 is given); a mismatching one is
    fetched again. `retries` is the number of extra attempts after the first; attempt k sleeps
    `backoff_s * 2**k` seconds (capped at MAX_BACKOFF_S) before trying again.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    expected = sha256.lower() if sha256 else None
    lock_path = dest.with_name(dest.name + ".lock")
    part = dest.with_name(dest.name + ".part")
    with _locked(lock_path):
        try:
            return _download_locked(url, dest, part, expected, session, (connect_timeout_s, read_timeout_s),
                                    retries, backoff_s)
        except Exception:  # an interrupt (Ctrl-C) keeps the .part for the next run to resume
            part.unlink(missing_ok=True)
            if not dest.exists():
                validators_path(dest).unlink(missing_ok=True)
            # Unlinked while still held: a process waiting on this lock file notices and locks the new one.
            lock_path.unlink(missing_ok=True)
            raise


class _locked:
    """An exclusive flock on `path` that survives the file being unlinked by a failed holder: after locking, the
    name must still point at the locked file, else the lock is taken again on the current one."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        while True:
            handle = open(self.path, "a")
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                same = os.path.samestat(os.fstat(handle.fileno()), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                self.handle = handle
                return handle
            handle.close()

    def __exit__(self, *exc):
        self.handle.close()  # releases the lock
        return False


def _download_locked(url: str, dest: Path, part: Path, expected: str | None, session, timeout, retries: int,
                     backoff_s: float) -> str:
    """download() once its lock is held."""
    if dest.exists():
        actual = sha256_file(dest)
        if expected is None or actual == expected:
            log.info("using cached %s for %s", dest, url)
            return actual
        log.warning("cached %s has sha256 %s, expected %s: downloading again", dest, actual, expected)
        dest.unlink()
    own_session = session is None
    import requests  # here, not at the top: every cleaning process imports this module, few download (0.4 s)

    session = session or requests.Session()
    try:
        _fetch_with_retries(session, url, part, timeout, retries, backoff_s)
    finally:
        if own_session:
            session.close()
    actual = sha256_file(part)
    if expected is not None and actual != expected:
        part.unlink()
        raise DownloadError(
            f"sha256 mismatch for {url}: expected {expected}, got {actual}; the download was discarded"
        )
    os.replace(part, dest)
    log.info("downloaded %s -> %s (%d bytes, sha256 %s)", url, dest, dest.stat().st_size, actual)
    return actual


def _fetch_with_retries(session, url, part: Path, timeout, retries: int, backoff_s: float) -> None:
    """Run `_fetch_once` until the .part file is complete; transient failures sleep and resume."""
    import requests

    attempts = retries + 1
    for attempt in range(attempts):
        try:
            _fetch_once(session, url, part, timeout)
            return
        except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError,
                _Retryable) as error:
            if attempt + 1 == attempts:
                raise DownloadError(f"{url}: giving up after {attempts} attempts; last error: {error}") from error
            delay = min(backoff_s * 2**attempt, MAX_BACKOFF_S)
            log.warning("%s: attempt %d/%d failed (%s); retrying in %.2f s", url, attempt + 1, attempts, error, delay)
            time.sleep(delay)


def _fetch_once(session, url, part: Path, timeout) -> None:
    """One request: resume `part` from its current size, or restart it when the server will not resume."""
    offset = part.stat().st_size if part.exists() else 0
    # identity: a gzip Content-Encoding would make byte offsets (Range) and the sha256 refer to different bytes.
    headers = {"Accept-Encoding": "identity"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
        if if_range := _if_range(part):
            headers["If-Range"] = if_range  # changed on the server since: it answers 200 with the new file whole
    with session.get(url, headers=headers, stream=True, timeout=timeout) as response:
        status = response.status_code
        if status == 416 and offset:
            # Range not satisfiable: either .part is already complete (crash before the rename) or it is junk.
            total = _content_range_total(response.headers.get("Content-Range", ""))
            if total == offset:
                return
            part.unlink()
            raise _Retryable(f"HTTP 416 for a {offset}-byte .part (server size {total}); restarting from zero")
        if status >= 500:
            raise _Retryable(f"HTTP {status} {response.reason}")
        if status >= 400:
            raise DownloadError(f"{url}: HTTP {status} {response.reason}")
        if status == 206:
            start, total = _parse_content_range(response.headers.get("Content-Range", ""))
            if start != offset:
                part.unlink()
                raise _Retryable(f"asked for byte {offset}, server sent from {start}; restarting from zero")
            mode = "ab"
        else:
            if offset:
                log.warning("%s: server sent the whole file (HTTP %d: Range ignored, or the file changed since the "
                            ".part was started); restarting from zero", url, status)
            offset, mode = 0, "wb"
            _keep_validators(part, response.headers)
            length = response.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
        progress = Progress(f"download {url}", log, total=total)
        progress.done = offset  # a resumed download counts what the .part already holds
        with open(part, mode) as handle:
            for chunk in response.iter_content(STREAM_CHUNK_BYTES):
                handle.write(chunk)
                progress.advance(len(chunk))
    size = part.stat().st_size
    if total is not None and size != total:
        # urllib3 usually raises on a short body; this catches servers that close without a length error.
        raise _Retryable(f"incomplete body: have {size} of {total} bytes")


def _keep_validators(part: Path, headers) -> None:
    """Record the validators of the response whose body starts the .part (they describe the file it becomes)."""
    dest = part.with_name(part.name.removesuffix(".part"))
    validators = {"etag": headers.get("ETag"), "last_modified": headers.get("Last-Modified")}
    validators_path(dest).write_text(json.dumps(validators) + "\n")


def _if_range(part: Path) -> str | None:
    """The validator a resumed request sends as If-Range: a strong ETag, else Last-Modified (RFC 9110 13.1.5)."""
    validators = http_validators(part.with_name(part.name.removesuffix(".part")))
    etag = validators["etag"]
    return etag if etag and not etag.startswith("W/") else validators["last_modified"]


def _parse_content_range(value: str) -> tuple[int | None, int | None]:
    """'bytes 100-199/200' -> (100, 200); total is None for '*'; (None, None) when unparsable."""
    try:
        _, _, spec = value.partition(" ")
        span, _, total = spec.partition("/")
        start = int(span.split("-")[0])
        return start, (None if total == "*" else int(total))
    except ValueError:
        return None, None


def _content_range_total(value: str) -> int | None:
    """'bytes */200' (a 416's Content-Range) -> 200."""
    _, _, total = value.partition("/")
    return int(total) if total.isdigit() else None
