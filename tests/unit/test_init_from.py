"""model.init_from: the shape from config.json, the adopted tokenizer, the weights, and hf:// failing fast offline."""
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[2]

from pretrain_bench.memory_model import config_vocab_size  # noqa: E402
from pretrain_bench.model import (InitFromError, build_model, llama_config, load_pretrained, model_shape,  # noqa: E402
                                  resolve_shape)
from pretrain_bench.tokenizer import EOS_TOKEN, adopted_tokenizer_path, save_hf_folder, train_bpe  # noqa: E402


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """A small HF LLaMA folder (5 layers, untied) with a tokenizer that has no pad token."""
    from transformers import LlamaForCausalLM

    folder = tmp_path_factory.mktemp("model")
    texts = [f"def f{i}(x):\n    return x * {i}\n" for i in range(200)]
    tokenizer = train_bpe(texts, 300)
    save_hf_folder(tokenizer, {"eos": EOS_TOKEN, "pad": "<|pad|>", "bos": None}, folder)
    shape = resolve_shape("tiny", {"num_hidden_layers": 5, "tie_word_embeddings": False, "hidden_size": 64,
                                   "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96}, 300)
    torch.manual_seed(0)
    LlamaForCausalLM(llama_config(shape, 64)).save_pretrained(folder)
    return folder


def test_shape_comes_from_config_json_and_overrides_are_refused(hf_folder):
    shape = model_shape({"preset": "deepseek-7b", "init_from": str(hf_folder)}, 300)
    assert (shape.num_hidden_layers, shape.hidden_size, shape.num_key_value_heads, shape.vocab_size) == (5, 64, 2, 300)
    assert not shape.tie_word_embeddings
    with pytest.raises(InitFromError, match="model.overrides cannot change"):
        model_shape({"preset": "tiny", "init_from": str(hf_folder), "overrides": {"num_hidden_layers": 2}}, 300)
    with pytest.raises(InitFromError, match="no config.json"):
        model_shape({"preset": "tiny", "init_from": str(hf_folder / "missing")}, 300)


def test_its_tokenizer_is_adopted_unless_tokenizer_path_says_otherwise(hf_folder, tmp_path):
    config = {"model": {"preset": "tiny", "init_from": str(hf_folder)}, "tokenizer": {"path": None, "vocab_size": 4096}}
    assert adopted_tokenizer_path(config) == str(hf_folder)
    assert config_vocab_size(config) == 300, "planning uses the adopted tokenizer's vocabulary, not tokenizer.vocab_size"
    other = {**config, "tokenizer": {"path": str(tmp_path / "tok.json"), "vocab_size": 4096}}
    assert adopted_tokenizer_path(other) == str(tmp_path / "tok.json")
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text((hf_folder / "config.json").read_text())
    with pytest.raises(InitFromError, match="has no tokenizer.json"):
        adopted_tokenizer_path({**config, "model": {"preset": "tiny", "init_from": str(tmp_path / "bare")}})


def test_weights_load_exactly_and_a_grown_vocabulary_gets_mean_rows(hf_folder):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(hf_folder).eval()
    shape = model_shape({"preset": "tiny", "init_from": str(hf_folder)}, 300)
    model = build_model(shape, 64, seed=99, precision="fp32").eval()
    info = load_pretrained(model, hf_folder)
    assert info["added_vocab_rows"] == 0 and info["files"] == ["model.safetensors"]
    ids = torch.arange(40).reshape(2, 20)
    torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=1e-5)
    grown = build_model(model_shape({"preset": "tiny", "init_from": str(hf_folder)}, 302), 64, seed=1).eval()
    assert load_pretrained(grown, hf_folder)["added_vocab_rows"] == 2
    embed = reference.model.embed_tokens.weight
    torch.testing.assert_close(grown.model.embed_tokens.weight[300], embed.mean(0))


def test_hf_uri_offline_fails_fast_naming_the_uri_and_the_download_command(tmp_path):
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(ROOT / "workflow_scripts")!r})
        from pretrain_bench.model import InitFromError, init_from_folder
        try:
            init_from_folder("hf://some-org/some-model@v1.0", weights=False)
        except InitFromError as error:
            print(error)
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - start < 30
    assert "model.init_from hf://some-org/some-model@v1.0: offline mode is on" in result.stdout, result.stderr[-2000:]
    assert "hf download some-org/some-model --revision v1.0" in result.stdout
    with pytest.raises(InitFromError, match="expected hf://<org>/<name>"):
        model_shape({"preset": "tiny", "init_from": "hf://just-a-name"}, 300)


def test_an_hf_model_is_fetched_once_per_process(monkeypatch, hf_folder):
    import huggingface_hub

    from pretrain_bench import model

    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, **kwargs: calls.append((repo, kwargs["revision"])) or str(hf_folder))
    model._hf_snapshot.cache_clear()
    try:
        # planning reads the shape once per benchmark cell
        shapes = [model_shape({"preset": "tiny", "init_from": "hf://some-org/some-model@v1.0"}, 300) for _ in range(3)]
        assert shapes == [model_shape({"preset": "tiny", "init_from": str(hf_folder)}, 300)] * 3
        assert calls == [("some-org/some-model", "v1.0")]
    finally:
        model._hf_snapshot.cache_clear()
