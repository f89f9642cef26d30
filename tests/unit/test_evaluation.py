"""Checkpoint evaluation on a small random model: HF export, held-out metrics, continuations, lm-eval task data.

A checkpoint here is the plain (ZeRO-0) layout, mp_rank_00_model_states.pt + COMMITTED.json; the DeepSpeed ZeRO
layout and the comparison with a DeepSpeed engine's logits are in tests/integration/test_evaluate.py.
"""
import json
import math
import re
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pretrain_bench.data.loader import PackedTokens
from pretrain_bench.data.shards import build_index, encode_shard
from pretrain_bench.data.tokenizer import train_tokenizer
from pretrain_bench.evaluate.evaluation import (
    EvalSettings,
    GenerationSettings,
    evaluate_export,
    evaluate_model,
    evaluation_device,
    generate_continuations,
    load_export,
    token_byte_lengths,
)
from pretrain_bench.evaluate.export import export_hf, read_export_info
from pretrain_bench.evaluate.harness import build_task_data, last_word_example
from pretrain_bench.train.checkpoints import files as ckpt
from pretrain_bench.train.heldout import eval_sample_indices
from pretrain_bench.train.models.llama import ModelShape, build_model
from support import (
    stdlib_texts,
    tree_digest,
    write_jsonl,
)

SEQ_LEN = 32
STEP = 7
SHAPE = ModelShape(2, 64, 4, 2, 128, 512, tie_word_embeddings=True)




