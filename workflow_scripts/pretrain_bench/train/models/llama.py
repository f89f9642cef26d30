"""Model shapes (LLaMA architecture via `transformers`) and parameter counting.

Presets name real shapes: `deepseek-7b` is DeepSeek-LLM-7B-Base (30 layers, hidden 4096, 32 heads, FFN 11008,
vocab 102400); `llama-1b` follows TinyLlama-1.1B; `llama-125m` a GPT-3-small-sized LLaMA; `tiny` a few million
parameters for CPU runs. `model.init_from` takes the shape (and the weights) of an HF LLaMA model folder instead.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from pretrain_bench.config.schema import ModelSettings
from pretrain_bench.data.init_from import InitFromError, init_from_folder
from pretrain_bench.train.models import flops
from pretrain_bench.train.models.family import ModelFamily, preset_with_overrides


@dataclass(frozen=True)
class ModelShape:
    """Shape of a LLaMA-architecture causal LM."""

    num_hidden_layers: int  # transformer blocks (L)
    hidden_size: int  # model width (H)
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # key/value heads (grouped-query attention when < query heads)
    intermediate_size: int  # SwiGLU FFN width
    vocab_size: int | None  # None: take the tokenizer's vocabulary size
    rope_theta: float = 10000.0  # rotary embedding base
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    tie_word_embeddings: bool = False  # share input embedding and LM head
    extra: dict = field(default_factory=dict)  # any other LlamaConfig field from model.overrides


PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(4, 192, 6, 6, 512, None, tie_word_embeddings=True),
    "llama-125m": ModelShape(12, 768, 12, 12, 2048, 32000),
    "llama-1b": ModelShape(22, 2048, 32, 4, 5632, 32000),
    "deepseek-7b": ModelShape(30, 4096, 32, 32, 11008, 102400),
}


def resolve_shape(preset: str, overrides: dict | None = None, tokenizer_vocab: int | None = None) -> ModelShape:
    """Preset + overrides; the vocabulary is the preset's, or the tokenizer's when the preset leaves it open."""
    shape = preset_with_overrides(PRESETS, preset, overrides, tokenizer_vocab)
    if shape.hidden_size % shape.num_attention_heads:
        raise ValueError(
            f"model: hidden_size {shape.hidden_size} is not divisible by num_attention_heads "
            f"{shape.num_attention_heads}"
        )
    if shape.num_attention_heads % shape.num_key_value_heads:
        raise ValueError(
            f"model: num_attention_heads {shape.num_attention_heads} is not divisible by num_key_value_heads "
            f"{shape.num_key_value_heads}"
        )
    return shape


def count_parameters(shape: ModelShape) -> dict[str, int]:
    """Exact parameter count of `LlamaForCausalLM` with this shape (no bias terms), without building it."""
    h, v, f = shape.hidden_size, shape.vocab_size, shape.intermediate_size
    head_dim = h // shape.num_attention_heads
    kv = shape.num_key_value_heads * head_dim
    attention = h * h + 2 * h * kv + h * h  # q, k, v, o projections
    mlp = 3 * h * f  # gate, up, down (SwiGLU)
    norms = 2 * h
    per_layer = attention + mlp + norms
    embedding = v * h
    head = 0 if shape.tie_word_embeddings else v * h
    total = shape.num_hidden_layers * per_layer + embedding + head + h  # + final norm
    # Parameters that take part in a matmul per token: everything but the input embedding lookup, plus the LM
    # head even when it shares the embedding's weights (it is still a vocab × hidden matmul).
    matmul = total - embedding + (embedding if shape.tie_word_embeddings else 0)
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding, "per_layer": per_layer,
            "matmul": matmul}


def llama_config(shape: ModelShape, seq_len: int, attn_implementation: str | None = None):
    """A `transformers.LlamaConfig` for this shape; `attn_implementation` (model.attn_implementation) picks the
    attention kernel (None: transformers' own choice, which the saved config.json never records)."""
    from transformers import LlamaConfig

    kwargs = {k: v for k, v in asdict(shape).items() if k != "extra"}
    kwargs.update(shape.extra)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    return LlamaConfig(max_position_embeddings=max(seq_len, 2048), use_cache=False, **kwargs)


TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def build_model(shape: ModelShape, seq_len: int, seed: int, precision: str = "fp32", device: str = "cpu",
                attn_implementation: str | None = None, implementation: str = "transformers"):
    """A freshly initialised `LlamaForCausalLM` (model.implementation transformers) or its native twin
    (native_llama.NativeLlamaForCausalLM: same state dict and, for a seed, the same weights, without importing
    transformers), built directly on `device` in the training precision, with the attention kernel of
    model.attn_implementation (None: transformers' default).

    One copy of the weights in the dtype training uses, where training uses it: a 7B model on 3 CUDA ranks needs no
    host RAM to be built (an fp32 build on the host first took 4Ψ bytes per rank), and a CPU rank holds 2Ψ in
    bf16 instead of 4Ψ + 2Ψ while DeepSpeed casts. Initialisation draws from the seeded generator of that device.
    """
    import torch

    dtype = getattr(torch, TORCH_DTYPES[precision])
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = _new_model(shape, seq_len, attn_implementation, implementation)
    finally:
        torch.set_default_dtype(previous)
    return model


# What a rank imports to build the model of each model.implementation, and to compile it (train.compile: dynamo, and
# inductor, which loads at the first compilation): imported once in torchrun's agent before it forks CPU ranks
# (model_libraries, forked_ranks.preload). Measured on 2 cores: transformers' LLaMA 3.4 CPU-s, inductor 1.4 CPU-s.
MODEL_LIBRARIES = {"native": ("pretrain_bench.train.models.native_llama",),
                   "transformers": ("transformers.models.llama.modeling_llama",)}
COMPILER_LIBRARIES = ("torch._dynamo", "torch._inductor.compile_fx")


def model_libraries(implementation: str, compile: bool) -> tuple[str, ...]:
    """The modules a rank imports to build the model class of model.implementation (and with train.compile, to
    compile it). A rank that compiles nothing never imports the compiler (test_engine checks it)."""
    return MODEL_LIBRARIES[implementation] + (COMPILER_LIBRARIES if compile else ())


def _new_model(shape: ModelShape, seq_len: int, attn_implementation: str | None, implementation: str):
    """The model class of model.implementation, constructed (and initialised) in the current device and dtype."""
    if implementation == "native":
        from pretrain_bench.train.models.native_llama import NativeLlamaForCausalLM

        return NativeLlamaForCausalLM(shape, attn_implementation)
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config(shape, seq_len, attn_implementation))


