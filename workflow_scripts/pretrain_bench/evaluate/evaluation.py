"""Held-out evaluation of a checkpoint's HF export: loss, perplexity, bits per byte, eval speed, continuations.

Held-out tokens: `max_tokens // seq_len` packed val samples (see loader.PackedTokens), evenly spaced over the
split (sample k * num_samples // count for k < count), so the subset is deterministic and covers the whole split
rather than its first few documents. Every target token counts, end-of-text predictions included.

Bits per byte is tokenizer-independent: the summed loss in nats over the evaluated target tokens, divided by
ln 2 and by the UTF-8 bytes those tokens stand for. With a byte-level BPE every character of a token's string
stands for exactly one byte, so the byte count is exact; special tokens (end-of-text) stand for none. For other
tokenizers each token's decoded text is counted, which can be off by a byte at word boundaries
(`bits_per_byte_exact` says which).

Continuations: for each prompt a greedy one and a sampled one (temperature, top-k, torch seeded with
`generation.seed` before each prompt, so a prompt's sample does not depend on its place in the list; with a weak
model the samples of different prompts can therefore look alike).

eval/step<N>.json (one per checkpoint; the report reads it):
  loss, perplexity, bits_per_byte   mean nats per target token, exp(loss), nats / ln 2 / UTF-8 bytes
  tokens, bytes, samples            target tokens and the bytes they stand for; val samples evaluated
  eval_tokens_per_s, eval_time_s    forward + loss throughput and time (after one untimed warm-up batch)
  step, train_tokens, checkpoint    which checkpoint (train_tokens from its commit marker), its folder
  split ("val"), bits_per_byte_exact, seq_len, batch_size, sample_selection ("evenly spaced")
  device ("cpu" | "cuda:<id>"), precision, hardware (devices.hardware_description), export (the HF folder)
  generation                        {max_new_tokens, temperature, top_k, seed}
  generations                       [{prompt, mode: "greedy" | "sampled", text, new_tokens, stopped_at_eos}],
                                    prompts in config order, greedy before sampled; text excludes the prompt
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pretrain_bench.config.schema import default_field
from pretrain_bench.core.devices import GPU_LOCK_DIR, evaluation_device
from pretrain_bench.core.io import atomic_write_json
from pretrain_bench.core.logs import log_startup
from pretrain_bench.train.heldout import eval_sample_indices

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationSettings:
    """`evaluate.generation` of the config (meanings and defaults: schemas/config.schema.yaml)."""

    max_new_tokens: int = default_field("evaluate", "generation", "max_new_tokens")
    temperature: float = default_field("evaluate", "generation", "temperature")
    top_k: int = default_field("evaluate", "generation", "top_k")
    seed: int = default_field("evaluate", "generation", "seed")


@dataclass(frozen=True)
class EvalSettings:
    """The `evaluate:` block of the config that eval/step<N>.json depends on (meanings and defaults:
    schemas/config.schema.yaml)."""

    max_tokens: int = default_field("evaluate", "max_tokens")
    batch_size: int = default_field("evaluate", "batch_size")
    # evaluate.device null means train.device (the rule passes it); built in code, the same default applies
    device: str = default_field("train", "device")
    precision: str = default_field("evaluate", "precision")
    prompts: tuple[str, ...] = default_field("evaluate", "prompts")
    generation: GenerationSettings = field(default_factory=GenerationSettings)


def token_byte_lengths(tokenizer_dir: Path, vocab_size: int) -> np.ndarray:
    """UTF-8 bytes each token id stands for (0 for special tokens and ids beyond the tokenizer)."""
    return _token_byte_lengths(tokenizer_dir, vocab_size)[0]


def _token_byte_lengths(tokenizer_dir: Path, vocab_size: int) -> tuple[np.ndarray, bool]:
    """(bytes per token id, whether the counts are exact: byte-level BPE)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    lengths = np.zeros(vocab_size, dtype=np.int64)
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    spec = json.loads(tok.to_str())
    byte_level = "ByteLevel" in json.dumps(spec.get("pre_tokenizer"))
    for token, token_id in tok.get_vocab().items():
        if token_id >= vocab_size or token in special:
            continue
        lengths[token_id] = len(token) if byte_level else len(tok.decode([token_id]).encode("utf-8"))
    return lengths, byte_level


