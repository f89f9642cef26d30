"""The tokenizer: train a byte-level BPE on the train split, or adopt an existing one, and save an HF folder.

Training sample: the train jsonl is cut into `SAMPLE_WINDOWS` evenly spaced byte windows that together span
`train_bytes` bytes (the whole file when it is smaller); every document whose line starts inside a window is used
whole. Deterministic from the file alone, O(train_bytes) reads however large the corpus is, and spread over all
sources (the corpus concatenates its sources in order, so a plain prefix would see only the first source).
Window sizes count JSON bytes, so the text sampled is `train_bytes` give or take escaping and the documents that
run past a window's end.

The corpus jsonl reader lives here because training and sharding (`shards.py`) stream the same files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import orjson
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pretrain_bench.core.io import atomic_write_text
from pretrain_bench.core.progress import Progress, heartbeat

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SAMPLE_WINDOWS = 64
# End-of-text names of widely used tokenizers, tried in order for a bare tokenizer.json (it names no eos_token).
# What the tokenizer job wrote: {file name: sha256} of the files that make a tokenizer (TOKENIZER_FILES), beside them.
WRITTEN_RECORD = ".written.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
KNOWN_EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<｜end▁of▁sentence｜>")


def iter_texts(jsonl: Path, start: int = 0, stop: int | None = None) -> Iterator[str]:
    """Texts of the documents whose lines start at a byte offset in [start, stop), streamed in file order.

    Assigning a line to the range holding its first byte lets byte ranges that tile the file split its documents
    into disjoint, complete slices without a counting pass. Blank lines are skipped.
    """
    with open(jsonl, "rb") as f:
        if start > 0:
            # Back up one byte: if start is a line start this reads just the preceding "\n"; otherwise it skips the
            # rest of the line in progress, which belongs to the previous range.
            f.seek(start - 1)
            position = start - 1 + len(f.readline())
        else:
            position = 0
        for line in f:
            if stop is not None and position >= stop:
                return
            line_start, position = position, position + len(line)
            if not line.strip():
                continue
            try:
                text = orjson.loads(line)["text"]  # about 1.8x json.loads on these lines
            except (ValueError, KeyError, TypeError) as error:
                message = f"{jsonl}: line at byte {line_start} is not a JSON object with a 'text' field"
                raise ValueError(message) from error
            if not isinstance(text, str):
                raise ValueError(f"{jsonl}: line at byte {line_start} has a non-string 'text'")
            yield text


def sample_windows(file_size: int, train_bytes: int, windows: int = SAMPLE_WINDOWS) -> list[tuple[int, int]]:
    """Byte ranges [start, stop) of the training sample: `windows` evenly spaced, `train_bytes` long in total."""
    if file_size <= train_bytes:
        return [(0, file_size)]
    width = max(1, train_bytes // windows)
    return [(file_size * i // windows, file_size * i // windows + width) for i in range(windows)]


def _counted(texts: list[str], total_bytes: int):
    """`texts`, logging how far the trainer's first pass (pre-tokenizing and counting words) has read, with rate and
    ETA; its merges follow, under train_tokenizer's heartbeat."""
    progress = Progress("BPE word counts (sample bytes)", log, total=total_bytes)
    for text in texts:
        progress.advance(len(text.encode("utf-8", "surrogatepass")))
        yield text
    progress.finish()