# LlamaConfig fields a ModelShape carries directly; other fields the weights depend on are refused, not ignored.
_SHAPE_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "vocab_size", "rms_norm_eps", "tie_word_embeddings")


def shape_from_hf_config(folder: Path) -> ModelShape:
    """The ModelShape of an HF LLaMA-architecture model folder, read from its config.json."""
    path = Path(folder) / "config.json"
    hf = json.loads(path.read_text())
    if hf.get("model_type") != "llama":
        raise InitFromError(f"{path}: model_type {hf.get('model_type')!r} is not 'llama'; model.init_from "
                            "takes LLaMA-architecture models (LlamaForCausalLM)")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise InitFromError(f"{path}: {flag} is true; the pipeline's LLaMA shape has no bias terms")
    missing = [key for key in _SHAPE_FIELDS[:6] if key not in hf]
    if missing:
        raise InitFromError(f"{path}: no {missing} (not a LlamaConfig?)")
    values = {key: hf[key] for key in _SHAPE_FIELDS if key in hf}
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim != values["hidden_size"] // values["num_attention_heads"]:
        raise InitFromError(f"{path}: head_dim {head_dim} is not hidden_size / num_attention_heads")
    rope = hf.get("rope_parameters") or {}
    values["rope_theta"] = float(hf.get("rope_theta", rope.get("rope_theta", 10000.0)))
    extra = {}
    if rope and rope.get("rope_type", "default") != "default":
        extra["rope_parameters"] = rope  # e.g. llama3 frequency scaling: changes the logits, not the weights
    if hf.get("rope_scaling"):
        extra["rope_scaling"] = hf["rope_scaling"]
    if hf.get("hidden_act", "silu") != "silu":
        extra["hidden_act"] = hf["hidden_act"]
    return ModelShape(**values, extra=extra)


