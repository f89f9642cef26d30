"""model.init_from: the shape from config.json, the adopted tokenizer, the weights, and hf:// failing fast offline."""
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from pretrain_bench.config.schema import ModelSettings, TokenizerSettings
from pretrain_bench.data.tokenizer import EOS_TOKEN, adopted_tokenizer_path, save_hf_folder, train_bpe
from pretrain_bench.train.memory.model import config_vocab_size
from pretrain_bench.train.models.llama import (
    InitFromError,
    build_model,
    llama_config,
    load_pretrained,
    resolve_shape,
)
from pretrain_bench.train.models.llama import (
    init_from_shape as model_shape,
)
from pretrain_bench.workflow.experiment import load_config

ROOT = Path(__file__).parents[2]


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
    shape = model_shape(ModelSettings(preset="deepseek-7b", init_from=str(hf_folder)), 300)
    assert (shape.num_hidden_layers, shape.hidden_size, shape.num_key_value_heads, shape.vocab_size) == (5, 64, 2, 300)
    assert not shape.tie_word_embeddings
    with pytest.raises(InitFromError, match="model.overrides cannot change"):
        model_shape(ModelSettings(preset="tiny", init_from=str(hf_folder), overrides={"num_hidden_layers": 2}), 300)
    with pytest.raises(InitFromError, match="no config.json"):
        model_shape(ModelSettings(preset="tiny", init_from=str(hf_folder / "missing")), 300)


def test_its_tokenizer_is_adopted_unless_tokenizer_path_says_otherwise(hf_folder, tmp_path):
    model = ModelSettings(preset="tiny", init_from=str(hf_folder))
    tokenizer = TokenizerSettings(path=None, vocab_size=4096)
    assert adopted_tokenizer_path(tokenizer.path, model.init_from) == str(hf_folder)
    assert config_vocab_size(tokenizer, model) == 300, \
        "planning uses the adopted tokenizer's vocabulary, not tokenizer.vocab_size"
    assert adopted_tokenizer_path(str(tmp_path / "tok.json"), model.init_from) == str(tmp_path / "tok.json")
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text((hf_folder / "config.json").read_text())
    with pytest.raises(InitFromError, match="has no tokenizer.json"):
        adopted_tokenizer_path(None, str(tmp_path / "bare"))


def test_weights_load_exactly_and_a_grown_vocabulary_gets_mean_rows(hf_folder):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(hf_folder).eval()
    shape = model_shape(ModelSettings(preset="tiny", init_from=str(hf_folder)), 300)
    model = build_model(shape, 64, seed=99, precision="fp32").eval()
    info = load_pretrained(model, hf_folder)
    assert info["added_vocab_rows"] == 0 and info["files"] == ["model.safetensors"]
    ids = torch.arange(40).reshape(2, 20)
    torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=1e-5)
    grown = build_model(model_shape(ModelSettings(preset="tiny", init_from=str(hf_folder)), 302), 64, seed=1).eval()
    assert load_pretrained(grown, hf_folder)["added_vocab_rows"] == 2
    embed = reference.model.embed_tokens.weight
    torch.testing.assert_close(grown.model.embed_tokens.weight[300], embed.mean(0))


