"""The dense LLaMA twin that bench/bench_moe_vs_dense.py times against tiny-moe: the same active FLOPs per token
(each family's own flops_per_token) within a few percent, and the same depth, width, heads and vocabulary."""
import pytest

from pretrain_bench.bench.dense_twin import WIDTH_MULTIPLE, dense_twin, flops_mismatch
from pretrain_bench.train.models.deepseek import resolve_shape
from pretrain_bench.train.models.llama import ModelShape
from pretrain_bench.train.models.registry import model_family


@pytest.mark.parametrize("preset, vocab, seq_len", [("tiny-moe", 2048, 128), ("tiny-moe", 97, 512),
                                                    ("deepseek-v2-lite", None, 4096)])
def test_the_dense_twin_matches_the_moe_models_active_flops_per_token(preset, vocab, seq_len):
    moe = resolve_shape(preset, None, vocab)
    twin = dense_twin(moe, seq_len)
    assert isinstance(twin, ModelShape) and model_family(twin).name == "llama"
    assert (twin.num_hidden_layers, twin.hidden_size, twin.num_attention_heads, twin.vocab_size) == (
        moe.num_hidden_layers, moe.hidden_size, moe.num_attention_heads, moe.vocab_size)
    assert twin.num_key_value_heads == twin.num_attention_heads and twin.intermediate_size % WIDTH_MULTIPLE == 0
    dense_flops = model_family(twin).flops_per_token(twin, seq_len)
    moe_flops = model_family(moe).flops_per_token(moe, seq_len)
    assert dense_flops == pytest.approx(moe_flops, rel=0.03)
    assert flops_mismatch(moe, twin, seq_len) == pytest.approx(dense_flops / moe_flops - 1)


def test_tiny_moes_twin_is_the_benchmarked_shape():
    """The shape the dated benchmark page names: 4 layers of width 128, 4 heads, SwiGLU 768, untied."""
    twin = dense_twin(resolve_shape("tiny-moe", None, 2048), 128)
    assert (twin.intermediate_size, twin.tie_word_embeddings) == (768, False)
    assert abs(flops_mismatch(resolve_shape("tiny-moe", None, 2048), twin, 128)) < 0.01
