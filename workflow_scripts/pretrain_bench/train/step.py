"""One optimizer step (its micro-steps) and the timing of its phases, without stalling a GPU.

CUDA kernels run asynchronously: reading a clock around `engine.backward` would time the launch, not the work, and
calling `torch.cuda.synchronize()` around every phase (what a naive timer does) serialises what DeepSpeed overlaps —
the gradient reduction with the backward pass, the host copies with the next forward. So phase boundaries on CUDA
are CUDA events recorded into the stream, read once the step is over. The step's single synchronisation is `read`,
the caller's one read of the step's figures to the host (the trainer's: every rank's loss, peak memory and stop
flag, gathered on the device first): the non-finite-loss check must see every step before a checkpoint is saved, a
stop signal must end every rank at the same step, and the step's wall time must include its GPU work, so the read
ends the timed step (its gather of a few numbers included). On CPU the work is synchronous and the wall clock is
exact. With timing off nothing is recorded at all.

Batches come from pinned host memory on CUDA, so their copy to the device is queued (non_blocking) rather than
waited for.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from pretrain_bench.train.rank import host_to_device, host_values

PHASES = ("forward", "backward", "optimizer")


class PhaseTimer:
    """Boundaries of forward / backward / optimizer in each micro-step; seconds per phase summed over the step."""

    def __init__(self, device: str, enabled: bool = True):
        self.device, self.enabled = device, enabled
        self._marks: list = []

    def mark(self) -> None:
        if not self.enabled:
            return
        if self.device == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()  # queued in the stream: no wait
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def result(self) -> dict[str, float | None]:
        """Seconds per phase of the step just finished (None when timing is off); resets the marks."""
        marks, self._marks = self._marks, []
        if not self.enabled:
            return dict.fromkeys(PHASES)
        if self.device == "cuda":
            marks[-1].synchronize()  # already reached: the step's loss was read before this
            gaps = [a.elapsed_time(b) / 1000.0 for a, b in zip(marks, marks[1:])]
        else:
            gaps = [b - a for a, b in zip(marks, marks[1:])]
        totals = dict.fromkeys(PHASES, 0.0)
        # 4 marks per micro-step (start, after forward, after backward, after the optimizer); the gap from one
        # micro-step's end to the next one's start (loading its batch) belongs to no phase
        for i in range(0, len(marks) - 1, len(PHASES) + 1):
            for j, phase in enumerate(PHASES):
                totals[phase] += gaps[i + j]
        return totals


def to_device(batch: torch.Tensor, run_device: str) -> torch.Tensor:
    """The batch on the run's device (rank.host_to_device: pinned and queued on CUDA where pinning is allowed)."""
    return host_to_device(batch, run_device)


def train_step(engine, batches, *, micro_steps: int, vocab: int, run_device: str, timer: PhaseTimer,
               read=None) -> tuple:
    """Run one optimizer step of `micro_steps` micro-batches; returns (read(mean loss), wall seconds, phase seconds).

    `read` takes the mean loss, a 0-d tensor on the device, and reads it to the host with whatever else the step
    reports (the step's one synchronisation); by default the loss alone, as a float."""
    started = time.perf_counter()
    loss_sum = torch.zeros((), device=run_device)
    for _ in range(micro_steps):
        batch = to_device(batches.next_batch(), run_device)  # (B, T+1)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        timer.mark()
        output = engine(input_ids=inputs)
        logits = output.logits  # (B, T, vocab)
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))
        # a mixture-of-experts model's balance loss (its coefficient applied), trained on, not reported as the loss
        aux = getattr(output, "aux_loss", None)
        timer.mark()
        engine.backward(loss if aux is None else loss + aux)
        timer.mark()
        engine.step()
        timer.mark()
        loss_sum += loss.detach().float()  # stays on the device: no wait per micro-step
    figures = (read or read_loss)(loss_sum / micro_steps)  # the step's one synchronisation
    return figures, time.perf_counter() - started, timer.result()


def read_loss(loss: torch.Tensor) -> float:
    return host_values(loss)
