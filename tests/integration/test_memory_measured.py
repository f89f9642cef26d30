"""The memory model against a real run: host RSS of an offloaded ZeRO-2 run of a mid-size preset on CPU."""
import json

import pytest

from support import plan_for, run

pytestmark = pytest.mark.engine


def test_offloaded_zero2_rss_matches_the_memory_model(data, tmp_path):
    # llama-125m (134M parameters with its 32k vocabulary), one rank, fp32, optimizer offloaded: on CPU the rank's
    # peak RSS holds the model, activations, DeepSpeed's buffers and every offloaded term of offload_host_terms
    config, results = data
    config = {**config, "model": {**config["model"], "preset": "llama-125m", "overrides": {}}}
    plan_path = plan_for((config, results), tmp_path, gpus=1, global_batch_size=None, zero_stage=2,
                         offload_optimizer="cpu", micro_batch_size=2, max_steps=2, warmup_steps=1,
                         checkpoint_every=100, memory_fit="strict", eval_every=None)
    assert run(plan_path, 1, tmp_path / "train.log") == 0, (tmp_path / "train.log").read_text()[-3000:]
    plan = json.loads(plan_path.read_text())
    estimate = plan["memory_fit"]["estimate"]
    predicted = estimate["per_rank"] + estimate["host_states"]
    measured = json.loads((tmp_path / "out" / "summary.json").read_text())["peak_mem_bytes"][0]
    assert estimate["host_states"] > estimate["params"], "the offloaded states dominate"
    assert abs(measured - predicted) <= 0.15 * predicted, (measured / 2**30, predicted / 2**30)
