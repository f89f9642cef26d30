"""Checkpoint evaluation through Snakemake on the tiny run (its two kept checkpoints, support.PIPELINE_STEPS): HF
exports that match the DeepSpeed model, eval/step<N>.json, lm-eval on the shipped tasks, checkpoints left untouched."""
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from support import (
    PIPELINE_MICRO_BATCH,
    PIPELINE_NAME,
    PIPELINE_STEPS,
    ROOT,
    TINY_CONFIG,
    free_port,
    run_snakemake,
)

pytestmark = pytest.mark.pipeline

NAME = PIPELINE_NAME  # the shared run of the whole tiny pipeline (tests/conftest.py)
STEPS = PIPELINE_STEPS
FIRST, LAST = STEPS[0], STEPS[-1]
SEQ_LEN, GLOBAL_BATCH = 128, 3 * PIPELINE_MICRO_BATCH  # config/tiny-cpu.yaml: 3 ranks, one micro step each
TINY = yaml.safe_load((ROOT / TINY_CONFIG).read_text())


def snakemake(pipeline, *targets, options=(), check=True):
    return run_snakemake(pipeline.workdir, *options, "--", *targets, configfiles=pipeline.configfiles, check=check,
                         timeout=1800)


@pytest.fixture(scope="module")
def run(pipeline):
    """The shared run, with its checkpoints' digests from before and after exports and evaluations read them."""
    return {"pipeline": pipeline, "before": pipeline.before, "after": pipeline.after, "results": pipeline.results}


def load_eval(run, step):
    return json.loads((run["results"] / "eval" / f"step{step}.json").read_text())


def load_export(run, step):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = run["results"] / "export" / f"step{step}"
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    return model, AutoTokenizer.from_pretrained(folder, local_files_only=True)


def test_evaluating_never_modifies_a_checkpoint(run):
    assert run["before"] == run["after"]
    assert all((run["results"] / "state" / "checkpoints" / f"step{s}" / "COMMITTED.json").is_file() for s in STEPS)