def _sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.no_grad()
def evaluate_model(model, data, byte_lengths: np.ndarray, *, max_tokens: int, batch_size: int) -> dict:
    """Loss over the evenly spaced samples of `data` (a PackedTokens) covering at most max_tokens target tokens.

    eval_tokens_per_s times the forward passes and the loss (device synchronised), after one untimed warm-up batch.
    """
    model.eval()
    device = next(model.parameters()).device
    indices = eval_sample_indices(data.num_samples, data.seq_len, max_tokens)
    batches = [indices[first:first + batch_size] for first in range(0, len(indices), batch_size)]

    def batch_nll(rows: np.ndarray) -> tuple[float, np.ndarray]:
        batch = torch.from_numpy(np.stack([data[int(k)] for k in rows])).to(device)  # (B, T+1)
        inputs, targets = batch[:, :-1], batch[:, 1:]  # (B, T) each
        logits = model(input_ids=inputs).logits.float()  # (B, T, vocab)
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
        return nll.item(), targets.cpu().numpy()

    batch_nll(batches[0])  # warm-up: first-call allocations and kernel selection stay out of the timing
    total_nll, total_tokens, total_bytes = 0.0, 0, 0
    start = _sync(device)
    for rows in batches:
        nll, targets = batch_nll(rows)
        total_nll += nll
        total_tokens += targets.size
        total_bytes += int(byte_lengths[targets].sum())
    elapsed = _sync(device) - start
    loss = total_nll / total_tokens
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_byte": total_nll / math.log(2) / total_bytes if total_bytes else None,
        "tokens": total_tokens,
        "bytes": total_bytes,
        "samples": len(indices),
        "eval_tokens_per_s": total_tokens / elapsed,
        "eval_time_s": elapsed,
    }


@torch.no_grad()
def generate_continuations(model, tokenizer, prompts, settings: GenerationSettings, *, seq_len: int) -> list[dict]:
    """A greedy and a sampled continuation of each prompt: [{prompt, mode, text, new_tokens, stopped_at_eos}]."""
    from transformers import GenerationConfig

    model.eval()
    device = next(model.parameters()).device
    modes = {
        "greedy": GenerationConfig(do_sample=False),
        "sampled": GenerationConfig(do_sample=True, temperature=settings.temperature, top_k=settings.top_k,
                                    top_p=1.0),
    }
    records = []
    for number, prompt in enumerate(prompts):
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids.to(device)  # (1, P)
        if ids.shape[1] == 0:
            raise ValueError(f"evaluate.prompts[{number}] is empty")
        if ids.shape[1] + settings.max_new_tokens > seq_len:
            raise ValueError(
                f"evaluate.prompts[{number}] is {ids.shape[1]} tokens; with evaluate.generation.max_new_tokens "
                f"{settings.max_new_tokens} it runs past model.seq_len {seq_len}, the context the model was trained on"
            )
        for mode, config in modes.items():
            config.update(max_new_tokens=settings.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id, use_cache=True)
            if mode == "sampled":
                torch.manual_seed(settings.seed)  # seeds CUDA too
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            new = out[0, ids.shape[1]:].tolist()
            records.append({
                "prompt": prompt, "mode": mode,
                "text": tokenizer.decode(new, skip_special_tokens=True),
                "new_tokens": len(new),
                "stopped_at_eos": bool(new) and new[-1] == tokenizer.eos_token_id,
            })
    return records