@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tokenizer, val shards, a random model saved as a committed checkpoint, and its HF export."""
    root = tmp_path_factory.mktemp("run")
    texts = [text for text in stdlib_texts(120_000) if text.isascii()]
    corpus = write_jsonl(root / "train.jsonl", texts)
    train_tokenizer(corpus, root / "tokenizer", vocab_size=512, train_bytes=100_000)
    val = write_jsonl(root / "val.jsonl", [text for text in texts if 500 < len(text) < 3000][:4])
    sidecars = []
    for split, source in (("train", corpus), ("val", val)):
        stem = root / "shards" / f"{split}-00000"
        encode_shard(source, root / "tokenizer", stem.with_suffix(".bin"), stem.with_suffix(".json"), split=split,
                     index=0, count=1)
        sidecars.append(stem.with_suffix(".json"))
    build_index(sidecars, root / "shards" / "index.json")

    model = build_model(SHAPE, SEQ_LEN, seed=0).eval()
    folder = root / "checkpoints" / ckpt.tag_for(STEP)
    folder.mkdir(parents=True)
    torch.save({"module": model.state_dict()}, folder / "mp_rank_00_model_states.pt")
    ckpt.write_marker(root / "checkpoints", STEP, {"tokens": 4321, "world_size": 1})
    before = tree_digest(root / "checkpoints")
    export_hf(root / "checkpoints", STEP, SHAPE, SEQ_LEN, root / "tokenizer", root / "export")
    return {"root": root, "model": model, "export": root / "export", "index": root / "shards" / "index.json",
            "checkpoint_digest_before_export": before}


def test_export_loads_with_auto_classes_and_reproduces_the_logits(run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = AutoModelForCausalLM.from_pretrained(run["export"], local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(run["export"], local_files_only=True)
    ids = torch.tensor([tokenizer.encode("def f(x):\n    return x + 1\n")])  # (1, T)
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, run["model"](input_ids=ids).logits)
    # the config names the tokenizer's end-of-text, so generate() stops at a document boundary
    assert exported.config.eos_token_id == tokenizer.eos_token_id == exported.generation_config.eos_token_id
    assert exported.config.pad_token_id == tokenizer.pad_token_id
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    info = read_export_info(run["export"])
    assert (info["step"], info["train_tokens"], info["seq_len"], info["dtype"]) == (STEP, 4321, SEQ_LEN, "fp32")
    assert info["checkpoint"] == str(run["root"] / "checkpoints" / "step7")


def test_export_of_an_untied_model_keeps_its_own_head(run, tmp_path):
    shape = ModelShape(1, 32, 2, 2, 64, 512, tie_word_embeddings=False)
    model = build_model(shape, SEQ_LEN, seed=1).eval()
    (tmp_path / "checkpoints" / "step3").mkdir(parents=True)
    torch.save({"module": model.state_dict()}, tmp_path / "checkpoints" / "step3" / "mp_rank_00_model_states.pt")
    ckpt.write_marker(tmp_path / "checkpoints", 3, {"tokens": 1})
    export_hf(tmp_path / "checkpoints", 3, shape, SEQ_LEN, run["root"] / "tokenizer", tmp_path / "export")
    exported, _ = load_export(tmp_path / "export", "cpu", "fp32")
    assert torch.equal(exported.lm_head.weight, model.lm_head.weight)
    assert exported.lm_head.weight.data_ptr() != exported.model.embed_tokens.weight.data_ptr()
    ids = torch.arange(3, 40)[None]  # (1, 37)
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, model(input_ids=ids).logits)


def test_export_in_bf16_stores_bf16_weights(run, tmp_path):
    from safetensors import safe_open

    export_hf(run["root"] / "checkpoints", STEP, SHAPE, SEQ_LEN, run["root"] / "tokenizer", tmp_path / "bf16",
              dtype="bf16")
    with safe_open(tmp_path / "bf16" / "model.safetensors", "pt") as weights:
        tensor = weights.get_tensor("model.embed_tokens.weight")
    assert tensor.dtype == torch.bfloat16
    assert torch.equal(tensor, run["model"].model.embed_tokens.weight.detach().to(torch.bfloat16))


def test_exporting_only_reads_the_checkpoint(run):
    assert tree_digest(run["root"] / "checkpoints") == run["checkpoint_digest_before_export"]


def test_missing_or_incomplete_checkpoints_fail_naming_their_path(run, tmp_path):
    root = tmp_path / "checkpoints"
    shutil.copytree(run["root"] / "checkpoints", root)
    export = dict(shape=SHAPE, seq_len=SEQ_LEN, tokenizer_dir=run["root"] / "tokenizer", target=tmp_path / "out")
    with pytest.raises(ckpt.CheckpointError, match=re.escape(f"checkpoint {root / 'step9'} is missing or incomplete")):
        export_hf(root, 9, **export)
    (root / "step7" / ckpt.MARKER).rename(root / "step7" / "marker.bak")  # a save that crashed before its commit
    with pytest.raises(ckpt.CheckpointError, match=re.escape(f"checkpoint {root / 'step7'} is missing or incomplete")):
        export_hf(root, STEP, **export)
    (root / "step7" / "marker.bak").rename(root / "step7" / ckpt.MARKER)
    # committed, but a ZeRO rank's shard is damaged (a partial copy): DeepSpeed's error, with the folder named
    (root / "step7" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"truncated")
    unreadable = re.escape(f"checkpoint {root / 'step7'} is incomplete or unreadable")
    with pytest.raises(ckpt.CheckpointError, match=unreadable):
        export_hf(root, STEP, **export)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_eval_samples_are_evenly_spaced_and_capped_by_max_tokens():
    assert eval_sample_indices(100, 32, 320).tolist() == [0, 10, 20, 30, 40, 50, 60, 70, 80, 90]
    assert eval_sample_indices(100, 32, 10**9).tolist() == list(range(100))  # everything, once
    assert eval_sample_indices(100, 32, 5).tolist() == [0]  # less than one sample still evaluates one
    assert eval_sample_indices(7, 32, 3 * 32).tolist() == [0, 2, 4]
    with pytest.raises(ValueError, match="less than one sample"):
        eval_sample_indices(0, 32, 1000)


def test_loss_and_bits_per_byte_equal_a_direct_computation(run):
    model, tokenizer = load_export(run["export"], "cpu", "fp32")
    data = PackedTokens(run["index"], "val", SEQ_LEN)
    lengths = token_byte_lengths(run["export"], SHAPE.vocab_size)
    result = evaluate_model(model, data, lengths, max_tokens=10**9, batch_size=5)  # every val sample
    assert result["samples"] == data.num_samples and result["tokens"] == data.num_samples * SEQ_LEN

    losses = []
    with torch.no_grad():
        for k in range(data.num_samples):
            sample = torch.from_numpy(data[k])[None]  # (1, T+1)
            logits = model(input_ids=sample[:, :-1]).logits[0]  # (T, vocab)
            losses.append(F.cross_entropy(logits, sample[0, 1:], reduction="sum").item())
    assert result["loss"] == pytest.approx(sum(losses) / result["tokens"], rel=1e-6)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    # All samples tile the stream from its second token on: their bytes are the decoded text's UTF-8 bytes.
    stream = np.concatenate([data[k][:-1] for k in range(data.num_samples)] + [data[data.num_samples - 1][-1:]])
    text = tokenizer.decode(stream[1:].tolist(), skip_special_tokens=True)
    assert result["bytes"] == len(text.encode("utf-8"))
    assert result["bits_per_byte"] == pytest.approx(sum(losses) / math.log(2) / result["bytes"], rel=1e-6)
    assert result["eval_tokens_per_s"] > 0


def test_greedy_continuation_is_the_argmax_path_and_sampling_is_seeded(run):
    model, tokenizer = load_export(run["export"], "cpu", "fp32")
    prompt = "import os\n"
    settings = GenerationSettings(max_new_tokens=12, temperature=1.0, top_k=0, seed=3)
    records = generate_continuations(model, tokenizer, [prompt], settings, seq_len=SEQ_LEN)
    assert [(r["prompt"], r["mode"]) for r in records] == [(prompt, "greedy"), (prompt, "sampled")]

    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        for _ in range(settings.max_new_tokens):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] == tokenizer.eos_token_id:
                break
    new = ids[len(tokenizer.encode(prompt)):]
    assert records[0]["text"] == tokenizer.decode(new, skip_special_tokens=True)
    assert records[0]["new_tokens"] == len(new)

    again = generate_continuations(model, tokenizer, [prompt], settings, seq_len=SEQ_LEN)
    assert again[1]["text"] == records[1]["text"], "the same seed gives the same sample"
    other = generate_continuations(model, tokenizer, [prompt],
                                   GenerationSettings(max_new_tokens=12, temperature=1.0, top_k=0, seed=4),
                                   seq_len=SEQ_LEN)
    assert other[1]["text"] != records[1]["text"], "another seed gives another sample (random model, 12 tokens)"
    assert other[0]["text"] == records[0]["text"], "greedy does not depend on the seed"


def test_a_prompt_longer_than_the_trained_context_is_rejected_by_position(run):
    model, tokenizer = load_export(run["export"], "cpu", "fp32")
    settings = GenerationSettings(max_new_tokens=8)
    with pytest.raises(ValueError, match=r"evaluate.prompts\[1\] is \d+ tokens; with .*max_new_tokens 8 .* 32"):
        generate_continuations(model, tokenizer, ["ok", "word " * 40], settings, seq_len=SEQ_LEN)


def test_evaluate_export_writes_every_contract_field(run, tmp_path):
    settings = EvalSettings(max_tokens=4 * SEQ_LEN, batch_size=3, device="cpu", prompts=("def ", "class A:\n"),
                            generation=GenerationSettings(max_new_tokens=5))
    result = evaluate_export(run["export"], run["index"], tmp_path / "eval" / "step7.json", settings,
                             lock_dir=tmp_path / "locks")
    written = json.loads((tmp_path / "eval" / "step7.json").read_text())
    assert written == json.loads(json.dumps(result))
    for key in ("loss", "perplexity", "bits_per_byte", "tokens", "bytes", "samples", "eval_tokens_per_s"):
        assert isinstance(written[key], (int, float)) and written[key] > 0, key
    assert (written["step"], written["train_tokens"], written["split"]) == (STEP, 4321, "val")
    assert written["checkpoint"] == str(run["root"] / "checkpoints" / "step7")
    assert (written["samples"], written["tokens"], written["bits_per_byte_exact"]) == (4, 4 * SEQ_LEN, True)
    assert [(g["prompt"], g["mode"]) for g in written["generations"]] == [
        ("def ", "greedy"), ("def ", "sampled"), ("class A:\n", "greedy"), ("class A:\n", "sampled")]
    assert all(isinstance(g["text"], str) and 1 <= g["new_tokens"] <= 5 for g in written["generations"])
    assert written["device"] == "cpu" and written["export"] == str(run["export"])


def test_evaluation_device_on_a_machine_without_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from pretrain_bench.core.devices import SlotError

    with evaluation_device("auto", tmp_path) as device:
        assert device == "cpu"
    with pytest.raises(SlotError, match="no CUDA device is visible"):
        with evaluation_device("cuda", tmp_path):
            pass


def test_last_word_example_ends_on_a_whole_word_within_the_cap():
    text = "x" * 40 + " = compute(alpha, beta)\n    return result_2\n" + "y" * 30 + " " + "z" * 400
    example = last_word_example(text, max_chars=120)
    assert example == {"context": text[:text.index(" result_2")], "target": " result_2"}
    assert text.startswith(example["context"] + example["target"])
    # a word cut by the cap is never the target: "zzz…" would end past 120 characters
    assert last_word_example("a" * 100 + " " + "b" * 50, max_chars=120) is None
    assert last_word_example("no words here: 1 2 3 ( ) ;", max_chars=120) is None
    assert last_word_example("short context word", max_chars=120) is None  # under MIN_CONTEXT_CHARS


def test_task_data_holds_every_val_document_and_one_example_each(run, tmp_path):
    counts = build_task_data(run["root"] / "val.jsonl", tmp_path)
    texts = [json.loads(line)["text"] for line in (run["root"] / "val.jsonl").read_text().splitlines()]
    documents = [json.loads(line)["text"] for line in (tmp_path / "documents.jsonl").read_text().splitlines()]
    examples = [json.loads(line) for line in (tmp_path / "last_word.jsonl").read_text().splitlines()]
    assert documents == texts and counts["documents"] == len(texts)
    assert counts["last_word_examples"] == len(examples) > 0
    starts = iter(texts)
    for example in examples:  # in document order, each the start of a document
        assert any(text.startswith(example["context"] + example["target"]) for text in starts)
    empty = write_jsonl(tmp_path / "empty.jsonl", ["1 2 3"])
    with pytest.raises(ValueError, match="pretrain_bench_last_word has no examples"):
        build_task_data(empty, tmp_path / "empty")


def test_unknown_lm_eval_task_is_named(tmp_path):
    from pretrain_bench.evaluate.harness import task_manager

    # the folder rule lm_eval_data writes: the shipped task files beside their data
    folder = tmp_path / "tasks"
    build_task_data(write_jsonl(tmp_path / "val.jsonl", ["a document long enough to hold a last word example"]), folder)
    assert {"pretrain_bench_last_word.yaml", "pretrain_bench_doc_perplexity.yaml", "local_data.py"} <= {
        path.name for path in folder.iterdir()}
    manager = task_manager(["pretrain_bench_last_word"], folder)
    assert {"pretrain_bench_last_word", "pretrain_bench_doc_perplexity"} <= set(manager.all_tasks)
    with pytest.raises(ValueError, match=r"evaluate.lm_eval.tasks: unknown task\(s\) \['pretrain_bench_lastword'\]"):
        task_manager(["pretrain_bench_last_word", "pretrain_bench_lastword"], folder)


def test_bf16_evaluation_falls_back_to_fp16_on_gpus_without_bf16(monkeypatch):
    from pretrain_bench.evaluate.evaluation import supported_precision

    assert supported_precision("bf16", "cpu") == ("bf16", None)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100-SXM2-16GB")
    precision, note = supported_precision("bf16", "cuda:0")
    assert precision == "fp16" and "not supported by Tesla V100-SXM2-16GB: evaluated in fp16" in note
    assert supported_precision("fp32", "cuda:0") == ("fp32", None)


def test_the_model_card_says_the_export_is_zero_to_fp32s_state_and_why_its_safetensors_flag_fails_on_tied_weights():
    from pretrain_bench.evaluate.model_card import weights_lines
    from pretrain_bench.train.models.llama import PRESETS

    tied, untied = PRESETS["tiny"], PRESETS["llama-125m"]
    (zero, *_) = weights_lines(tied, "fp32", zero_partitioned=True)
    assert zero.startswith("`model.safetensors` holds the checkpoint's fp32 master weights: the consolidated state "
                           "DeepSpeed's `zero_to_fp32.py` writes")
    assert "`zero_to_fp32.py --safe_serialization` fails on exactly that sharing" in zero
    assert "zero_to_fp32" not in weights_lines(tied, "fp32", zero_partitioned=False)[0]  # DDP, FSDP, ZeRO-0
    (cast, *_) = weights_lines(untied, "bf16", zero_partitioned=True)
    assert "fp32 master weights, cast to bf16:" in cast and "tied" not in cast