def test_eval_files_hold_the_contract_fields(run):
    for step in STEPS:
        result = load_eval(run, step)
        assert (result["step"], result["split"], result["train_tokens"]) == (step, "val", step * GLOBAL_BATCH * SEQ_LEN)
        assert result["checkpoint"] == f"results/{NAME}/state/checkpoints/step{step}"
        assert (result["samples"], result["tokens"]) == (4096 // SEQ_LEN, 4096)
        loss, tokens, text_bytes = result["loss"], result["tokens"], result["bytes"]
        assert 4 < loss < math.log(4096) + 1 and result["perplexity"] == pytest.approx(math.exp(loss))
        assert result["bits_per_byte"] == pytest.approx(loss * tokens / math.log(2) / text_bytes)
        assert result["bits_per_byte_exact"] and 2 < result["bytes"] / result["tokens"] < 6  # Python source
        assert result["eval_tokens_per_s"] > 0 and result["device"] == "cpu"
        prompts = TINY["evaluate"]["prompts"]
        assert [(g["prompt"], g["mode"]) for g in result["generations"]] == [
            (p, mode) for p in prompts for mode in ("greedy", "sampled")]


def test_eval_loss_is_the_exports_loss_on_the_evenly_spaced_samples(run):
    from pretrain_bench.data.loader import PackedTokens
    from pretrain_bench.train.heldout import eval_sample_indices

    result = load_eval(run, LAST)
    model, _ = load_export(run, LAST)
    data = PackedTokens(run["pipeline"].data.shards / "index.json", "val", SEQ_LEN)
    indices = eval_sample_indices(data.num_samples, SEQ_LEN, 4096)
    assert len(set(indices.tolist())) == 32 and indices[-1] > data.num_samples * 0.9, "spread over the whole split"
    batch = torch.from_numpy(np.stack([data[int(k)] for k in indices]))  # (32, T+1)
    with torch.no_grad():
        logits = model(input_ids=batch[:, :-1]).logits  # (32, T, vocab)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).item()
    assert result["loss"] == pytest.approx(loss, rel=1e-5)


def test_continuations_reproduce_from_the_export(run):
    from transformers import GenerationConfig

    result = load_eval(run, LAST)
    model, tokenizer = load_export(run, LAST)
    settings = {"max_new_tokens": 48, "temperature": 0.8, "top_k": 50, "seed": 1234}
    assert result["generation"] == settings
    for record in result["generations"][:2]:
        ids = tokenizer(record["prompt"], add_special_tokens=False, return_tensors="pt").input_ids
        sampling = {"do_sample": True, "temperature": 0.8, "top_k": 50} if record["mode"] == "sampled" else {}
        config = GenerationConfig(**sampling, max_new_tokens=48, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(settings["seed"])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        assert tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True) == record["text"]


DEEPSPEED_LOGITS = r"""
import json, os, sys
from pathlib import Path
import deepspeed, torch
from pretrain_bench.train.models.llama import build_model, resolve_shape
from pretrain_bench.train.settings import TrainSettings
from pretrain_bench.train.engines.spec import deepspeed_config

plan = json.loads(Path(sys.argv[1]).read_text())
out, steps = sys.argv[2], [int(step) for step in sys.argv[3:]]
index = json.loads(Path(plan["paths"]["index"]).read_text())
shape = resolve_shape(plan["model"]["preset"], plan["model"]["overrides"], index["vocab_size"])
deepspeed.init_distributed(dist_backend="gloo")
# The run's ZeRO stage and precision on one rank; the weights come from the checkpoint, not from this seed.
settings = TrainSettings.from_config({**plan["train"], "gpus": 1, "global_batch_size": None})
model = build_model(shape, plan["model"]["seq_len"], seed=99)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                  config=deepspeed_config(settings, "cpu", 10))
engine.eval()
ids = torch.from_numpy(__import__("numpy").random.default_rng(0).integers(2, index["vocab_size"], (2, 96)))
logits = {}
for step in steps:
    engine.load_checkpoint(str(Path(plan["paths"]["state_dir"]) / "checkpoints"), tag=f"step{step}",
                           load_module_only=True, load_optimizer_states=False, load_lr_scheduler_states=False)
    with torch.no_grad():
        logits[step] = engine(input_ids=ids).logits  # (2, 96, vocab)
torch.save({"input_ids": ids, "logits": logits}, out)
"""


def test_export_logits_match_the_deepspeed_engine(run, tmp_path):
    """A DeepSpeed engine (world size 1, gloo, CPU) loads the 3-rank ZeRO-2 checkpoint's module weights; the HF
    export, built from the ZeRO optimizer shards by zero_to_fp32, gives the same logits (fp32: max |Δ| ≤ 1e-5)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="2")
    out = tmp_path / "deepspeed_logits.pt"
    proc = subprocess.run([sys.executable, "-c", DEEPSPEED_LOGITS, f"results/{NAME}/train/plan.json", str(out),
                           *map(str, STEPS)], cwd=run["pipeline"].workdir, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reference = torch.load(out)
    for step in STEPS:
        model, _ = load_export(run, step)
        with torch.no_grad():
            logits = model(input_ids=reference["input_ids"]).logits  # (2, 96, vocab)
        difference = (logits - reference["logits"][step]).abs().max().item()
        print(f"step {step}: max |logits export - DeepSpeed| = {difference:.3g}")
        assert difference <= 1e-5
        assert reference["logits"][step].abs().max() > 1, "real logits, not an all-zero output"
    a, _ = load_export(run, FIRST)
    b, _ = load_export(run, LAST)
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight), "each step exports its own weights"


def rolling_loglikelihood(model, tokens: list[int], prefix: int, max_length: int) -> float:
    """log p(tokens | prefix) as lm-eval's rolling windows score it: the tokens in disjoint chunks of max_length,
    each chunk scored with as much preceding context as fits in max_length (so the last chunk sees more)."""
    stream = [prefix] + tokens
    total = 0.0
    for start in range(1, len(stream), max_length):
        end = min(start + max_length, len(stream))
        inputs = torch.tensor([stream[max(0, end - 1 - max_length):end - 1]])  # (1, ≤ max_length)
        with torch.no_grad():
            logits = model(input_ids=inputs).logits[0, -(end - start):].float()  # (end - start, vocab)
        total += -F.cross_entropy(logits, torch.tensor(stream[start:end]), reduction="sum").item()
    return total


def test_lm_eval_numbers_are_the_export_models_own(run):
    """lm-eval's figures recomputed from first principles with the export and the task data files."""
    summary = json.loads((run["results"] / "lm_eval" / f"step{LAST}.json").read_text())
    assert summary["samples"] == {"pretrain_bench_last_word": 4, "pretrain_bench_doc_perplexity": 4}
    assert (summary["step"], summary["max_length"], summary["limit"]) == (LAST, SEQ_LEN, 4)
    model, tokenizer = load_export(run, LAST)
    data = run["results"] / "lm_eval" / "data"

    # last word: the target's log-likelihood given the (left-truncated) context; acc when it is the greedy path
    logliks, hits = [], []
    for line in (data / "last_word.jsonl").read_text().splitlines()[:4]:
        example = json.loads(line)
        context, target = example["context"], example["target"]
        spaces = len(context) - len(context.rstrip())  # lm-eval moves trailing spaces into the continuation
        context, target = context[:len(context) - spaces], context[len(context) - spaces:] + target
        whole = tokenizer.encode(context + target)
        context_ids = tokenizer.encode(context)
        target_ids = whole[len(context_ids):]
        window = torch.tensor([whole[-(SEQ_LEN + 1):][:-1]])
        with torch.no_grad():
            logits = model(input_ids=window).logits[0, -len(target_ids):]  # (len(target), vocab)
        logliks.append(-F.cross_entropy(logits, torch.tensor(target_ids), reduction="sum").item())
        hits.append(logits.argmax(-1).tolist() == target_ids)
    last_word = summary["tasks"]["pretrain_bench_last_word"]
    assert last_word["perplexity"] == pytest.approx(math.exp(-sum(logliks) / len(logliks)), rel=1e-4)
    assert last_word["acc"] == pytest.approx(sum(hits) / len(hits))

    # documents: rolling log-likelihood over the first 4 val documents, per UTF-8 byte
    texts = [json.loads(line)["text"] for line in (data / "documents.jsonl").read_text().splitlines()[:4]]
    loglik = sum(rolling_loglikelihood(model, tokenizer.encode(text), tokenizer.eos_token_id, SEQ_LEN)
                 for text in texts)
    text_bytes = sum(len(text.encode()) for text in texts)
    documents = summary["tasks"]["pretrain_bench_doc_perplexity"]
    assert documents["bits_per_byte"] == pytest.approx(-loglik / text_bytes / math.log(2), rel=1e-5)
    assert documents["byte_perplexity"] == pytest.approx(math.exp(-loglik / text_bytes), rel=1e-5)


def test_a_missing_checkpoint_fails_naming_its_path(run):
    proc = snakemake(run["pipeline"], f"results/{NAME}/eval/step15.json", check=False)
    assert proc.returncode != 0
    log = (run["pipeline"].workdir / "logs" / NAME / "evaluate" / "step15.log").read_text()
    assert f"checkpoint results/{NAME}/state/checkpoints/step15 is missing or incomplete (no COMMITTED.json)" in log
    assert not (run["results"] / "export" / "step15").exists()


def test_an_incomplete_zero_checkpoint_fails_naming_its_path(run, tmp_path, monkeypatch):
    from pretrain_bench.evaluate.export import export_checkpoint
    from pretrain_bench.train.checkpoints.files import CheckpointError

    monkeypatch.chdir(run["pipeline"].workdir)  # where the plan's relative paths lead, as in the run's jobs
    folder = tmp_path / "checkpoints" / f"step{FIRST}"
    shutil.copytree(run["results"] / "state" / "checkpoints" / f"step{FIRST}", folder)
    shards = sorted(folder.glob("*optim_states.pt"))
    assert len(shards) == 3, "one optimizer shard per rank"
    shards[1].unlink()  # a copy that lost one rank's shard, marker and all else intact
    from pretrain_bench.train.plan import Plan

    plan = Plan.from_json(run["results"] / "train" / "plan.json")
    plan = dataclasses.replace(plan, paths=dataclasses.replace(plan.paths, state_dir=str(tmp_path)))
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint {folder} is incomplete or unreadable")):
        export_checkpoint(plan, FIRST, tmp_path / "export")