def init_from_shape(model: ModelSettings, tokenizer_vocab: int | None = None,
                    init_folder: Path | None = None) -> ModelShape:
    """The shape of model.init_from's model, from its config.json (`init_folder`: where it was resolved to); the
    LLaMA family is the one model.init_from continues."""
    shape = shape_from_hf_config(init_folder or init_from_folder(model.init_from, weights=False))
    if model.overrides:
        raise InitFromError("model.overrides cannot change a model.init_from model's shape: its weights fix it")
    if tokenizer_vocab is not None and tokenizer_vocab > shape.vocab_size:
        # The adopted tokenizer gained rows (a pad token it lacked): the embedding grows, see load_pretrained.
        shape = replace(shape, vocab_size=tokenizer_vocab)
    return shape


# Where an HF folder keeps its weights. Only safetensors are read: their header gives every tensor's name and shape
# without loading a byte of the weights, and loading them runs no pickled code.
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
# Tensors with a row per token: rows the model has beyond the weights' (a pad token the adopted tokenizer added) are
# filled by load_pretrained, so fewer rows in the weights is not a mismatch.
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of an HF model folder: the shards its model.safetensors.index.json lists, else every
    *.safetensors there; raises InitFromError naming the folder, what is missing and how to get it."""
    folder = Path(folder)
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [name for name in names if not (folder / name).is_file()]
        if missing:
            raise InitFromError(f"model.init_from {folder}: {SAFETENSORS_INDEX} lists {len(names)} weight file(s) "
                                f"and {missing[:3]} {'is' if len(missing) == 1 else 'are'} not there (an interrupted "
                                "download or copy): fetch or copy the folder again")
        return [folder / name for name in names]
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickled = [name for name in PICKLED_WEIGHTS if (folder / name).is_file()]
    if pickled:
        raise InitFromError(
            f"model.init_from {folder}: its weights are PyTorch pickles ({', '.join(pickled)}); only safetensors are "
            "read. Convert them once: python -c \"from transformers import AutoModelForCausalLM as M; "
            f"M.from_pretrained('{folder}').save_pretrained('{folder}', safe_serialization=True)\"")
    raise InitFromError(f"model.init_from {folder}: no weights there (neither model.safetensors nor "
                        f"{SAFETENSORS_INDEX}); point it at a folder that holds them, e.g. results/<name>/train/hf")


def header_shapes(files: list[Path]) -> dict[str, tuple[list[int], Path]]:
    """{tensor name: (shape, file)} from the safetensors headers alone (no weights are read)."""
    from safetensors import safe_open

    shapes = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = (list(handle.get_slice(name).get_shape()), file)
    return shapes


def weight_mismatches(shapes: dict[str, tuple[list[int], Path]], expected: dict[str, list[int]],
                      tied: bool) -> list[str]:
    """What keeps weights with these header `shapes` from loading into a model with these `expected` parameter
    shapes (load_pretrained's rules: a tied head is the embedding, older exports' rotary buffers are recomputed,
    the vocabulary tensors may have fewer rows than the model)."""
    missing = [name for name in expected if name not in shapes and not (tied and name == "lm_head.weight")]
    problems = [f"the weights lack {len(missing)} tensor(s) of the model, e.g. {missing[:3]}"] if missing else []
    for name, (shape, file) in shapes.items():
        if name not in expected:
            if not (name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight")):
                problems.append(f"{file.name}: tensor {name} has no place in the model")
            continue
        want = list(expected[name])
        fewer_rows = name in VOCAB_TENSORS and shape[1:] == want[1:] and shape[0] <= want[0]
        if shape != want and not fewer_rows:
            problems.append(f"{file.name}: {name} has shape {shape}, the model {want}")
    return problems


def check_init_from_weights(folder: Path, shape: ModelShape, seq_len: int) -> list[Path]:
    """Before launch: model.init_from's weights exist, and every tensor's shape (read from the safetensors headers)
    is the one the model described by `shape` (its config.json, as this run builds it) has; returns the weight
    files. The model is built on torch's meta device, which allocates nothing."""
    import torch
    from transformers import LlamaForCausalLM

    folder = Path(folder)
    files = weight_files(folder)
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(shape, seq_len))
    expected = {name: list(param.shape) for name, param in model.named_parameters()}
    problems = weight_mismatches(header_shapes(files), expected, shape.tie_word_embeddings)
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise InitFromError(
            f"model.init_from {folder}: its weights do not fit the model its config.json describes "
            f"({shape.num_hidden_layers} layers, hidden {shape.hidden_size}, {shape.num_attention_heads} heads / "
            f"{shape.num_key_value_heads} key-value heads, FFN {shape.intermediate_size}, vocabulary "
            f"{shape.vocab_size}): {shown}. Use the config.json these weights were saved with (or the weights "
            "this config.json belongs to)")
    return files


