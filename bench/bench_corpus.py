"""Cleaning throughput of the download_corpus stage on the builtin corpus, next to a bare read of the same files;
then the data stages at scale: cleaning as 1 job against 2 part jobs, tokenizer training, a shard job.

    python bench/bench_corpus.py [out.json] [--sizes-mb 60,600] [--rounds 3] [--bpe-mb N] [--skip-builtin]
                                                   (default bench-results/corpus.json)

Each section can run alone, so that a measurement fits a short quiet spell of a shared machine: `--skip-builtin
--bpe-mb 0 --sizes-mb 600` only cleans, `--skip-builtin --sizes-mb ""` only trains the tokenizer and runs the shard
job.

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

`scale`: a local corpus of each size in --sizes-mb is generated under the system's temporary folder
(never in the checkout), then cleaned alternately (A B A B ..., --rounds pairs) by one job (build_corpus in its own
process: the corpus stage with corpus.jobs 1) and by two part jobs running at once followed by the merge (corpus.jobs
2). Each job is a fresh process that first imports what Snakemake's script preamble imports, as a `script:` job
starts, so start-up is included; the wall time of the whole stage and each job's peak RSS and CPU seconds (user +
system) are recorded. The speedup is the median of the per-round ratios (1 job's seconds / 2 jobs' seconds of the
same round), so a slow spell of the machine falls on both sides of a ratio. The CPU seconds do not stretch with
other work: `critical_path_cpu_seconds` is one job's CPU time against the slowest part plus the merge (an upper
bound for the merge, whose copy and hash run in two threads at once). Then the BPE is trained on --bpe-mb of that
corpus (default: config.yaml's tokenizer.train_bytes) with config.yaml's vocabulary, and one shard job encodes a
slice of it.
"""
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from pretrain_bench.data.corpus import build_corpus, jsonl_line
from pretrain_bench.data.sources import stdlib_files

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


# --- the data stages at scale ---
DOCUMENT_FILE_BYTES = 6_000_000  # each generated jsonl file (a part job divides the sources by files)
CLEANING = {"min_chars": 1, "dedup": True, "val_fraction": 0.01, "encoding_errors": "replace", "max_bytes": None}
# the default experiment's tokenizer (vocab_size, train_bytes)
DEFAULT_TOKENIZER = yaml.safe_load((Path(__file__).parents[1] / "config.yaml").read_text())["tokenizer"]
BPE_VOCAB = DEFAULT_TOKENIZER["vocab_size"]
# What Snakemake's preamble imports before a `script:` runs (snakemake/script/__init__.py): part of each job's start.
SNAKEMAKE_PREAMBLE = "from snakemake.logging import logger; from snakemake.iocontainers import Snakemake; "


def generate_corpus(folder: Path, size: int) -> list[dict]:
    """`size` bytes of jsonl under `folder` (kept between runs): the standard library's sources, each copy headed by
    a line of its own so that no two documents are equal; returns the corpus.sources naming it."""
    marker = folder / f"complete-{size}"
    if not marker.exists():
        folder.mkdir(parents=True, exist_ok=True)
        root, names = stdlib_files()
        texts = [Path(root, name).read_bytes().decode("utf-8", "replace") for name in names]
        written, number, copy = 0, 0, 0
        while written < size:
            with open(folder / f"{number:05d}.jsonl", "wb") as handle:
                file_bytes = 0
                while file_bytes < DOCUMENT_FILE_BYTES and written < size:
                    for text in texts[copy % 7::7]:
                        line = jsonl_line(f"# copy {copy} of a standard-library module\n{text}")
                        handle.write(line)
                        file_bytes += len(line)
                    copy += 1
                written += file_bytes
            number += 1
        marker.touch()
    return [{"uri": f"file://{folder}/*.jsonl"}]


def start_job(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SNAKEMAKE_PREAMBLE + code])


