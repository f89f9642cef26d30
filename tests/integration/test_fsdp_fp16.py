"""FSDP2 in fp16 with the sharded gradient scaler, through the real FSDPEngine on gloo (CPU parameters cast to fp16 by
FSDP's mixed-precision policy): the first optimizer step runs (with fused AdamW it raised "output with shape []
doesn't match the broadcast shape [1]"), and at 2 ranks an overflow on one rank's gradient shard skips the step on
every rank alike."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.engine

# One rank's work: the engine as the trainer builds it, 3 optimizer steps on a two-layer model; with `overflow`, rank
# 0's local gradient shard is made infinite before the second step (the scaler's own check must find it).
RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    from pretrain_bench.train.settings import TrainSettings
    from pretrain_bench.train.engines.base import EngineRun
    from pretrain_bench.train.engines.fsdp import FSDPEngine

    dist.init_process_group("gloo")
    rank, overflow = dist.get_rank(), sys.argv[2] == "overflow"
    torch.manual_seed(0)

    class Layers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Layers()

        def forward(self, x):
            for layer in self.model.layers:
                x = layer(x)
            return x.float().pow(2).mean()

    settings = TrainSettings.from_config({"engine": "fsdp", "zero_stage": 3, "precision": "fp16", "device": "cpu",
                                          "comm_backend": "gloo", "gpus": dist.get_world_size()})
    engine = FSDPEngine(Model(), settings, EngineRun(device="cpu", total_steps=10, measure_comm=False,
                                                      pin_memory=False, reshape=False))
    steps = []
    for step in range(3):
        loss = engine(x=torch.randn(4, 8))
        engine.backward(loss)
        if overflow and step == 1 and rank == 0:
            for parameter in engine.model.parameters():
                parameter.grad.to_local().fill_(float("inf"))
        before = [p.to_local().detach().clone() for p in engine.model.parameters()]
        engine.step()
        moved = any(not torch.equal(b, p.to_local()) for b, p in zip(before, engine.model.parameters()))
        steps.append({"scale": engine.loss_scale(), "skipped": engine.skipped_steps, "moved": moved,
                      "lr": engine.lr()})
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as out:
        json.dump(steps, out)
    dist.destroy_process_group()
""")


def run_ranks(tmp_path, ranks: int, mode: str) -> list[list[dict]]:
    script = tmp_path / "fsdp_fp16_rank.py"
    script.write_text(RANK_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                           str(script), str(tmp_path), mode], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(ranks)]


def test_fsdp_fp16_takes_optimizer_steps_at_one_rank(tmp_path):
    [steps] = run_ranks(tmp_path, 1, "plain")
    assert [s["skipped"] for s in steps] == [0, 0, 0]
    assert all(s["moved"] for s in steps) and steps[0]["scale"] == 2.0**16


def test_an_overflow_on_one_ranks_shard_skips_the_step_on_every_rank(tmp_path):
    rank0, rank1 = run_ranks(tmp_path, 2, "overflow")
    assert rank0 == rank1, "the ranks disagree on which steps were skipped"
    assert [s["skipped"] for s in rank0] == [0, 1, 1]
    assert [s["moved"] for s in rank0] == [True, False, True]
    assert rank0[1]["scale"] == rank0[0]["scale"] / 2, "the scale backs off once"
    assert rank0[1]["lr"] == rank0[0]["lr"], "a skipped step does not advance the schedule"