def train_bpe(texts, vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2 style) trained on `texts`, with EOS_TOKEN and PAD_TOKEN as special tokens (ids 0, 1).

    No prefix space and no normalizer, so decode(encode(text)) == text for any string, indentation included.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        # all 256 bytes, seen or not, so no input can ever be out of vocabulary
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def _token_content(value) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict with 'content'."""
    return value.get("content") if isinstance(value, dict) else value


def _read_config(folder: Path) -> dict:
    config_path = folder / "tokenizer_config.json"
    return json.loads(config_path.read_text()) if config_path.is_file() else {}


def resolve_special_tokens(tokenizer: Tokenizer, tokenizer_config: dict, source: Path) -> dict:
    """{'eos', 'pad', 'bos'} names from an HF tokenizer config, falling back to KNOWN_EOS_TOKENS for EOS.

    Raises ValueError naming `source` when no end-of-text token exists: documents could not be separated.
    """
    eos = _token_content(tokenizer_config.get("eos_token"))
    if eos is None:
        eos = next((name for name in KNOWN_EOS_TOKENS if tokenizer.token_to_id(name) is not None), None)
    if eos is None or tokenizer.token_to_id(eos) is None:
        raise ValueError(
            f"tokenizer {source} has no end-of-text token (no eos_token in tokenizer_config.json and none of "
            f"{', '.join(KNOWN_EOS_TOKENS)} in its vocabulary); shards need one to separate documents"
        )
    pad = _token_content(tokenizer_config.get("pad_token"))
    if pad is not None and tokenizer.token_to_id(pad) is None:
        pad = None
    bos = _token_content(tokenizer_config.get("bos_token"))
    if bos is not None and tokenizer.token_to_id(bos) is None:
        bos = None
    return {"eos": eos, "pad": pad, "bos": bos}


def read_tokenizer_file(path: Path) -> Tokenizer:
    """`Tokenizer.from_file`, with an error that names the file and says what it must hold: the library's own error
    for valid JSON of another kind is serde's bare "expected `,` or `}` at line 1 column 9"."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {path} does not exist")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises a plain Exception
        raise ValueError(
            f"{path} is not a tokenizer file ({error}): a tokenizer.json is the JSON object that the `tokenizers` "
            "library's Tokenizer.save (or a Hugging Face fast tokenizer's save_pretrained) writes, with the keys "
            '"version", "model" (type, vocab and merges), "added_tokens", "normalizer", "pre_tokenizer", '
            '"post_processor" and "decoder"') from error


def adopt_tokenizer(path: Path) -> tuple[Tokenizer, dict]:
    """An existing tokenizer.json file or HF tokenizer folder (which must hold a tokenizer.json) and its specials.

    A missing pad token is added as PAD_TOKEN rather than reusing EOS, so masking padding never masks an EOS.
    """
    path = Path(path)
    if path.is_dir():
        tokenizer_file, config = path / "tokenizer.json", _read_config(path)
        if not tokenizer_file.is_file():
            raise ValueError(f"tokenizer folder {path} has no tokenizer.json (only fast tokenizers can be adopted)")
    elif path.is_file():
        tokenizer_file, config = path, {}
    else:
        raise FileNotFoundError(f"tokenizer.path {path} does not exist")
    tokenizer = read_tokenizer_file(tokenizer_file)
    specials = resolve_special_tokens(tokenizer, config, path)
    if specials["pad"] is None:
        tokenizer.add_special_tokens([PAD_TOKEN])
        specials["pad"] = PAD_TOKEN
    return tokenizer, specials


def tokenizer_info(tokenizer: Tokenizer, specials: dict) -> dict:
    """vocab_size (embedding rows needed: largest id + 1, added tokens included), eos_id, pad_id and names."""
    vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
    return {
        "vocab_size": vocab_size,
        "eos_id": tokenizer.token_to_id(specials["eos"]),
        "pad_id": tokenizer.token_to_id(specials["pad"]),
        "eos_token": specials["eos"],
        "pad_token": specials["pad"],
    }


def load_tokenizer(folder: Path) -> tuple[Tokenizer, dict]:
    """The `tokenizers.Tokenizer` of a folder written by `train_tokenizer`, and its `tokenizer_info`."""
    folder = Path(folder)
    tokenizer = read_tokenizer_file(folder / "tokenizer.json")
    specials = resolve_special_tokens(tokenizer, _read_config(folder), folder)
    if specials["pad"] is None:
        raise ValueError(f"tokenizer {folder} names no pad_token in tokenizer_config.json")
    return tokenizer, tokenizer_info(tokenizer, specials)