def supported_precision(precision: str, device: str) -> tuple[str, str | None]:
    """The precision a forward pass can use on `device`, and why it differs from the one asked for (or None).

    GPUs before Ampere (compute capability < 8) have no bf16 arithmetic: there bf16 falls back to fp16, which every
    CUDA GPU runs, and the result files say so. torch's check counts a bf16 tensor that can merely be created
    (emulated, many times slower) as support unless told not to."""
    if (precision == "bf16" and device.startswith("cuda")
            and not torch.cuda.is_bf16_supported(including_emulation=False)):
        name = torch.cuda.get_device_name(torch.device(device))
        return "fp16", f"evaluate.precision bf16 is not supported by {name}: evaluated in fp16"
    return precision, None


def load_export(export_dir: Path, device: str, precision: str):
    """(model, tokenizer) of an HF export, in eval mode on `device`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pretrain_bench.evaluate.export import torch_dtype

    model = AutoModelForCausalLM.from_pretrained(export_dir, local_files_only=True, dtype=torch_dtype(precision))
    tokenizer = AutoTokenizer.from_pretrained(export_dir, local_files_only=True)
    return model.to(device).eval(), tokenizer


@dataclass(frozen=True)
class LoadedExport:
    """An HF export loaded for evaluation: what the held-out evaluation and lm-eval both run on."""

    folder: Path
    model: object
    tokenizer: object
    device: str  # "cpu" | "cuda:<index>"
    precision: str  # the one used (supported_precision)
    precision_note: str | None


@contextlib.contextmanager
def loaded_export(export_dir: Path, device: str, precision: str, lock_dir: Path = GPU_LOCK_DIR):
    """The export loaded with AutoModelForCausalLM on the evaluation device (holding its GPU slot) for the block."""
    with evaluation_device(device, lock_dir) as run_device:
        precision, precision_note = supported_precision(precision, run_device)
        if precision_note:
            log.warning(precision_note)
        model, tokenizer = load_export(Path(export_dir), run_device, precision)
        yield LoadedExport(Path(export_dir), model, tokenizer, run_device, precision, precision_note)


def evaluate_export(export_dir: Path, index_path: Path, out_path: Path, settings: EvalSettings, *,
                    lock_dir: Path = GPU_LOCK_DIR, loaded: LoadedExport | None = None,
                    export_name: Path | None = None) -> dict:
    """Evaluate the HF export of one checkpoint on the val shards; writes eval/step<N>.json atomically.

    loaded: the export already loaded (loaded_export) by the caller, which then also holds its device slot.
    export_name: the export's path as the result names it, where `export_dir` is where it is staged."""
    from pretrain_bench.core.devices import hardware_description
    from pretrain_bench.data.loader import PackedTokens
    from pretrain_bench.evaluate.export import read_export_info

    info = read_export_info(export_dir)
    seq_len = info["seq_len"]
    data = PackedTokens(Path(index_path), "val", seq_len)
    with (contextlib.nullcontext(loaded) if loaded is not None
          else loaded_export(export_dir, settings.device, settings.precision, lock_dir)) as loaded:
        model, tokenizer = loaded.model, loaded.tokenizer
        byte_lengths, exact = _token_byte_lengths(Path(export_dir), model.config.vocab_size)
        log_startup("first token evaluated")
        result = evaluate_model(model, data, byte_lengths, max_tokens=settings.max_tokens,
                                batch_size=settings.batch_size)
        generations = generate_continuations(model, tokenizer, settings.prompts, settings.generation,
                                             seq_len=seq_len)
        hardware = hardware_description(torch.device(loaded.device).type)
    result.update(
        step=info["step"], train_tokens=info["train_tokens"], checkpoint=info["checkpoint"], split="val",
        bits_per_byte_exact=exact, seq_len=seq_len, batch_size=settings.batch_size,
        sample_selection="evenly spaced", device=loaded.device, precision=loaded.precision,
        precision_note=loaded.precision_note, hardware=hardware,
        export=str(export_name or export_dir), generation=asdict(settings.generation), generations=generations,
    )
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_path, result)
    return result