def load_pretrained(model, folder: Path) -> dict:
    """Copy an HF folder's safetensors weights into `model` (built with the same shape), tensor by tensor so at
    most one extra tensor is in memory; returns {'files', 'bytes', 'added_vocab_rows'}.

    Embedding rows the model has beyond the checkpoint's (a pad token added to its tokenizer) are set to the mean of
    the checkpoint's rows, the usual choice for new tokens (Hewitt 2021, "Initializing new word embeddings").
    """
    import torch
    from safetensors import safe_open

    folder = Path(folder)
    files = weight_files(folder)
    params = dict(model.named_parameters())  # a tied lm_head shares the embedding and is not listed
    tied = getattr(model.config, "tie_word_embeddings", False)
    problems = weight_mismatches(header_shapes(files), {name: list(p.shape) for name, p in params.items()}, tied)
    if problems:
        raise InitFromError(f"model.init_from {folder}: " + "; ".join(problems[:5]))
    added, total = 0, 0
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    if name not in params:
                        continue  # a rotary buffer or a tied head (weight_mismatches allowed only those)
                    tensor, target = handle.get_tensor(name), params[name]
                    total += tensor.numel() * tensor.element_size()
                    if name in VOCAB_TENSORS and tensor.shape[0] < target.shape[0]:
                        added = target.shape[0] - tensor.shape[0]
                        target[tensor.shape[0]:] = tensor.float().mean(0).to(target.dtype)
                        target = target[:tensor.shape[0]]
                    target.copy_(tensor.to(target.dtype))
    return {"files": [file.name for file in files], "bytes": total, "added_vocab_rows": added}


class LlamaFamily(ModelFamily):
    """The LLaMA architecture (transformers' LlamaForCausalLM, or its native twin): every dense preset."""

    name, shape_type, presets, hf_architecture = "llama", ModelShape, PRESETS, "LlamaForCausalLM"
    flops_formula, title = flops.FLOPS_FORMULA, "LLaMA"

    def card_rows(self, shape: ModelShape) -> list[tuple[str, str]]:
        return [("attention heads (key/value heads)", f"{shape.num_attention_heads} ({shape.num_key_value_heads})"),
                ("FFN width (SwiGLU)", f"{shape.intermediate_size}")]

    def resolve_shape(self, preset: str, overrides: dict | None = None, tokenizer_vocab: int | None = None):
        return resolve_shape(preset, overrides, tokenizer_vocab)

    def count_parameters(self, shape: ModelShape) -> dict[str, int]:
        return count_parameters(shape)

    def memory_dims(self, shape: ModelShape) -> dict:
        head_dim = shape.hidden_size // shape.num_attention_heads
        return {"layers": shape.num_hidden_layers, "hidden_size": shape.hidden_size,
                "kv_size": shape.num_key_value_heads * head_dim, "ffn_size": shape.intermediate_size,
                "vocab_size": shape.vocab_size}

    def model_libraries(self, implementation: str, compile: bool) -> tuple[str, ...]:
        return model_libraries(implementation, compile)

    def flops_per_token(self, shape: ModelShape, seq_len: int) -> float:
        return flops.flops_per_token(count_parameters(shape)["matmul"], shape.num_hidden_layers,
                                     shape.num_attention_heads, shape.hidden_size // shape.num_attention_heads,
                                     seq_len)

    def hf_config(self, shape: ModelShape, seq_len: int, attn_implementation: str | None = None):
        return llama_config(shape, seq_len, attn_implementation)

    def build(self, shape: ModelShape, seq_len: int, seed: int, precision: str = "fp32", device: str = "cpu",
              attn_implementation: str | None = None, implementation: str = "transformers"):
        return build_model(shape, seq_len, seed, precision, device, attn_implementation, implementation)