def wait_job(process: subprocess.Popen) -> dict:
    """Wait for `process`: its peak RSS in bytes and CPU seconds (user + system), from os.wait4's usage of that
    child alone. CPU seconds hold on a loaded machine, where wall times stretch with the other work."""
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise RuntimeError(f"job failed ({process.returncode}): {process.args[-1][:200]}")
    return {"peak_rss_bytes": usage.ru_maxrss * 1024, "cpu_seconds": usage.ru_utime + usage.ru_stime}


def run_job(code: str) -> tuple[float, dict]:
    """A fresh Python process running `code`: (wall seconds, wait_job's figures), start-up included."""
    start = time.perf_counter()
    figures = wait_job(start_job(code))
    return time.perf_counter() - start, figures


def one_job(sources: list[dict], out: Path) -> dict:
    code = (f"from pathlib import Path; from pretrain_bench.data.corpus import build_corpus; build_corpus({sources!r}, "
            f"Path({str(out)!r}), cache_dir=Path({str(out / 'cache')!r}), **{CLEANING!r})")
    seconds, figures = run_job(code)
    return {"seconds": seconds, "jobs": {"build_corpus": figures}, "critical_path_cpu_seconds": figures["cpu_seconds"]}


def two_jobs(sources: list[dict], out: Path) -> dict:
    parts = 2
    start = time.perf_counter()
    jobs = [start_job(f"from pathlib import Path; from pretrain_bench.data.corpus_parts import clean_part; clean_part("
                      f"{sources!r}, Path({str(out / 'parts')!r}), part={part}, parts={parts}, "
                      f"cache_dir=Path({str(out / 'cache')!r}), **{CLEANING!r})") for part in range(parts)]
    figures = {f"clean_part {part}": wait_job(job) for part, job in enumerate(jobs)}
    parts_seconds = time.perf_counter() - start
    merge_seconds, figures["merge"] = run_job(
        f"from pathlib import Path; from pretrain_bench.data.corpus_parts import merge_parts; merge_parts({sources!r}, "
        f"Path({str(out / 'parts')!r}), Path({str(out)!r}), parts={parts}, **{CLEANING!r})")
    # on idle cores the parts run side by side: the stage takes the slowest part, then the merge
    path = max(figures[f"clean_part {part}"]["cpu_seconds"] for part in range(parts)) + figures["merge"]["cpu_seconds"]
    return {"seconds": time.perf_counter() - start, "parts_seconds": parts_seconds, "merge_seconds": merge_seconds,
            "jobs": figures, "critical_path_cpu_seconds": path}


def cleaning_at(size: int, rounds: int, scratch: Path) -> dict:
    sources = generate_corpus(Path(tempfile.gettempdir()) / f"pretrain-bench-corpus-{size}", size)
    runs = {"1 job": [], "2 jobs": []}
    for round_number in range(rounds):  # A B A B: a slow spell of the machine falls on both
        for name, clean in (("1 job", one_job), ("2 jobs", two_jobs)):
            out = scratch / f"{size}-{name.replace(' ', '')}-{round_number}"
            runs[name].append(clean(sources, out))
            shutil.rmtree(out)
    median = {name: statistics.median(run["seconds"] for run in values) for name, values in runs.items()}
    cpu_path = {name: statistics.median(run["critical_path_cpu_seconds"] for run in values)
                for name, values in runs.items()}
    ratios = [one["seconds"] / two["seconds"] for one, two in zip(runs["1 job"], runs["2 jobs"])]
    corpus_bytes = sum(path.stat().st_size for path in Path(sources[0]["uri"][7:]).parent.glob("*.jsonl"))
    return {"bytes": corpus_bytes, "runs": runs, "median_seconds": median,
            "mb_per_s": {name: corpus_bytes / seconds / 1e6 for name, seconds in median.items()},
            "speedup_2_jobs_per_round": ratios,
            "speedup_2_jobs": statistics.median(ratios), "target_speedup_2_jobs": 1.6,
            "critical_path_cpu_seconds": cpu_path,
            "speedup_2_jobs_on_idle_cores": cpu_path["1 job"] / cpu_path["2 jobs"],
            "peak_rss_bytes": {name: max(job["peak_rss_bytes"] for run in values for job in run["jobs"].values())
                               for name, values in runs.items()}}


