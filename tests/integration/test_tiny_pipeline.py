"""The tiny CPU pipeline end to end through Snakemake, with every stage's output checked for content (the shared
run of tests/conftest.py `pipeline`)."""
import json
import math
import os

import numpy as np
import pytest

from support import PIPELINE_MICRO_BATCH, PIPELINE_NAME, PIPELINE_STEPS, read_jsonl, run_snakemake

pytestmark = pytest.mark.pipeline
GLOBAL_BATCH = 3 * PIPELINE_MICRO_BATCH  # 3 ranks × the micro batch, one micro step each


@pytest.fixture(scope="module")
def run(pipeline):
    """The shared run of the whole tiny pipeline (tests/conftest.py)."""
    return pipeline.results


@pytest.fixture(scope="module")
def data(pipeline):
    """The folders of the run's corpus, tokenizer and shards under results/data/."""
    return pipeline.data


def test_manifest_counts_match_documents(data):
    manifest = json.loads((data.corpus / "manifest.json").read_text())
    train = read_jsonl(data.corpus / "train.jsonl")
    val = read_jsonl(data.corpus / "val.jsonl")
    assert manifest["documents"] == len(train) + len(val)
    assert manifest["train"]["documents"] == len(train) and len(val) > 0
    assert manifest["bytes"] == sum(len(d["text"].encode()) for d in train + val)
    assert manifest["bytes"] <= 4_000_000  # corpus.max_bytes of the tiny config


def test_tokenizer_round_trips_and_shards_decode_to_corpus(data):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(data.tokenizer)
    text = "def f(x):\n    return x ** 2  # ünïcödé ✓\n"
    assert tok.decode(tok.encode(text)) == text
    index = json.loads((data.shards / "index.json").read_text())
    assert index["dtype"] == "uint16" and index["eos_id"] == tok.eos_token_id
    first = index["splits"]["train"]["shards"][0]
    tokens = np.memmap(data.shards / first["file"], dtype=np.uint16, mode="r")
    assert len(tokens) == first["tokens"]
    train_docs = read_jsonl(data.corpus / "train.jsonl")
    eos_positions = np.flatnonzero(tokens == index["eos_id"])
    first_doc = tok.decode(tokens[: eos_positions[0]].tolist())
    assert first_doc == train_docs[0]["text"]
    second_doc = tok.decode(tokens[eos_positions[0] + 1: eos_positions[1]].tolist())
    assert second_doc == train_docs[1]["text"]


def test_training_loss_falls_and_summary_is_measured(run, pipeline):
    summary = json.loads((run / "train" / "summary.json").read_text())
    records = read_jsonl(run / "train" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, summary["steps"] + 1))
    assert summary["world_size"] == 3 and summary["device"] == "cpu" and summary["zero_stage"] == 2
    assert summary["comm_backend"] == "gloo" and summary["precision"] == "fp32"
    assert summary["loss"]["last"] < summary["loss"]["first"] - 1.0, "loss clearly falls"
    assert len(summary["peak_mem_bytes"]) == 3 and all(b > 10_000_000 for b in summary["peak_mem_bytes"])
    assert summary["oversubscribed"] == (3 > (os.cpu_count() or 1))
    assert summary["tokens_per_step"] == GLOBAL_BATCH * 128
    steady = [r for r in records if r["step"] > summary["warmup_timing_steps"]]
    expected = summary["tokens_per_step"] * len(steady) / sum(r["step_time_s"] for r in steady)
    assert summary["tokens_per_s"] == pytest.approx(expected, rel=1e-9)
    assert 0 < summary["mfu"] < 1 and summary["peak_flops_per_rank"] > 0
    assert summary["comm_fraction"] is not None and 0 < summary["comm_fraction"] < 1
    assert summary["checkpoints"] == list(PIPELINE_STEPS)
    for field in ("git_commit", "config_sha256", "versions", "hardware"):
        assert field in summary["provenance"]
    # the data the run read: its id names the folder under results/data/, which the plan and summary agree on
    plan = json.loads((run / "train" / "plan.json").read_text())
    assert summary["provenance"]["data_id"] == plan["data"]["data_id"] == pipeline.products.data_id
    assert plan["paths"]["index"] == f"{plan['data']['shards']}/index.json"
    ds_config = json.loads((run / "train" / "ds_config.json").read_text())
    assert ds_config["zero_optimization"]["stage"] == 2 and ds_config["train_batch_size"] == GLOBAL_BATCH


