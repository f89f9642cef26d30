"""Cleaning throughput of the download_corpus stage on the builtin corpus, next to a bare read of the same files.

    python bench/bench_corpus.py [out.json]        (default bench-results/corpus.json)

Three timings over the whole builtin corpus (every standard-library .py file that builtin://python-stdlib reads),
each the best of REPEATS runs after one warm-up pass, so all read from the page cache and the figures compare CPU
work, not disk speed:
- bare_read:   open and read every file's bytes;
- read_decode: the same plus UTF-8 decoding, the least any consumer of text must do;
- read_write:  read every file and append its bytes, unchanged, to one file in the same scratch directory as
               cleaning's output: copying alone, no cleaning, the least any stage that writes its input out must do;
- cleaning:    build_corpus end to end: read, decode, NUL scan, length filter, sha256 dedup, split, JSON encoding,
               writing train/val.jsonl, hashing them for the manifest and the atomic renames.
Throughput is input bytes / seconds in MB/s (10**6 bytes). The target is cleaning <= 2x the bare read.
`floors` times the unavoidable per-byte steps of cleaning alone, on texts already in memory (JSON escaping of the
jsonl lines, sha256 of every document and of the written lines): they show how close cleaning is to its own floor.
"""
import hashlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from pretrain_bench.corpus import build_corpus, jsonl_line
from pretrain_bench.corpus_sources import stdlib_files

REPEATS = 5
TARGET_RATIO = 2.0


def best_of(function, repeats: int = REPEATS) -> float:
    function()  # warm-up: page cache, imports, allocator
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        timings.append(time.perf_counter() - start)
    return min(timings)


def main(out_path: Path) -> dict:
    root, names = stdlib_files()
    paths = [os.path.join(root, name) for name in names]
    total_bytes = sum(os.path.getsize(path) for path in paths)

    def bare_read():
        for path in paths:
            with open(path, "rb") as handle:
                handle.read()

    def read_decode():
        for path in paths:
            with open(path, "rb") as handle:
                handle.read().decode("utf-8", "replace")

    with tempfile.TemporaryDirectory() as scratch:
        def cleaning():
            build_corpus([{"uri": "builtin://python-stdlib"}], Path(scratch) / "out", max_bytes=None, min_chars=1,
                         dedup=True, val_fraction=0.02, encoding_errors="replace", cache_dir=Path(scratch) / "cache")

        def read_write():
            with open(Path(scratch) / "copy.bin", "wb") as out:
                for path in paths:
                    with open(path, "rb") as handle:
                        out.write(handle.read())

        seconds = {"bare_read": best_of(bare_read), "read_decode": best_of(read_decode),
                   "read_write": best_of(read_write), "cleaning": best_of(cleaning)}

    texts = []
    for path in paths:
        with open(path, "rb") as handle:
            texts.append(handle.read().decode("utf-8", "replace"))
    lines = [jsonl_line(text) for text in texts]
    floors = {
        "json_lines": best_of(lambda: [jsonl_line(text) for text in texts]),
        "sha256_documents": best_of(lambda: [hashlib.sha256(text.encode()).digest() for text in texts]),
        "sha256_lines": best_of(lambda: [hashlib.sha256().update(line) for line in lines]),
    }

    def figures(name):
        return {"seconds": round(seconds[name], 5), "mb_per_s": round(total_bytes / seconds[name] / 1e6, 1)}

    result = {
        "corpus": "builtin://python-stdlib",
        "files": len(paths),
        "bytes": total_bytes,
        "repeats": REPEATS,
        "bare_read": figures("bare_read"),
        "read_decode": figures("read_decode"),
        "read_write": figures("read_write"),
        "cleaning": figures("cleaning"),
        "floors_seconds": {name: round(value, 5) for name, value in floors.items()},
        "floors_over_bare_read": round(sum(floors.values()) / seconds["bare_read"], 2),
        "cleaning_over_bare_read": round(seconds["cleaning"] / seconds["bare_read"], 2),
        "cleaning_over_read_decode": round(seconds["cleaning"] / seconds["read_decode"], 2),
        "read_write_over_bare_read": round(seconds["read_write"] / seconds["bare_read"], 2),
        "cleaning_over_read_write": round(seconds["cleaning"] / seconds["read_write"], 2),
        "target_cleaning_over_bare_read": TARGET_RATIO,
        "meets_target": seconds["cleaning"] <= TARGET_RATIO * seconds["bare_read"],
        "python": platform.python_version(),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "processor": platform.machine()},
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1] if len(sys.argv) > 1 else "bench-results/corpus.json")), indent=2))
