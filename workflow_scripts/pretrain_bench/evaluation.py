"""Held-out evaluation of a checkpoint: loss, perplexity and bits per byte on the val shards.

Bits per byte is tokenizer-independent: the summed loss in nats over the evaluated target tokens, divided by
ln 2 and by the UTF-8 bytes those tokens stand for. With a byte-level BPE every character of a token's string
stands for exactly one byte, so the byte count is exact; special tokens (end-of-text) stand for none.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


def token_byte_lengths(tokenizer_dir: Path, vocab_size: int) -> np.ndarray:
    """UTF-8 bytes each token id stands for (0 for special tokens and ids beyond the tokenizer)."""
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
    return lengths


@torch.no_grad()
def evaluate_model(model, data, byte_lengths: np.ndarray, *, max_tokens: int, batch_size: int) -> dict:
    """Loss over the first samples of `data` (a PackedTokens) covering at most max_tokens target tokens."""
    model.eval()
    seq_len = data[0].shape[0] - 1
    samples = min(data.num_samples, max(1, max_tokens // seq_len))
    total_nll, total_tokens, total_bytes = 0.0, 0, 0
    start = time.perf_counter()
    for first in range(0, samples, batch_size):
        batch = torch.from_numpy(np.stack([data[k] for k in range(first, min(first + batch_size, samples))]))
        inputs, targets = batch[:, :-1], batch[:, 1:]  # (B, T) each
        logits = model(input_ids=inputs).logits.float()  # (B, T, vocab)
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
        total_nll += nll.item()
        total_tokens += targets.numel()
        total_bytes += int(byte_lengths[targets.numpy()].sum())
    elapsed = time.perf_counter() - start
    loss = total_nll / total_tokens
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_byte": total_nll / math.log(2) / total_bytes if total_bytes else None,
        "tokens": total_tokens,
        "bytes": total_bytes,
        "samples": samples,
        "eval_tokens_per_s": total_tokens / elapsed,
    }


def evaluate_checkpoint(plan: dict, step: int, out_path: Path, *, max_tokens: int, batch_size: int) -> dict:
    """Evaluate committed checkpoint `step` of the run described by plan; writes eval/step<N>.json atomically."""
    from transformers import LlamaForCausalLM

    from . import checkpoint as ckpt
    from .loader import PackedTokens
    from .model import llama_config, resolve_shape

    index = json.loads(Path(plan["paths"]["index"]).read_text())
    root = Path(plan["paths"]["state_dir"]) / "checkpoints"
    marker = ckpt.read_marker(root, step)  # names the path when missing or incomplete
    shape = resolve_shape(plan["model"]["preset"], plan["model"].get("overrides"), index["vocab_size"])
    seq_len = plan["model"]["seq_len"]
    model = LlamaForCausalLM(llama_config(shape, seq_len))
    state = ckpt.load_fp32_state_dict(root, step)
    if shape.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model.load_state_dict(state, strict=not shape.tie_word_embeddings)
    data = PackedTokens(Path(plan["paths"]["index"]), "val", seq_len)
    result = evaluate_model(model, data, token_byte_lengths(Path(plan["paths"]["tokenizer"]), shape.vocab_size),
                            max_tokens=max_tokens, batch_size=batch_size)
    result.update(step=step, train_tokens=marker.get("tokens"), checkpoint=str(root / ckpt.tag_for(step)),
                  split="val")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(out_path)
    return result
