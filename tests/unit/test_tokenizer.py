"""Tokenizer: training, HF folder, exact round trips, adoption of existing tokenizers, the corpus reader."""

import json
import random
import shutil
from pathlib import Path

import pytest

from pretrain_bench.config.schema import CorpusSettings, ShardSettings, TokenizerSettings
from pretrain_bench.data.products import (
    WRITTEN_RECORD,
    DataProducts,
    tokenizer_content_key,
    tokenizer_problem,
    written_digests,
)
from pretrain_bench.data.tokenizer import (
    EOS_TOKEN,
    PAD_TOKEN,
    iter_texts,
    load_tokenizer,
    sample_windows,
    train_bpe,
    train_tokenizer,
)
from support import TRICKY_TEXTS, stdlib_texts, write_jsonl


def random_text(rng: random.Random, length: int) -> str:
    """Code points from every plane except surrogates (not encodable as UTF-8)."""
    chars = []
    for _ in range(length):
        plane = rng.choice([(0x20, 0x7F), (0x00, 0x20), (0x80, 0x800), (0x800, 0xD800), (0xE000, 0x10000),
                            (0x10000, 0x110000)])
        chars.append(chr(rng.randrange(*plane)))
    return "".join(chars)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    texts = stdlib_texts(300_000) + TRICKY_TEXTS
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "train.jsonl", texts)


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("tokenizer")
    return out, train_tokenizer(corpus, out, vocab_size=1000, train_bytes=200_000)


def test_trained_folder_loads_with_transformers(trained):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder, info = trained
    assert info["vocab_size"] == 1000 and info["eos_id"] == 0 and info["pad_id"] == 1
    for hf in (PreTrainedTokenizerFast.from_pretrained(folder), AutoTokenizer.from_pretrained(folder,
                                                                                              local_files_only=True)):
        assert hf.eos_token == EOS_TOKEN and hf.eos_token_id == info["eos_id"]
        assert hf.pad_token == PAD_TOKEN and hf.pad_token_id == info["pad_id"]
        assert len(hf) == info["vocab_size"]
        code = "def f(x):\n    if x:\n        return  x . y  ,  z\n"
        ids = hf.encode(code)
        assert info["eos_id"] not in ids  # no BOS/EOS added behind the caller's back
        assert hf.decode(ids) == code


def test_round_trips_arbitrary_utf8(trained):
    from transformers import AutoTokenizer

    folder, _ = trained
    tokenizer, _ = load_tokenizer(folder)
    hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    rng = random.Random(0)
    texts = [random_text(rng, rng.randrange(1, 200)) for _ in range(200)] + TRICKY_TEXTS[:2]
    for text in texts:
        assert tokenizer.decode(tokenizer.encode(text).ids) == text
        assert hf.decode(hf.encode(text)) == text


