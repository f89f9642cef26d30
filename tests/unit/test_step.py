"""One training step never waits for the GPU inside the loop: phase times come from events read afterwards."""

import pytest
import torch

from pretrain_bench.train.step import PhaseTimer, train_step

B, T, V = 2, 5, 11


class Log(list):
    pass


class FakeEvent:
    """torch.cuda.Event stand-in: records into the log instead of a CUDA stream."""
    log: Log = None

    def __init__(self, enable_timing=False):
        assert enable_timing

    def record(self):
        self.log.append("record")

    def synchronize(self):
        self.log.append("event-sync")

    def elapsed_time(self, other):
        return 2.0  # ms


class FakeEngine:
    def __init__(self, log):
        self.log = log
        self.weight = torch.nn.Parameter(torch.randn(V, V))

    def __call__(self, input_ids):
        self.log.append("forward")
        return type("Out", (), {"logits": self.weight[input_ids]})()  # (B, T, V)

    def backward(self, loss):
        self.log.append("backward")
        loss.backward()

    def step(self):
        self.log.append("step")


class Batches:
    def next_batch(self):
        return torch.randint(0, V, (B, T + 1))


@pytest.fixture
def cuda_forbidden(monkeypatch):
    log = Log()
    FakeEvent.log = log
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)

    def synchronize(*args, **kwargs):
        raise AssertionError("torch.cuda.synchronize called in the training loop")
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    return log


def test_cuda_phase_timing_records_events_and_waits_once_after_the_step(cuda_forbidden):
    log = cuda_forbidden
    loss, seconds, phases = train_step(FakeEngine(log), Batches(), micro_steps=2, vocab=V, run_device="cpu",
                                       timer=PhaseTimer("cuda", enabled=True))
    assert log.count("event-sync") == 1 and log[-1] == "event-sync", "one wait, after the step's last work"
    assert log[:5] == ["record", "forward", "record", "backward", "record"] and log.count("record") == 8
    assert phases == {"forward": pytest.approx(0.004), "backward": pytest.approx(0.004),
                      "optimizer": pytest.approx(0.004)}  # 2 micro-steps × 2 ms each
    assert loss > 0 and seconds > 0


def test_with_timing_off_the_loop_touches_no_timing_path(cuda_forbidden):
    log = cuda_forbidden
    _, _, phases = train_step(FakeEngine(log), Batches(), micro_steps=3, vocab=V, run_device="cpu",
                              timer=PhaseTimer("cuda", enabled=False))
    assert "record" not in log and "event-sync" not in log
    assert log == ["forward", "backward", "step"] * 3
    assert phases == {"forward": None, "backward": None, "optimizer": None}


def test_cpu_phases_are_wall_clock_and_sum_within_the_step():
    _, seconds, phases = train_step(FakeEngine(Log()), Batches(), micro_steps=2, vocab=V, run_device="cpu",
                                    timer=PhaseTimer("cpu"))
    assert all(v > 0 for v in phases.values()) and sum(phases.values()) <= seconds


def test_on_cuda_batches_are_pinned_and_copied_without_waiting(cuda_forbidden, monkeypatch):
    """The CUDA path of to_device, on CPU: pin_memory and to(non_blocking) are recorded instead of run."""
    from pretrain_bench.train.step import to_device

    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *args, **kwargs: calls.append((args, kwargs)) or self)
    batch = torch.randint(0, V, (B, T + 1))
    assert to_device(batch, "cuda:0") is batch
    assert calls == ["pin", (("cuda:0",), {"non_blocking": True})]
    calls.clear()
    assert to_device(batch, "cpu") is batch and calls == [], "a CPU run copies nothing"


def test_the_step_reads_its_loss_once_through_read(cuda_forbidden):
    read = []
    figures, _, _ = train_step(FakeEngine(Log()), Batches(), micro_steps=3, vocab=V, run_device="cpu",
                               timer=PhaseTimer("cpu"), read=lambda loss: read.append(loss) or "figures")
    assert figures == "figures" and len(read) == 1
    assert read[0].shape == () and read[0].requires_grad is False, "the mean loss, still a tensor, detached"
