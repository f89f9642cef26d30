"""A training step reads device values to the host once: the trainer's gather of every rank's loss, peak memory,
stop flag and gradient norm. On CUDA each such read waits for the stream; here, on CPU, the same code paths run
and every read the pipeline's own code makes (Tensor.item / tolist / float / bool, torch.cuda.synchronize) is
counted, with the library code it calls (the optimizer, the loss scaler) included. One read is not ours to remove:
transformers' causal-mask preparation checks the position ids for packed sequences (masking_utils.py,
find_packed_sequence_indices) in every forward without an attention mask; it is counted apart."""
import functools
import sys
import types
from pathlib import Path

import pytest
import torch

from pretrain_bench.train import rank as rank_module
from pretrain_bench.train.checkpoints.checkpointer import Checkpointer
from pretrain_bench.train.engines.registry import DDPEngine, EngineRun
from pretrain_bench.train.models.llama import ModelShape, build_model
from pretrain_bench.train.rank import TrainingAborted
from pretrain_bench.train.settings import TrainSettings
from pretrain_bench.train.step import PhaseTimer, train_step
from pretrain_bench.train.trainer import Trainer
from support import RandomBatches

PACKAGE = str(Path(rank_module.__file__).parent)
SHAPE = ModelShape(1, 32, 2, 2, 64, 97)
B, T, STEPS = 2, 8, 6
RUN = EngineRun(device="cpu", total_steps=STEPS, measure_comm=False, pin_memory=True, reshape=False)


def batches() -> RandomBatches:
    return RandomBatches(SHAPE.vocab_size, B, T)


def trainer_for(engine, settings) -> Trainer:
    """The Trainer's per-step methods (gather_step, record) on an engine built here, without its setup."""
    trainer = Trainer.__new__(Trainer)
    trainer.__dict__.update(
        engine=engine, settings=settings, rank=0, world=1, device="cpu", run_device="cpu", inject_nan_step=0,
        preemption=types.SimpleNamespace(requested=False, received=None), start_step=0, comm_steady_ms=0.0,
        all_to_all_steady_ms=0.0,
        steady_time_s=0.0, tokens_per_step=B * T, heldout=None, flops_token=6.0e6,
        peak={"flops_per_rank": 1.0e12, "source": "test"},
        checkpointer=Checkpointer(Path("state/checkpoints"), settings, seq_len=T, rank=0, world=1, run_device="cpu",
                                  fingerprint={}, saves=False, log=print))
    return trainer


