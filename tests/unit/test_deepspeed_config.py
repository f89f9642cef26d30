"""The ZeRO settings deepspeed_config chooses by world size, and that the 1-rank choice trains the same bits."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from pretrain_bench.settings import TrainSettings, deepspeed_config
from support import free_port


def settings(**kw):
    base = dict(gpus=1, device="cpu", comm_backend="gloo", precision="fp32", micro_batch_size=2, grad_accum_steps=1,
                global_batch_size=None)
    return TrainSettings.from_config({**base, **kw})


@pytest.mark.parametrize("stage", [1, 2])
def test_reduce_scatter_is_off_only_at_one_rank_without_offload(stage):
    assert deepspeed_config(settings(zero_stage=stage), "cpu", 10)["zero_optimization"]["reduce_scatter"] is False
    for other in (settings(zero_stage=stage, gpus=3), settings(zero_stage=stage, gpus=1, nodes=2),
                  settings(zero_stage=stage, offload_optimizer="cpu")):
        assert deepspeed_config(other, "cpu", 10)["zero_optimization"]["reduce_scatter"] is True
    # train.deepspeed still decides last
    chosen = settings(zero_stage=stage, deepspeed={"zero_optimization": {"reduce_scatter": True}})
    assert deepspeed_config(chosen, "cpu", 10)["zero_optimization"]["reduce_scatter"] is True


def test_reduce_scatter_stays_on_for_zero3():
    assert deepspeed_config(settings(zero_stage=3), "cpu", 10)["zero_optimization"]["reduce_scatter"] is True
    assert "reduce_scatter" not in deepspeed_config(settings(zero_stage=0), "cpu", 10)["zero_optimization"]


# One gloo rank in a fresh interpreter: DeepSpeed's process group would outlive the test in pytest's own process.
ONE_RANK_RUN = textwrap.dedent("""
    import json, sys
    import deepspeed, torch
    import torch.nn.functional as F
    from pretrain_bench.engines.deepspeed_engine import skip_muon_import
    from pretrain_bench.model import build_model, resolve_shape
    from pretrain_bench.settings import TrainSettings, deepspeed_config

    stage, precision, reduce_scatter = json.loads(sys.argv[1])
    skip_muon_import()
    deepspeed.init_distributed(dist_backend="gloo")
    shape = resolve_shape("tiny", {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2,
                                   "intermediate_size": 64, "num_hidden_layers": 2}, 97)
    settings = TrainSettings.from_config({"gpus": 1, "device": "cpu", "comm_backend": "gloo", "precision": precision,
                                          "micro_batch_size": 2, "global_batch_size": None, "zero_stage": stage,
                                          "grad_clip": 0.05})
    config = deepspeed_config(settings, "cpu", 6)
    config["zero_optimization"]["reduce_scatter"] = reduce_scatter
    model = build_model(shape, 16, 0, precision, "cpu", None, "native")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(6):
        tokens = torch.randint(0, 97, (2, 17), generator=generator)
        logits = engine(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, 97), tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    weights = sum(float(p.double().sum()) for p in engine.module.parameters())
    print(json.dumps({"losses": losses, "weights": weights, "norm": float(engine.get_global_grad_norm()),
                      "reduce_scatter": engine.zero_reduce_scatter()}))
""")


def one_rank_run(stage: int, precision: str, reduce_scatter: bool) -> dict:
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), DS_ACCELERATOR="cpu")
    done = subprocess.run([sys.executable, "-c", ONE_RANK_RUN, json.dumps([stage, precision, reduce_scatter])],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("stage,precision", [(1, "fp32"), (2, "fp32"), (2, "bf16")])
def test_one_rank_without_reduce_scatter_trains_the_same_bits(stage, precision):
    """What deepspeed_config turns off at one rank changes no bit of the losses, the gradient norm (clipped: the
    clip is active at grad_clip 0.05) or the weights."""
    with_it, without = one_rank_run(stage, precision, True), one_rank_run(stage, precision, False)
    assert (with_it["reduce_scatter"], without["reduce_scatter"]) == (True, False)
    assert without["losses"] == with_it["losses"]
    assert without["losses"][-1] < without["losses"][0], "the weights moved"
    assert (without["norm"], without["weights"]) == (with_it["norm"], with_it["weights"])
