"""HF export: a committed DeepSpeed checkpoint as a `transformers` model folder (safetensors + tokenizer).

The folder loads with `AutoModelForCausalLM.from_pretrained(dir, local_files_only=True)` and `AutoTokenizer`.
Its weights are the checkpoint's fp32 master weights (for ZeRO 1-3 gathered from every rank's optimizer shards by
DeepSpeed's zero_to_fp32), cast to `dtype`; its config names the tokenizer's end-of-text and padding ids so that
`generate` stops where the training stream separated documents; generation_config.json carries the same ids.
`pretrain_bench_export.json` beside the weights says which checkpoint it came from, and README.md (the model card)
what the model is, its data with their sha256, its held-out loss when known, the pipeline's commit and the lm-eval
command that scores it. Exporting only reads the checkpoint. The fp32 export is the consolidated state DeepSpeed's
zero_to_fp32.py would write, tied embeddings stored once (docs/export.md).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from pretrain_bench.train.checkpoints import files as ckpt

EXPORT_INFO = "pretrain_bench_export.json"
DTYPES = ("fp32", "bf16", "fp16")


def torch_dtype(name: str):
    """fp32 | bf16 | fp16 → the torch dtype."""
    import torch

    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {list(DTYPES)}")
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def read_checkpoint_weights(ckpt_root: Path, step: int, dtype: str = "fp32", keep_fp32=None) -> dict:
    """The weights of committed checkpoint `step` cast to `dtype` (but those `keep_fp32(name)` names, which stay
    float32); any failure names the checkpoint folder."""
    from pretrain_bench.train.checkpoints.checkpointer import load_fp32_state_dict

    folder = Path(ckpt_root) / ckpt.tag_for(step)
    ckpt.read_marker(ckpt_root, step)  # missing or uncommitted: CheckpointError naming the folder
    try:
        return cast_state_dict(load_fp32_state_dict(ckpt_root, step, lazy=True), torch_dtype(dtype), keep_fp32)
    except ckpt.CheckpointError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError, AssertionError) as error:
        # e.g. a rank's optimizer shard missing from a copied checkpoint: DeepSpeed's own message is kept.
        raise ckpt.CheckpointError(f"checkpoint {folder} is incomplete or unreadable: "
                                   f"{type(error).__name__}: {error}") from error


def cast_state_dict(state: dict, dtype, keep_fp32=None) -> dict:
    """The floating-point tensors of `state` in `dtype` (others, and those whose name `keep_fp32(name)` accepts, as
    they are), converted one at a time and removed
    from `state` as they go: the peak is the cast copy plus one source tensor (one ZeRO-3 parameter gathered from its
    partitions, or one tensor of a mapped file), not the whole fp32 dict beside its 16-bit copy. Names that share
    one tensor (tied weights, DeepSpeed's shared parameters) share the cast one."""
    names_by_tensor: dict[int, list[str]] = {}
    for name, tensor in state.items():  # every tensor is alive here, so id() is unique
        names_by_tensor.setdefault(id(tensor), []).append(name)
    cast = {}
    for names in names_by_tensor.values():
        source = state.pop(names[0])
        for other in names[1:]:
            state.pop(other)
        tensor = source.contiguous()  # a GatheredTensor concatenates its partitions here
        del source
        kept = keep_fp32 is not None and any(keep_fp32(name) for name in names)
        converted = tensor.to(dtype) if tensor.is_floating_point() and not kept else tensor
        del tensor  # the fp32 original is freed before the next one is read
        cast.update(dict.fromkeys(names, converted))
    return cast


def export_hf(ckpt_root: Path, step: int, shape, seq_len: int, tokenizer_dir: Path, target: Path, *,
              dtype: str = "fp32", info: dict | None = None, plan=None, publish: bool = True) -> Path:
    """Save checkpoint `step` as an HF model folder at `target` (replaced atomically); returns target.

    With the run's `plan` the folder also gets its model card (README.md, see model_card.py). `publish=False` leaves
    the finished folder at staged_path(target) (its files name `target`) for the caller to move there with
    os.replace, and returns that path."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig
    from transformers.initialization import no_init_weights

    from pretrain_bench.train.models.registry import model_family

    target = Path(target)
    family = model_family(shape)
    state = read_checkpoint_weights(ckpt_root, step, dtype, family.keeps_fp32)
    if shape.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    # No weights of its own: the meta device allocates nothing, and assign=True takes the cast tensors as they are.
    with no_init_weights(), torch.device("meta"):
        model = family.hf_class(shape)(family.hf_config(shape, seq_len))
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    del state
    missing = [k for k in missing if not (shape.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ckpt.CheckpointError(f"checkpoint {Path(ckpt_root) / ckpt.tag_for(step)} does not match the model: "
                                   f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()  # assign=True replaced the embedding Parameter: point the tied head at it again
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    # LlamaConfig's default ids (bos 1, eos 2) are not this tokenizer's: generate() would stop on a random token.
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.config, key, getattr(tokenizer, key))
    model.config.use_cache = True  # training turns the KV cache off; inference wants it
    model.generation_config = GenerationConfig.from_model_config(model.config)

    tmp = staged_path(target)
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    marker = ckpt.read_marker(ckpt_root, step)
    description = {"step": step, "train_tokens": marker.get("tokens"), "dtype": dtype, "seq_len": seq_len,
                   "checkpoint": str(Path(ckpt_root) / ckpt.tag_for(step)), **(info or {})}
    (tmp / EXPORT_INFO).write_text(json.dumps(description, indent=2))
    if plan is not None:
        from pretrain_bench.evaluate.model_card import card_facts, render_card

        facts = card_facts(plan, step, marker.get("tokens"), export=str(target))
        (tmp / "README.md").write_text(render_card(shape, facts, dtype))
    if not publish:
        return tmp
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


def staged_path(target: Path) -> Path:
    """Where an export (or a result file) is written before it is moved to `target` in one rename."""
    return Path(target).with_name(Path(target).name + ".tmp")


def export_checkpoint(plan, step: int, target: Path, *, dtype: str = "fp32", publish: bool = True) -> dict:
    """Export checkpoint `step` of the run described by plan (plan.json) to `target`; returns its description.
    `publish=False`: left at staged_path(target), see export_hf."""
    from pretrain_bench.core.logs import log_startup
    from pretrain_bench.train.plan import plan_shape

    log_startup("first work")

    index = json.loads(Path(plan.paths.index).read_text())
    shape = plan_shape(plan, index["vocab_size"])
    root = Path(plan.paths.state_dir) / "checkpoints"
    export_hf(root, step, shape, plan.model.seq_len, Path(plan.paths.tokenizer), Path(target),
              dtype=dtype, info={"model": plan.model.as_dict(), "run": plan.name}, plan=plan, publish=publish)
    return read_export_info(target if publish else staged_path(target))


def read_export_info(export_dir: Path) -> dict:
    path = Path(export_dir) / EXPORT_INFO
    if not path.is_file():
        raise FileNotFoundError(f"{export_dir} is not a pretrain-bench export (no {EXPORT_INFO})")
    return json.loads(path.read_text())
