"""Token shards: each `shard_tokens` job encodes one contiguous slice of a split into a flat .bin; `index_shards`
gathers their sidecars into index.json.

Slices are byte ranges of the split's jsonl (shard i of n covers [size*i//n, size*(i+1)//n), a document belonging to
the range its line starts in), so a job needs neither a counting pass nor the whole corpus in memory, and slices
are balanced by bytes, which is what encoding time follows. The .bin is the raw token stream, every document
followed by EOS, readable with `np.memmap(path, dtype)`; same inputs give byte-identical files.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from pretrain_bench.core.io import atomic_write_text, disk_full
from pretrain_bench.core.progress import Progress
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

    digest, tokens, documents, text_bytes = hashlib.sha256(), 0, 0, 0
    # Progress counts text bytes against the slice's jsonl bytes: JSON escaping makes the slice somewhat larger than
    # its text, so the share shown ends a little below 100 % and the ETA errs long.
    progress = Progress(f"{split} shard {index}/{count}", log, total=stop - start)
    out_bin.parent.mkdir(parents=True, exist_ok=True)
    tmp_bin = out_bin.with_name(f"{out_bin.name}.tmp-{os.getpid()}")
    try:
        with open(tmp_bin, "wb") as f:
            texts = iter_texts(corpus_jsonl, start, stop)
            for batch, encodings in _encoded_batches(texts, encode_batch, batch_bytes):
                # numpy raises OverflowError rather than wrap should an id not fit the dtype
                pieces = [piece for encoding in encodings for piece in (np.array(encoding.ids, dtype=dtype), eos)]
                ids = np.concatenate(pieces)  # (tokens in batch,)
                f.write(memoryview(ids))
                digest.update(memoryview(ids))
                tokens += ids.size
                documents += len(batch)
                batch_text_bytes = sum(len(text.encode("utf-8", "surrogatepass")) for text in batch)
                text_bytes += batch_text_bytes
                # the lambda reads the running counts when the progress line is written, which is what it should show
                progress.advance(batch_text_bytes, lambda: f"{documents:,} documents, {tokens:,} tokens")  # noqa: B023
        os.replace(tmp_bin, out_bin)
    except OSError as error:
        tmp_bin.unlink(missing_ok=True)  # Snakemake removes a failed job's outputs, not our temporary file
        if error.errno != errno.ENOSPC:
            raise
        # the whole shard's size (its partial file is removed), estimated from the share of its slice encoded so far
        written, done = tokens * dtype.itemsize, min(1.0, text_bytes / max(stop - start, 1))
        raise disk_full(out_bin, int(written / done) if written and done else None) from error
    except BaseException:
        tmp_bin.unlink(missing_ok=True)
        raise

    sidecar = {
        "split": split, "shard": index, "count": count, "file": out_bin.name,
        "tokens": tokens, "documents": documents, "text_bytes": text_bytes, "sha256": digest.hexdigest(),
        "dtype": dtype.name, "vocab_size": info["vocab_size"], "eos_id": info["eos_id"], "pad_id": info["pad_id"],
        "byte_range": [start, stop],
    }
    atomic_write_text(out_json, json.dumps(sidecar, indent=2) + "\n")
    log.info("%s shard %d/%d: %d documents, %d tokens -> %s", split, index, count, documents, tokens, out_bin)
    return sidecar


def build_index(sidecar_paths: list[Path], out_path: Path) -> dict:
    """Gather shard sidecars into index.json; checks every split is complete and consistent, and each .bin's size."""
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
        for s in shards:
            size = s["path"].stat().st_size
            if size != s["tokens"] * itemsize:
                raise ValueError(f"{s['path']} holds {size} bytes, its sidecar says {s['tokens']} x {itemsize}")
        splits[split] = {
            "tokens": sum(s["tokens"] for s in shards),
            "documents": sum(s["documents"] for s in shards),
            "text_bytes": sum(s["text_bytes"] for s in shards),
            "shards": [{"file": os.path.relpath(s["path"], out_path.parent), "tokens": s["tokens"],
                        "documents": s["documents"], "text_bytes": s["text_bytes"], "sha256": s["sha256"]}
                       for s in shards],
        }
    index = {"format": INDEX_FORMAT, **shared, "splits": splits}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_path, json.dumps(index, indent=2) + "\n")
    log.info("index %s: %s", out_path, {split: entry["tokens"] for split, entry in splits.items()})
    return index
