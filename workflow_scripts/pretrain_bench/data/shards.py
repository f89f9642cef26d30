"""Token shards: each `shard_tokens` job encodes one contiguous slice of a split into a flat .bin; `index_shards`
gathers their sidecars into index.json.

Slices are byte ranges of the split's jsonl (shard i of n covers [size*i//n, size*(i+1)//n), a document belonging to
the range its line starts in), so a job needs neither a counting pass nor the whole corpus in memory, and slices
are balanced by bytes, which is what encoding time follows. The .bin is the raw token stream, every document
followed by EOS, readable with `np.memmap(path, dtype)`; same inputs give byte-identical files.

Integrity: a shard job hashes the bytes as it writes them (core.digests.HashingFile, never read back) and records
the sha256 and sampled sha256 in its sidecar; `build_index` copies them into index.json only after checking that each
.bin still has those bytes (a touched or rewritten shard is never blessed), and `verify_index` checks them again for a
reader, before the first training step, in full or sampled (shards.verify). A shard whose bytes changed after its
job is found before any job runs too (`changed_shard_problems`, from the workflow), so that no failing job makes
Snakemake delete the shared index.json. Each error names the file and the command that rebuilds exactly that shard.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from pretrain_bench.core.digests import HashingFile, full_digest, sampled_digest
from pretrain_bench.core.io import atomic_write_text, disk_full
from pretrain_bench.core.progress import Progress
from pretrain_bench.data.products import DataProducts, command_line_forcing, damaged, forced, tokenizer_problem
from pretrain_bench.data.tokenizer import iter_texts, load_tokenizer

log = logging.getLogger(__name__)

# 2: no seq_len (the index describes the token stream, shared by runs of any sample length; a run's seq_len is its
# plan's)
INDEX_FORMAT = 2
BATCH_TEXT_BYTES = 4 << 20  # text per encode call: large enough to keep every rayon thread busy, small in memory


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 while every id (< vocab_size) fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def shard_byte_range(file_size: int, index: int, count: int) -> tuple[int, int]:
    """[start, stop) bytes of the jsonl that shard `index` of `count` encodes."""
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} is outside 0..{count - 1} (shards.count = {count})")
    return file_size * index // count, file_size * (index + 1) // count


def _text_batches(texts, batch_bytes: int):
    """Lists of texts of about `batch_bytes` characters each."""
    batch, size = [], 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encoded_batches(texts, encode_batch, batch_bytes: int):
    """(batch, encodings) pairs in order. The encoder releases the GIL, so a worker thread encodes batch n + 1
    while the caller writes batch n and this generator reads batch n + 2: reading and writing overlap the
    encoding instead of adding to it (bench/bench_tokens.py). At most two batches are in flight."""
    with ThreadPoolExecutor(max_workers=1) as encoder:
        pending = None
        for batch in _text_batches(texts, batch_bytes):
            submitted = (batch, encoder.submit(encode_batch, batch, add_special_tokens=False))
            if pending is not None:
                yield pending[0], pending[1].result()
            pending = submitted
        if pending is not None:
            yield pending[0], pending[1].result()


def encode_shard(corpus_jsonl: Path, tokenizer_dir: Path, out_bin: Path, out_json: Path, *, split: str,
                 index: int, count: int, batch_bytes: int = BATCH_TEXT_BYTES) -> dict:
    """Encode shard `index` of `count` of `corpus_jsonl` into `out_bin` (+ sidecar `out_json`); returns the sidecar."""
    corpus_jsonl, out_bin, out_json = Path(corpus_jsonl), Path(out_bin), Path(out_json)
    tokenizer, info = load_tokenizer(Path(tokenizer_dir))
    # Corpus text that happens to spell "<|endoftext|>" is text, not a document boundary: only we add EOS.
    tokenizer.encode_special_tokens = True
    # encode_batch_fast skips offset tracking, which shards never use (older tokenizers lack it).
    encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    dtype = dtype_for_vocab(info["vocab_size"])
    eos = np.array([info["eos_id"]], dtype=dtype)
    start, stop = shard_byte_range(corpus_jsonl.stat().st_size, index, count)

    tokens, documents, text_bytes = 0, 0, 0
    # Progress counts text bytes against the slice's jsonl bytes: JSON escaping makes the slice somewhat larger than
    # its text, so the share shown ends a little below 100 % and the ETA errs long.
    progress = Progress(f"{split} shard {index}/{count}", log, total=stop - start)
    out_bin.parent.mkdir(parents=True, exist_ok=True)
    tmp_bin = out_bin.with_name(f"{out_bin.name}.tmp-{os.getpid()}")
    f = HashingFile(tmp_bin)  # the digests recorded are of the bytes written, as they were written
    try:
        texts = iter_texts(corpus_jsonl, start, stop)
        for batch, encodings in _encoded_batches(texts, encode_batch, batch_bytes):
            # numpy raises OverflowError rather than wrap should an id not fit the dtype
            pieces = [piece for encoding in encodings for piece in (np.array(encoding.ids, dtype=dtype), eos)]
            ids = np.concatenate(pieces)  # (tokens in batch,)
            f.write(memoryview(ids))
            tokens += ids.size
            documents += len(batch)
            batch_text_bytes = sum(len(text.encode("utf-8", "surrogatepass")) for text in batch)
            text_bytes += batch_text_bytes
            # the lambda reads the running counts when the progress line is written, which is what it should show
            progress.advance(batch_text_bytes, lambda: f"{documents:,} documents, {tokens:,} tokens")  # noqa: B023
        written = f.close()
        os.replace(tmp_bin, out_bin)
    except OSError as error:
        f.discard()  # Snakemake removes a failed job's outputs, not our temporary file
        if error.errno != errno.ENOSPC:
            raise
        # the whole shard's size (its partial file is removed), estimated from the share of its slice encoded so far
        written, done = tokens * dtype.itemsize, min(1.0, text_bytes / max(stop - start, 1))
        raise disk_full(out_bin, int(written / done) if written and done else None) from error
    except BaseException:
        f.discard()
        raise

    sidecar = {
        "split": split, "shard": index, "count": count, "file": out_bin.name,
        "tokens": tokens, "documents": documents, "text_bytes": text_bytes, "sha256": written["sha256"],
        "sampled_sha256": written["sampled_sha256"], "bytes": written["size"],
        "dtype": dtype.name, "vocab_size": info["vocab_size"], "eos_id": info["eos_id"], "pad_id": info["pad_id"],
        "byte_range": [start, stop],
    }
    atomic_write_text(out_json, json.dumps(sidecar, indent=2) + "\n")
    log.info("%s shard %d/%d: %d documents, %d tokens -> %s", split, index, count, documents, tokens, out_bin)
    return sidecar


def shard_problem(path: Path, record: dict, itemsize: int, mode: str, writer: str) -> str | None:
    """What is wrong with one shard file against its record (sidecar or index entry), None when nothing: missing,
    truncated or grown (size), or other bytes than `writer` wrote (sha256, whole in mode 'full', sampled in mode
    'sampled'; a record from before sampled digests were kept is checked in full). Mode 'size': the size alone."""
    path = Path(path)
    if not path.is_file():
        return f"{path} is missing"
    size, expected = path.stat().st_size, record["tokens"] * itemsize
    if size != expected:
        return f"{path} holds {size:,} bytes, {writer} wrote {expected:,} ({record['tokens']:,} tokens)"
    if mode == "sampled" and record.get("sampled_sha256"):
        if sampled_digest(path, size) != record["sampled_sha256"]:
            return f"{path} does not match the sampled sha256 {writer} recorded from the bytes it wrote"
    elif mode != "size" and full_digest(path) != record["sha256"]:
        return f"{path} does not match the sha256 {writer} recorded from the bytes it wrote"
    return None


def verify_index(index_path: Path, mode: str) -> dict:
    """Check every shard index.json lists against the digests recorded when it was written (shards.verify: 'full'
    or 'sampled'); returns the index. Raises DamagedProductError naming each bad file and the command that rebuilds
    them (and the index)."""
    index_path = Path(index_path)
    index = json.loads(index_path.read_text())
    itemsize = np.dtype(index["dtype"]).itemsize
    entries = [entry for split in index["splits"].values() for entry in split["shards"]]
    with ThreadPoolExecutor(max_workers=max(1, min(len(entries), os.cpu_count() or 1))) as pool:
        found = list(pool.map(lambda e: shard_problem(index_path.parent / e["file"], e, itemsize, mode,
                                                      "its shard job"), entries))
    problems = [(entry, problem) for entry, problem in zip(entries, found) if problem]
    if problems:
        raise damaged(str(index_path.parent), "; ".join(problem for _, problem in problems),
                      [str(index_path.parent / entry["file"]) for entry, _ in problems], str(index_path))
    log.info("shards of %s verified (%s): %d files", index_path, mode, len(entries))
    return index


def changed_shard_problems(shards_folder: str, index: str, forcerun=(), forceall: bool = False) -> str | None:
    """Before any job runs: the shards of `shards_folder` whose .bin changed after their job wrote it (newer than
    its sidecar, as a touch or an edit leaves it) and whose bytes are not the recorded ones, as the error to stop
    with; None when none. Snakemake would rerun index_shards for them, and a failing index job would make it delete
    the shared index.json; a shard this command rebuilds (--forcerun naming it or shard_tokens) is not checked."""
    folder = Path(shards_folder)
    problems, bad = [], []
    for sidecar_path in sorted(folder.glob("*-[0-9][0-9][0-9][0-9][0-9].json")) if folder.is_dir() else ():
        bin_path = sidecar_path.with_suffix(".bin")
        try:
            if bin_path.stat().st_mtime_ns <= sidecar_path.stat().st_mtime_ns:
                continue
            sidecar = json.loads(sidecar_path.read_text())
        except (OSError, ValueError):
            continue  # not written yet, or being written: its job is to run
        if forced(str(bin_path), "shard_tokens", forcerun, forceall):
            continue
        itemsize = np.dtype(sidecar["dtype"]).itemsize
        if problem := shard_problem(bin_path, sidecar, itemsize, "full", "its shard job"):
            problems.append(problem)
            bad.append(str(bin_path))
    if not problems:
        return None
    return str(damaged(str(folder), "; ".join(problems), bad, index))


def build_index(sidecar_paths: list[Path], out_path: Path) -> dict:
    """Gather shard sidecars into index.json; checks every split is complete and consistent, and that each .bin holds
    the bytes its shard job wrote (never blessing a shard changed since)."""
    out_path = Path(out_path)
    sidecars = []
    for path in map(Path, sidecar_paths):
        sidecar = json.loads(path.read_text())
        sidecar["path"] = path.parent / sidecar["file"]
        sidecars.append(sidecar)
    if not sidecars:
        raise ValueError("build_index got no shard sidecars")

    shared = {}
    for key in ("dtype", "vocab_size", "eos_id", "pad_id"):
        values = {sidecar[key] for sidecar in sidecars}
        if len(values) > 1:
            raise ValueError(f"shards disagree on {key}: {sorted(values)} (built with different tokenizers?)")
        shared[key] = values.pop()
    itemsize = np.dtype(shared["dtype"]).itemsize

    splits = {}
    for split in sorted({sidecar["split"] for sidecar in sidecars}):
        shards = sorted((s for s in sidecars if s["split"] == split), key=lambda s: s["shard"])
        count = shards[0]["count"]
        if [s["shard"] for s in shards] != list(range(count)) or any(s["count"] != count for s in shards):
            raise ValueError(f"split {split}: expected shards 0..{count - 1}, got {[s['shard'] for s in shards]}")
        # hashlib releases the GIL: one shard per core
        with ThreadPoolExecutor(max_workers=max(1, min(len(shards), os.cpu_count() or 1))) as pool:
            found = pool.map(lambda s: shard_problem(s["path"], s, itemsize, "full", "its shard job"), shards)
            problems = [(s, problem) for s, problem in zip(shards, found) if problem]
        if problems:
            raise damaged(str(out_path.parent), "; ".join(problem for _, problem in problems),
                          [str(s["path"]) for s, _ in problems], str(out_path))
        splits[split] = {
            "tokens": sum(s["tokens"] for s in shards),
            "documents": sum(s["documents"] for s in shards),
            "text_bytes": sum(s["text_bytes"] for s in shards),
            "shards": [{"file": os.path.relpath(s["path"], out_path.parent), "tokens": s["tokens"],
                        "documents": s["documents"], "text_bytes": s["text_bytes"], "sha256": s["sha256"],
                        **({"sampled_sha256": s["sampled_sha256"]} if "sampled_sha256" in s else {})}
                       for s in shards],
        }
    index = {"format": INDEX_FORMAT, **shared, "splits": splits}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_path, json.dumps(index, indent=2) + "\n")
    log.info("index %s: %s", out_path, {split: entry["tokens"] for split, entry in splits.items()})
    return index


def served_product_problem(products: DataProducts, argv: list[str]) -> str | None:
    """Why this config's data cannot be served as it is, before any job runs (so that no failing job makes Snakemake
    delete a shared product's files): a tokenizer edited in place, or a shard whose bytes changed after its job
    (`changed_shard_problems`); None when neither. `argv`: Snakemake's command line, whose --forcerun/--forceall
    (products.command_line_forcing) may rebuild the damaged product, as the command these errors give does."""
    forcerun, forceall = command_line_forcing(argv)
    return (tokenizer_problem(products, forcerun, forceall)
            or changed_shard_problems(f"results/{products.shards}", products.index, forcerun, forceall))