def tokenizer_and_shard(size: int, bpe_bytes: int, scratch: Path) -> dict:
    """BPE training on `bpe_bytes` of the generated corpus (one process, all cores), and one shard job encoding a
    slice of about 50 MB of it."""
    sources = generate_corpus(Path(tempfile.gettempdir()) / f"pretrain-bench-corpus-{size}", size)
    corpus = scratch / "bpe-corpus"
    build_corpus(sources, corpus, cache_dir=scratch / "cache", **CLEANING)
    train = corpus / "train.jsonl"
    tokenizer_seconds, tokenizer = run_job(
        f"from pathlib import Path; from pretrain_bench.data.tokenizer import train_tokenizer; train_tokenizer("
        f"Path({str(train)!r}), Path({str(scratch / 'tok')!r}), vocab_size={BPE_VOCAB}, train_bytes={bpe_bytes})")
    count = max(1, round(train.stat().st_size / 50e6))
    shard_seconds, shard_job = run_job(
        f"from pathlib import Path; from pretrain_bench.data.shards import encode_shard; "
        f"encode_shard(Path({str(train)!r}), Path({str(scratch / 'tok')!r}), Path({str(scratch / 's.bin')!r}), "
        f"Path({str(scratch / 's.json')!r}), "
        f"split='train', index=0, count={count})")
    shard = json.loads((scratch / "s.json").read_text())
    return {"tokenizer": {"train_bytes": bpe_bytes, "vocab_size": BPE_VOCAB, "seconds": tokenizer_seconds,
                          "mb_per_s": bpe_bytes / tokenizer_seconds / 1e6, **tokenizer},
            "shard_job": {"text_bytes": shard["text_bytes"], "tokens": shard["tokens"], "seconds": shard_seconds,
                          "mb_per_s": shard["text_bytes"] / shard_seconds / 1e6, **shard_job,
                          "threads": os.cpu_count()}}


BPE_CORPUS_BYTES = 600_000_000  # the corpus the tokenizer and the shard job read when no --sizes-mb is given


def scale(sizes: list[int], rounds: int, bpe_bytes: int) -> dict:
    """The data stages at scale (the module docstring); bpe_bytes 0 leaves out the tokenizer and the shard job."""
    with tempfile.TemporaryDirectory() as scratch:
        result = {"cores": os.cpu_count(), "load_average_before": os.getloadavg(),
                  "cleaning": {str(size): cleaning_at(size, rounds, Path(scratch)) for size in sizes}}
        if bpe_bytes:
            result.update(tokenizer_and_shard(max(sizes, default=BPE_CORPUS_BYTES), bpe_bytes, Path(scratch)))
        result["load_average_after"] = os.getloadavg()
    return result


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", nargs="?", default="bench-results/corpus.json")
    parser.add_argument("--sizes-mb", default="60,600", help="sizes of the generated corpora, MB (10**6 bytes)")
    parser.add_argument("--rounds", type=int, default=3, help="A B pairs per size (1 job, 2 jobs)")
    parser.add_argument("--bpe-mb", type=float, default=DEFAULT_TOKENIZER["train_bytes"] / 1e6,
                        help="MB of the corpus the BPE is trained on (default: config.yaml's tokenizer.train_bytes; "
                             "0: no tokenizer or shard job)")
    parser.add_argument("--skip-builtin", action="store_true", help="only the scale section")
    args = parser.parse_args()
    out = Path(args.out)
    result = {} if args.skip_builtin else main(out)
    result["scale"] = scale([int(float(mb) * 1e6) for mb in args.sizes_mb.split(",") if mb], args.rounds,
                            int(args.bpe_mb * 1e6))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