def test_hf_uri_offline_fails_fast_naming_the_uri_and_the_download_command(tmp_path):
    script = textwrap.dedent("""
        from pretrain_bench.data.init_from import InitFromError, init_from_folder
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
        model_shape(ModelSettings(preset="tiny", init_from="hf://just-a-name"), 300)


def test_an_hf_model_is_fetched_once_per_process(monkeypatch, hf_folder):
    import huggingface_hub

    from pretrain_bench.data import init_from

    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, **kwargs: calls.append((repo, kwargs["revision"])) or str(hf_folder))
    init_from._hf_snapshot.cache_clear()
    try:
        # planning reads the shape once per benchmark cell
        pinned = ModelSettings(preset="tiny", init_from="hf://some-org/some-model@v1.0")
        shapes = [model_shape(pinned, 300) for _ in range(3)]
        assert shapes == [model_shape(ModelSettings(preset="tiny", init_from=str(hf_folder)), 300)] * 3
        assert calls == [("some-org/some-model", "v1.0")]
    finally:
        init_from._hf_snapshot.cache_clear()


# --- checked before launch: the plan rule refuses weights that are missing or do not fit their config.json ---

def copy_folder(source: Path, target: Path, skip=()) -> Path:
    import shutil

    shutil.copytree(source, target, ignore=shutil.ignore_patterns(*skip))
    return target


def plan_with_init_from(folder: Path, tmp_path: Path):
    """make_plan, as rule plan_pretrain calls it, for a tiny CPU run continuing from `folder`."""
    import json

    from pretrain_bench.train.plan import make_plan
    from pretrain_bench.workflow.experiment import plan_config

    config = load_config(ROOT / "config.yaml", ROOT / "config" / "tiny-cpu.yaml")
    config["model"] = {**config["model"], "init_from": str(folder), "seq_len": 64}
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"vocab_size": 300, "splits": {"val": {"shards": [{"tokens": 10**6}]}}}))
    return make_plan(plan_config(config), index=index, tokenizer=folder, out_dir=tmp_path / "out",
                     state_dir=tmp_path / "state")


def test_plan_records_weights_that_fit_and_reads_only_their_headers(hf_folder, tmp_path):
    folder = copy_folder(hf_folder, tmp_path / "model")
    weights = folder / "model.safetensors"
    header = 8 + int.from_bytes(weights.read_bytes()[:8], "little")
    with open(weights, "r+b") as handle:  # every byte of every tensor overwritten, the header left as it was
        handle.seek(header)
        handle.write(b"\xff" * (weights.stat().st_size - header))
    plan = plan_with_init_from(folder, tmp_path)
    assert plan.init_from["weight_files"] == ["model.safetensors"] and plan.init_from["path"] == str(folder)


def test_missing_weights_are_refused_at_plan_time_naming_the_folder(hf_folder, tmp_path):
    folder = copy_folder(hf_folder, tmp_path / "model", skip=("*.safetensors",))
    with pytest.raises(InitFromError) as error:
        plan_with_init_from(folder, tmp_path)
    assert f"model.init_from {folder}: no weights there (neither model.safetensors nor " \
           "model.safetensors.index.json)" in str(error.value)


def test_pickled_weights_are_refused_with_the_command_that_converts_them(hf_folder, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = copy_folder(hf_folder, tmp_path / "model", skip=("*.safetensors",))
    # how older transformers versions saved a model (the current one writes safetensors only)
    torch.save(AutoModelForCausalLM.from_pretrained(hf_folder).state_dict(), folder / "pytorch_model.bin")
    with pytest.raises(InitFromError) as error:
        plan_with_init_from(folder, tmp_path)
    message = str(error.value)
    assert f"model.init_from {folder}: its weights are PyTorch pickles (pytorch_model.bin)" in message
    assert f"save_pretrained('{folder}', safe_serialization=True)" in message


def test_a_sharded_model_missing_a_shard_is_refused_naming_it(hf_folder, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = copy_folder(hf_folder, tmp_path / "model", skip=("*.safetensors",))
    AutoModelForCausalLM.from_pretrained(hf_folder).save_pretrained(folder, max_shard_size="100KB")
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 2 and (folder / "model.safetensors.index.json").is_file()
    assert plan_with_init_from(folder, tmp_path).init_from["weight_files"] == [s.name for s in shards]
    shards[1].unlink()
    with pytest.raises(InitFromError) as error:
        plan_with_init_from(folder, tmp_path)
    assert f"model.init_from {folder}: model.safetensors.index.json lists {len(shards)} weight file(s) and " \
           f"['{shards[1].name}'] is not there" in str(error.value)


def test_weights_whose_shapes_disagree_with_config_json_are_refused_at_plan_time(hf_folder, tmp_path):
    import json

    folder = copy_folder(hf_folder, tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 128, "num_hidden_layers": 6}))
    with pytest.raises(InitFromError) as error:
        plan_with_init_from(folder, tmp_path)
    message = str(error.value)
    assert f"model.init_from {folder}: its weights do not fit the model its config.json describes (6 layers" in message
    assert "model.safetensors: model.layers.0.mlp.gate_proj.weight has shape [96, 64], the model [128, 64]" in message
    assert "the weights lack 9 tensor(s) of the model, e.g. ['model.layers.5.self_attn.q_proj.weight'" in message
    assert "Use the config.json these weights were saved with" in message
    # the same rules when the ranks load them
    shape = model_shape(ModelSettings(preset="tiny", init_from=str(folder)), 300)
    with pytest.raises(InitFromError, match="gate_proj.weight has shape"):
        load_pretrained(build_model(shape, 64, seed=0), folder)


def test_a_path_through_a_folder_not_made_yet_is_resolved_lexically(hf_folder, tmp_path, monkeypatch):
    """model.init_from: results/p34/../p29b/train/hf names results/p29b/train/hf, while results/p34 (the run being
    configured) does not exist yet: `..` is resolved as written, not by the file system, which fails through a missing
    folder."""
    import shutil

    from pretrain_bench.data.init_from import init_from_folder, local_path

    monkeypatch.chdir(tmp_path)
    shutil.copytree(hf_folder, tmp_path / "results" / "p29b" / "train" / "hf")
    uri = "results/p34/../p29b/train/hf"
    assert not (tmp_path / "results" / "p34").exists() and not Path(uri, "config.json").exists()
    assert local_path(uri) == local_path(f"file://{uri}") == Path("results/p29b/train/hf")
    assert init_from_folder(uri, weights=False) == Path("results/p29b/train/hf")