def save_hf_folder(tokenizer: Tokenizer, specials: dict, out_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json loadable by AutoTokenizer/PreTrainedTokenizerFast, each file atomic,
    and the sha256 of what was written (products.WRITTEN_RECORD), which tells a later edit from the product."""
    # transformers takes ~2 s to import; only this function needs it, the shard jobs never do.
    from transformers import PreTrainedTokenizerFast

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=specials["eos"],
        bos_token=specials["bos"] or specials["eos"],  # GPT-2 convention; shards never prepend it
        pad_token=specials["pad"],
        clean_up_tokenization_spaces=False,  # transformers 4 cleans " ." to "." by default: no exact round trip
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = out_dir / f".staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    hf_tokenizer.save_pretrained(staging)
    written = written_digests(staging)  # of the files as written, before anything else can reach them
    (out_dir / WRITTEN_RECORD).unlink(missing_ok=True)  # no record names files being replaced
    for file in sorted(staging.iterdir()):
        os.replace(file, out_dir / file.name)
    staging.rmdir()
    atomic_write_text(out_dir / WRITTEN_RECORD, json.dumps(written, indent=2) + "\n")


def adopted_tokenizer_path(path: str | None, init_from: str | None) -> str | None:
    """The tokenizer the tokenizer stage adopts: tokenizer.path (`path`), else model.init_from's own (a continued
    model must keep the token ids it was trained with), else None (train a BPE)."""
    if path or not init_from:
        return path or None
    from pretrain_bench.data.init_from import InitFromError, init_from_folder

    folder = init_from_folder(init_from, weights=False)
    if not (folder / "tokenizer.json").is_file():
        raise InitFromError(f"model.init_from {init_from} has no tokenizer.json (only fast tokenizers are adopted): "
                         "set tokenizer.path to the tokenizer it was trained with")
    return str(folder)


def train_tokenizer(train_jsonl: Path, out_dir: Path, *, vocab_size: int, train_bytes: int,
                    path: str | None = None) -> dict:
    """Train a byte-level BPE on a sample of `train_jsonl` (or adopt `path`) and save it to `out_dir`.

    Returns `tokenizer_info` plus where it came from: 'source' ('trained' or the adopted path) and, when trained,
    the sample's documents and text bytes.
    """
    train_jsonl, out_dir = Path(train_jsonl), Path(out_dir)
    if path:
        tokenizer, specials = adopt_tokenizer(Path(path))
        extra = {"source": str(path)}
    else:
        windows = sample_windows(train_jsonl.stat().st_size, train_bytes)
        sample = [text for start, stop in windows for text in iter_texts(train_jsonl, start, stop)]
        if not sample:
            raise ValueError(f"{train_jsonl} holds no documents to train the tokenizer on")
        with heartbeat(f"BPE training ({vocab_size:,} tokens)", log):
            tokenizer = train_bpe(_counted(sample, sum(stop - start for start, stop in windows)), vocab_size)
        specials = {"eos": EOS_TOKEN, "pad": PAD_TOKEN, "bos": None}
        extra = {"source": "trained", "train_documents": len(sample),
                 "train_text_bytes": sum(len(text.encode("utf-8", "surrogatepass")) for text in sample)}
    save_hf_folder(tokenizer, specials, out_dir)
    info = {**tokenizer_info(tokenizer, specials), **extra}
    log.info("tokenizer saved to %s: %s", out_dir, info)
    return info


def tokenizer_content_key(path: str | Path) -> str | None:
    """What decides the token ids a tokenizer gives, as a sha256: its tokenizer.json's bytes and the special tokens
    its tokenizer_config.json names (the file's other keys, which exports rewrite, do not change an id). `path`: an
    HF tokenizer folder or a bare tokenizer.json; None when there is no such local file."""
    path = Path(str(path).removeprefix("file://"))
    folder, file = (path, path / "tokenizer.json") if path.is_dir() else (None, path)
    if not file.is_file():
        return None
    tokenizer_config = {}
    if folder is not None and (folder / "tokenizer_config.json").is_file():
        try:
            tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
        except ValueError:
            tokenizer_config = {}  # adopt_tokenizer names the file when it reads it
    specials = {key: _token_content(tokenizer_config.get(key)) for key in ("eos_token", "pad_token", "bos_token")}
    digest = hashlib.sha256(file.read_bytes())
    digest.update(json.dumps(specials, sort_keys=True).encode())
    return digest.hexdigest()


def written_digests(folder: Path) -> dict:
    """{file name: sha256} of the TOKENIZER_FILES in a tokenizer folder (those present)."""
    return {name: hashlib.sha256((Path(folder) / name).read_bytes()).hexdigest()
            for name in TOKENIZER_FILES if (Path(folder) / name).is_file()}