def test_training_log_holds_no_warning_about_deepspeeds_own_calls(pipeline):
    log = (pipeline.workdir / "logs" / PIPELINE_NAME / "pretrain.log").read_text()
    assert f"step {PIPELINE_STEPS[-1]}/{PIPELINE_STEPS[-1]}" in log and "exit status 0" in log
    assert "all_gather_into_tensor" not in log and "FutureWarning" not in log


def test_perplexity_finite_and_falls_across_checkpoints(run):
    evals = [json.loads((run / "eval" / f"step{s}.json").read_text()) for s in PIPELINE_STEPS]
    assert all(math.isfinite(e["perplexity"]) and e["perplexity"] > 1 for e in evals)
    assert evals[-1]["perplexity"] < evals[0]["perplexity"]
    assert all(0 < e["bits_per_byte"] < 8 for e in evals)
    assert evals[-1]["perplexity"] == pytest.approx(math.exp(evals[-1]["loss"]))


def test_hf_export_loads_and_generates(run, data, pipeline):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "train" / "hf", local_files_only=True)
    tok = AutoTokenizer.from_pretrained(run / "train" / "hf", local_files_only=True)
    inputs = tok("import os\n", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 8
    assert f"data id: `{pipeline.products.data_id}`" in (run / "train" / "hf" / "README.md").read_text()
    # The export holds the final checkpoint: its held-out loss equals the evaluator's on the same tokens.
    from pretrain_bench.data.loader import PackedTokens

    val = PackedTokens(data.shards / "index.json", "val", 128)
    batch = torch.from_numpy(np.stack([val[k] for k in range(4)]))
    logits = model(input_ids=batch[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    assert math.isfinite(loss.item()) and loss.item() < math.log(4096)


def test_report_numbers_equal_summary(run, pipeline):
    from pretrain_bench.report.render import GIB, fmt

    summary = json.loads((run / "train" / "summary.json").read_text())
    md = (run / "report" / "report.md").read_text()
    assert f"data {pipeline.products.data_id}" in md  # the provenance lines name the data the runs read
    html = (run / "report" / "report.html").read_text()
    for text in (md, html):
        assert fmt(summary["tokens_per_s"]) in text
        assert fmt(summary["step_time_s"]["median"], 3) in text
        assert fmt(summary["mfu"] * 100, 2) in text
        assert fmt(summary["peak_flops_per_rank"] / 1e12, 3) in text
        for b in summary["peak_mem_bytes"]:
            assert fmt(b / GIB, 2) in text
        for step in PIPELINE_STEPS:
            ev = json.loads((run / "eval" / f"step{step}.json").read_text())
            assert fmt(ev["perplexity"], 2) in text and fmt(ev["bits_per_byte"], 4) in text
        assert "extrapolated" in text and "Oversubscribed" in text
    assert "data:image/png;base64," in html, "the HTML report is self-contained"
    for plot in ("loss.png", "throughput.png"):
        assert (run / "report" / "plots" / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rerun_has_nothing_to_do(pipeline):
    """The whole workflow (rule all: every export, evaluation, lm-eval run, benchmark cell and the report) is up to
    date after the shared run, so is any part of it."""
    proc = run_snakemake(pipeline.workdir, "-n", configfiles=pipeline.configfiles)
    assert "Nothing to be done" in proc.stdout + proc.stderr
