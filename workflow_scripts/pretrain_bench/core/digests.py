"""sha256 of files as they are written, and the checks that read them back: whole, or sampled.

A writer hashes the bytes passing through it (never read back), so the digest it records is of what it wrote. A
reader checks either every byte (`full_digest`) or SAMPLE_BYTES at every SAMPLE_STRIDE bytes (`sampled_digest`, about
1/64 of the data), which misses same-size damage between the windows. Checkpoints (train.checkpoint) and token shards
(data.shards) use both.
"""
from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

# The sampled hash covers SAMPLE_BYTES at offsets 0, SAMPLE_STRIDE, 2·SAMPLE_STRIDE, …: a file under 1 MiB is hashed
# whole; a 30 GB optimizer shard costs 480 MB of reads. Truncation is caught by the size, whatever the sample.
SAMPLE_BYTES = 1 << 20
SAMPLE_STRIDE = 64 << 20


def _sample_spans(start: int, stop: int):
    """The parts of the byte range [start, stop) that fall in sampled windows, as (from, to) pairs."""
    while start < stop:
        window, offset = divmod(start, SAMPLE_STRIDE)
        if offset < SAMPLE_BYTES:
            end = min(stop, window * SAMPLE_STRIDE + SAMPLE_BYTES)
            yield start, end
            start = end
        else:
            start = (window + 1) * SAMPLE_STRIDE


class HashingFile:
    """A write-only binary file that computes its sha256 and sampled sha256 from the bytes passing through.

    `fail_after` (tests only) raises ENOSPC once that many bytes are written, like a full disk would.
    """

    def __init__(self, path: Path, fail_after: int | None = None):
        self.path = Path(path)
        self._file = open(self.path, "wb")
        self._full, self._sampled = hashlib.sha256(), hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None  # the first write error: torch re-raises it as a vague RuntimeError
        self._fail_after = fail_after

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            if self._fail_after is not None and self.size + len(view) > self._fail_after:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
            written = self._file.write(view)
        except OSError as error:
            self.error = self.error or error
            raise
        self._full.update(view)
        for start, stop in _sample_spans(self.size, self.size + len(view)):
            self._sampled.update(view[start - self.size:stop - self.size])
        self.size += len(view)
        return written

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> dict:
        """fsync and close; returns the file's record for the marker."""
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as error:
            self.error = self.error or error
            raise
        finally:
            self._file.close()
        return {"size": self.size, "sha256": self._full.hexdigest(), "sampled_sha256": self._sampled.hexdigest()}

    def discard(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)


def digest_file(path: Path) -> dict:
    """The marker record of a file written by someone else (DeepSpeed's copied recovery scripts): read once."""
    full, sampled, size = hashlib.sha256(), hashlib.sha256(), 0
    with open(path, "rb") as handle:
        while chunk := handle.read(SAMPLE_BYTES):
            full.update(chunk)
            for start, stop in _sample_spans(size, size + len(chunk)):
                sampled.update(chunk[start - size:stop - size])
            size += len(chunk)
    return {"size": size, "sha256": full.hexdigest(), "sampled_sha256": sampled.hexdigest()}


def full_digest(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def sampled_digest(path: Path, size: int) -> str:
    sampled = hashlib.sha256()
    with open(path, "rb") as handle:
        for offset in range(0, size, SAMPLE_STRIDE):
            handle.seek(offset)
            sampled.update(handle.read(min(SAMPLE_BYTES, size - offset)))
    return sampled.hexdigest()
