"""HF export: a committed DeepSpeed checkpoint as a `transformers` model folder (safetensors + tokenizer)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from . import checkpoint as ckpt


def export_hf(ckpt_root: Path, step: int, shape, seq_len: int, tokenizer_dir: Path, target: Path) -> None:
    """Save a checkpoint as an HF model folder (safetensors + tokenizer) that AutoModelForCausalLM loads."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from .model import llama_config

    state = ckpt.load_fp32_state_dict(ckpt_root, step)
    model = LlamaForCausalLM(llama_config(shape, seq_len))
    if shape.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (shape.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ckpt.CheckpointError(f"checkpoint step {step} in {ckpt_root} does not match the model: "
                                   f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True).save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