@pytest.fixture
def host_reads(monkeypatch):
    """Counts of reads to the host: made from the pipeline's code (directly, or through the library calls it
    makes), and the calls of rank.host_values, the one function the loop's reads should go through."""
    counts = {"reads": 0, "mask_checks": 0, "host_values": 0, "where": []}

    def caller() -> str | None:
        """"reads" for a read made from the pipeline's code, "mask_checks" for transformers' packed-sequence check,
        None for a read the test itself makes."""
        frame, through_mask = sys._getframe(2), False
        while frame is not None:
            filename = frame.f_code.co_filename
            through_mask = through_mask or filename.endswith("transformers/masking_utils.py")
            if filename.startswith(PACKAGE):
                counts["where"].append(f"{Path(filename).name}:{frame.f_lineno}")
                return "mask_checks" if through_mask else "reads"
            if "site-packages" not in filename and "/torch/" not in filename:
                return None  # reached the test itself
            frame = frame.f_back
        return None

    def counting(original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            kind = caller()
            if kind:
                counts[kind] += 1
            return original(*args, **kwargs)
        return wrapper

    for name in ("item", "tolist", "__float__", "__bool__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.cuda, "synchronize", counting(torch.cuda.synchronize))
    original = rank_module.host_values

    def host_values(tensor):
        counts["host_values"] += 1
        return original(tensor)
    monkeypatch.setattr(rank_module, "host_values", host_values)
    return counts


def run_steps(trainer, timer_enabled=True):
    """STEPS steps as Trainer.run takes them: train_step ending in gather_step, then the step's record."""
    records = []
    timer = PhaseTimer("cpu", enabled=timer_enabled)
    for step in range(1, STEPS + 1):
        skipped_before = trainer.engine.skipped_steps
        gathered, step_time, phases = train_step(
            trainer.engine, batches(), micro_steps=trainer.settings.grad_accum_steps, vocab=SHAPE.vocab_size,
            run_device="cpu", timer=timer, read=functools.partial(trainer.gather_step, step))
        records.append(trainer.record(step, gathered, step_time, phases, None, skipped_before))
    return records


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_each_step_reads_the_device_once(process_group, host_reads, precision):
    settings = TrainSettings(engine="ddp", device="cpu", precision=precision, micro_batch_size=B, grad_accum_steps=2,
                             comm_backend="gloo")
    engine = DDPEngine(build_model(SHAPE, T, seed=0), settings, RUN)
    before = dict(host_reads, where=[])
    records = run_steps(trainer_for(engine, settings))
    # fp16: the loss scaler's scale, read once per step to know whether the step was skipped (the scheduler steps
    # on the host); it cannot join the gather, which comes after the optimizer step
    per_step = 1 + (precision == "fp16")
    assert host_reads["host_values"] - before["host_values"] == STEPS, "one gather read per step"
    assert host_reads["reads"] - before["reads"] == per_step * STEPS, host_reads["where"]
    assert host_reads["mask_checks"] - before["mask_checks"] == settings.grad_accum_steps * STEPS, "one per forward"
    assert all(isinstance(r["loss"], float) and r["loss"] > 0 for r in records)
    assert all(isinstance(r["grad_norm"], float) and r["grad_norm"] > 0 for r in records), "read with the gather"
    if precision == "fp16":
        assert records[-1]["loss_scale"] == engine.scaler.get_scale() and records[0]["loss_scale"] > 1


def test_the_gather_carries_the_stop_flag_and_a_non_finite_loss_still_aborts_in_it(process_group, host_reads):
    settings = TrainSettings(engine="ddp", device="cpu", precision="fp32", micro_batch_size=B, grad_accum_steps=1,
                             comm_backend="gloo")
    engine = DDPEngine(build_model(SHAPE, T, seed=0), settings, RUN)
    trainer = trainer_for(engine, settings)
    trainer.preemption.requested = True
    gathered, _, _ = train_step(engine, batches(), micro_steps=1, vocab=SHAPE.vocab_size, run_device="cpu",
                                timer=PhaseTimer("cpu"), read=functools.partial(trainer.gather_step, 1))
    assert gathered[0].stop_requested == 1.0, "rank 0's stop flag, read in the same gather"
    trainer.inject_nan_step = 2
    with pytest.raises(TrainingAborted, match=r"non-finite loss at step 2 on rank\(s\) \[0\]; no checkpoint written "
                                              r"after it, the last complete one is step none in state/checkpoints"):
        train_step(engine, batches(), micro_steps=1, vocab=SHAPE.vocab_size, run_device="cpu",
                   timer=PhaseTimer("cpu"), read=functools.partial(trainer.gather_step, 2))


def test_deepspeed_throughput_timer_never_synchronises():
    from pretrain_bench.train.engines.spec import deepspeed_config

    config = deepspeed_config(TrainSettings(device="cuda", precision="fp16"), "cuda", total_steps=10)
    assert config["timers"]["throughput"] == {"enabled": False, "synchronized": False}
    assert config["wall_clock_breakdown"] is False


@pytest.mark.parametrize("allowed", [True, False])
def test_host_copies_pin_only_where_the_launcher_allows_it(monkeypatch, allowed):
    """Batches and the step's gather reach the device through one function, which pins only where the launcher's
    probe could (LaunchContext.pin_memory false otherwise: every pin would fail, e.g. under a locked-memory limit).
    The "meta" device stands in for CUDA: a copy to it runs on a machine without a GPU."""
    from pretrain_bench.train.step import to_device

    pinned = []

    def pin_memory(tensor):
        if not allowed:
            raise AssertionError("pinned although the launcher turned pinning off")
        pinned.append(tensor.shape)
        return tensor

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(rank_module, "_pin_memory", True)  # restored after the test
    rank_module.allow_pinning(allowed)
    batch = torch.zeros(2, 8, dtype=torch.long)
    assert to_device(batch, "meta").device.type == "meta"
    assert rank_module.host_to_device(torch.zeros(3), "meta").device.type == "meta"
    assert to_device(batch, "cpu") is batch, "a CPU run copies nothing"
    assert pinned == ([torch.Size([2, 8]), torch.Size([3])] if allowed else [])
