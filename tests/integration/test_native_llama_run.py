"""model.implementation native through the real launcher: the same plan trained by transformers' LlamaForCausalLM and
by the native model on 2 gloo ranks gives the same losses, the native ranks never import transformers, and the
native run's checkpoint exports to a folder AutoModelForCausalLM loads."""
import json

import pytest

from pretrain_bench.train.plan import Plan, make_plan
from pretrain_bench.workflow.experiment import plan_config
from support import losses, rank_startups, run  # the data fixture: tests/conftest.py

pytestmark = pytest.mark.engine

# Same seed, same initial weights (test_native_llama), the same kernel calls in the same order: the losses agree to
# the last bit on CPU in fp32; the tolerance admits only a reduction's rounding, were a kernel to change its order.
LOSS_TOLERANCE = 1e-6


def native_plan(data, run_dir, implementation: str):
    config, results = data
    train = {"gpus": 2, "global_batch_size": None, "max_steps": 3, "checkpoint_every": 3, "warmup_timing_steps": 1,
             "warmup_steps": 2, "lr": 3.0e-3, "min_lr": 3.0e-4}
    config = {**config, "model": {**config["model"], "implementation": implementation},
              "train": {**config["train"], **train}}
    plan = make_plan(plan_config(config), index=results.shards / "index.json", tokenizer=results.tokenizer,
                     out_dir=run_dir / "out", state_dir=run_dir / "state")
    plan.to_json(run_dir / "plan.json")
    return run_dir / "plan.json"


def test_native_run_trains_to_transformers_losses_without_importing_it_and_exports(data, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from pretrain_bench.evaluate.export import export_checkpoint

    curves, startups = {}, {}
    for implementation in ("transformers", "native"):
        run_dir, log = tmp_path / implementation, tmp_path / f"{implementation}.log"
        plan = native_plan(data, run_dir, implementation)
        assert run(plan, 2, log) == 0, log.read_text()[-3000:]
        curves[implementation] = losses(run_dir)
        summary = json.loads((run_dir / "out" / "summary.json").read_text())
        assert summary["model"]["implementation"] == implementation and summary["world_size"] == 2
        startups[implementation] = rank_startups(log)
    assert len(curves["native"]) == 3
    assert curves["native"] == pytest.approx(curves["transformers"], abs=LOSS_TOLERANCE, rel=0), curves
    assert len(startups["native"]) == len(startups["transformers"]) == 2, "each rank logs its start-up"
    assert all("transformers" not in record["imported"] for record in startups["native"]), startups["native"]
    assert all("transformers" in record["imported"] for record in startups["transformers"]), "the check can fail"

    # The export of the native run's checkpoint is a transformers LlamaForCausalLM folder.
    native = tmp_path / "native"
    export_checkpoint(Plan.from_json(native / "plan.json"), 3, native / "out" / "hf")
    exported = AutoModelForCausalLM.from_pretrained(native / "out" / "hf")
    assert type(exported).__name__ == "LlamaForCausalLM"
    assert json.loads((native / "out" / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    # and it is the native run's model: its loss on a batch is that of the transformers run's export, trained the same
    reference = tmp_path / "transformers"
    export_checkpoint(Plan.from_json(reference / "plan.json"), 3, reference / "out" / "hf")
    other = AutoModelForCausalLM.from_pretrained(reference / "out" / "hf")
    batch = torch.randint(0, exported.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = exported(input_ids=batch, labels=batch).loss, other(input_ids=batch, labels=batch).loss
    assert torch.isfinite(ours) and abs(ours.item() - theirs.item()) < 1e-5