def test_training_is_deterministic_and_uses_the_sample(corpus, tmp_path, trained):
    folder, info = trained
    again = train_tokenizer(corpus, tmp_path, vocab_size=1000, train_bytes=200_000)
    assert (tmp_path / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    assert again == info
    total_bytes = sum(len(text.encode()) for text in iter_texts(corpus))
    assert 100_000 < info["train_text_bytes"] < total_bytes  # a sample of ~train_bytes, not the whole split


def test_sample_windows_are_spread_and_disjoint():
    assert sample_windows(1000, 5000) == [(0, 1000)]
    windows = sample_windows(10_000_000, 64_000, windows=64)
    assert len(windows) == 64 and sum(stop - start for start, stop in windows) == 64_000
    assert windows[0][0] == 0 and windows[-1][0] > 9_000_000  # reaches the last sources, not just the first
    assert all(a_stop <= b_start for (_, a_stop), (b_start, _) in zip(windows, windows[1:]))


def test_iter_texts_ranges_partition_documents(corpus):
    texts = list(iter_texts(corpus))
    size = corpus.stat().st_size
    for cuts in ([0, size], [0, 1, 2, size], [0, size // 3, size // 2, size - 1, size]):
        parts = [text for start, stop in zip(cuts, cuts[1:]) for text in iter_texts(corpus, start, stop)]
        assert parts == texts


def test_iter_texts_names_file_and_offset_of_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"txt": "wrong key"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: line at byte 15 "):
        list(iter_texts(path))


def test_adopts_tokenizer_json_file_and_adds_pad(tmp_path):
    tokenizer = train_bpe(["hello world"] * 5, 300)
    tokenizer.add_special_tokens(["</s>"])
    # a bare tokenizer.json without our pad token: remove it by rebuilding from a vocabulary that lacks it
    data = json.loads(tokenizer.to_str())
    data["added_tokens"] = [token for token in data["added_tokens"] if token["content"] not in (PAD_TOKEN, EOS_TOKEN)]
    for name in (PAD_TOKEN, EOS_TOKEN):
        data["model"]["vocab"].pop(name, None)
    (tmp_path / "in.json").write_text(json.dumps(data))

    info = train_tokenizer(tmp_path / "unused.jsonl", tmp_path / "out", vocab_size=300, train_bytes=1,
                           path=str(tmp_path / "in.json"))
    adopted, saved = load_tokenizer(tmp_path / "out")
    assert info["source"] == str(tmp_path / "in.json")
    assert saved["eos_token"] == "</s>" and saved["eos_id"] == adopted.token_to_id("</s>")
    assert saved["pad_token"] == PAD_TOKEN and saved["pad_id"] == info["vocab_size"] - 1  # appended


def test_adopts_hf_folder_with_its_eos(trained, tmp_path):
    folder, info = trained
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|pad|>"  # a folder may name any token its EOS: the config wins over known names
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    (tmp_path / "src" / "tokenizer_config.json").write_text(json.dumps(config))
    adopted = train_tokenizer(Path("unused"), tmp_path / "out", vocab_size=1, train_bytes=1,
                              path=str(tmp_path / "src"))
    assert adopted["eos_id"] == info["pad_id"] and adopted["vocab_size"] == info["vocab_size"]


def test_adopting_without_eos_fails_naming_the_path(tmp_path):
    tokenizer = train_bpe(["hello world"] * 5, 300)
    data = json.loads(tokenizer.to_str())
    data["added_tokens"] = []
    data["model"]["vocab"].pop(EOS_TOKEN)
    (tmp_path / "no-eos.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"no-eos\.json has no end-of-text token"):
        train_tokenizer(Path("unused"), tmp_path / "out", vocab_size=300, train_bytes=1,
                        path=str(tmp_path / "no-eos.json"))
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        train_tokenizer(Path("unused"), tmp_path / "out", vocab_size=300, train_bytes=1, path=str(tmp_path))



def test_an_adopted_tokenizer_is_keyed_by_content_and_found_among_the_corpus_tokenizers(trained, tmp_path,
                                                                                         monkeypatch):
    from transformers import AutoTokenizer

    folder, _ = trained
    monkeypatch.chdir(tmp_path)
    settings = (CorpusSettings.from_config({"sources": [{"uri": "builtin://python-stdlib"}]}),
                TokenizerSettings.from_config({}), ShardSettings.from_config({}))
    trained_products = DataProducts.from_settings(*settings, None)
    product = Path("results", trained_products.tokenizer)
    shutil.copytree(folder, product)
    # a sibling's export: the product's tokenizer loaded and saved again by transformers, as the export does
    export = tmp_path / "results" / "sibling" / "train" / "hf"
    AutoTokenizer.from_pretrained(product, local_files_only=True).save_pretrained(export)
    assert tokenizer_content_key(export) == tokenizer_content_key(product)
    adopted = DataProducts.from_settings(*settings, str(export))
    assert adopted.reused_tokenizer and adopted.tokenizer == trained_products.tokenizer
    assert adopted.data_id == trained_products.data_id, "the same shards"
    # an edited copy is another tokenizer: a new product beside it, keyed by its content
    edited = tmp_path / "edited"
    shutil.copytree(export, edited)
    vocab = json.loads((edited / "tokenizer.json").read_text())
    vocab["added_tokens"][0]["content"] = "<|end|>"
    (edited / "tokenizer.json").write_text(json.dumps(vocab))
    other = DataProducts.from_settings(*settings, str(edited))
    assert not other.reused_tokenizer and other.tokenizer != trained_products.tokenizer
    assert other.corpus == trained_products.corpus
    assert DataProducts.from_settings(*settings, str(edited)) == other, "the same content, the same id"


def test_a_tokenizer_product_edited_in_place_is_damaged_not_re_encoded(trained, tmp_path, monkeypatch):
    folder, _ = trained
    monkeypatch.chdir(tmp_path)
    products = DataProducts("c", "t", "s")
    product = Path("results", products.tokenizer)
    shutil.copytree(folder, product)
    assert json.loads((product / WRITTEN_RECORD).read_text()) == written_digests(product)
    assert tokenizer_problem(products) is None
    (product / "tokenizer.json").write_text((product / "tokenizer.json").read_text().replace('"<|pad|>"', '"<pad>"'))
    problem = tokenizer_problem(products)
    assert problem.startswith("the data product results/data/corpus-c/tokenizer-t is damaged: "
                              "results/data/corpus-c/tokenizer-t/tokenizer.json is not the file its tokenizer job "
                              "wrote")
    assert "set tokenizer.path to the copy" in problem
    assert problem.endswith(f"--forcerun {products.tokenizer_json} -- {products.index}")
    assert tokenizer_problem(products, forcerun={products.tokenizer_json}) is None
