"""What the PyTorch engines (DDP, FSDP) share: `TorchEngine` (AdamW, the LambdaLR, accumulation, clipping, fp16 loss
scaling), and the timing of collectives in flight (`CommIntervals` over a host or CUDA-event clock)."""
from __future__ import annotations

import contextlib
from datetime import timedelta
from pathlib import Path

import torch

from pretrain_bench.train.engines.base import Engine, EngineRun, engine_state_file, lr_schedule
from pretrain_bench.train.engines.spec import TORCH_ADAMW_KWARGS


class TorchEngine(Engine):
    """What DDP and FSDP share: AdamW, the LambdaLR, gradient accumulation, clipping and fp16 loss scaling."""

    # non-reentrant recomputation: what DDP's and FSDP's gradient hooks need
    gradient_checkpointing_kwargs = {"use_reentrant": False}
    experts = None  # the routed experts split over expert-parallel ranks (split_experts), or None

    @staticmethod
    def init_distributed(backend: str, timeout: timedelta) -> None:
        import torch.distributed as dist

        dist.init_process_group(backend=backend, timeout=timeout)  # no DeepSpeed at all (nor its import time)

    @classmethod
    def build_precision(cls, settings) -> str:
        # fp32 parameters; bf16/fp16 compute through autocast or FSDP's mixed-precision policy
        return "fp32"

    def __init__(self, model, settings, run: EngineRun):
        self.settings, self.device = settings, run.device
        total_steps = run.total_steps
        self.accumulation = settings.grad_accum_steps
        self.micro_step = 0  # micro-steps since the last optimizer step
        self.skipped_steps = 0
        self._grad_norm: float | None = None
        self.model = self.wrap(model)
        # torch.optim.AdamW as DeepSpeed's torch_adam path builds it (fused), so ZeRO-0 and DDP match
        self.optimizer = torch.optim.AdamW(self.optimizer_params(), lr=settings.lr, betas=tuple(settings.adam_betas),
                                           eps=settings.adam_eps, weight_decay=settings.weight_decay,
                                           **self.optimizer_kwargs())
        self.scheduler = lr_schedule(settings, total_steps)(self.optimizer)
        self.scaler = self.make_scaler() if settings.precision == "fp16" else None
        # the scale as last read (before the first step: the initial scale, which reading does not wait for)
        self._scale = self.scaler.get_scale() if self.scaler is not None else None

    # engine-specific
    def wrap(self, model):
        raise NotImplementedError

    def optimizer_params(self):
        """What AdamW steps: the wrapped model's parameters (or param groups)."""
        return self.model.parameters()

    def optimizer_kwargs(self) -> dict:
        """How torch.optim.AdamW runs its update (fused or foreach) under this engine's loss scaler."""
        return TORCH_ADAMW_KWARGS

    def make_scaler(self):
        return torch.amp.GradScaler(self.device)

    def split_experts(self, model) -> None:
        """train.expert_parallel: this rank keeps its slice of the routed experts (the model was built whole from the
        run's seed, so EP 1's experts, split), the wrapper leaves them out of its reduction (`self.experts.params`)
        and `reduce_gradients` averages them; the MoE layers' all-to-alls are timed as the wrapper's collectives are.
        `self.experts` None without expert parallelism. The import is here: the MoE dispatch's
        torch.compiler.disable imports torch._dynamo, which an eager rank without experts never loads
        (tests/unit/test_engine_choice.py)."""
        self.experts = None
        if self.settings.expert_parallel > 1:
            from pretrain_bench.train.engines.expert_shards import ExpertShards

            self._all_to_all = CommIntervals(CudaEventClock() if self.device == "cuda" else HostClock())
            self.experts = ExpertShards(model, self.settings.expert_parallel, self._all_to_all)

    def all_to_all_ms(self) -> float | None:
        """Milliseconds with a MoE layer's all-to-all in flight (dispatch and combine, forward and backward, and the
        count exchanges), over the run so far; None without expert parallelism."""
        return self._all_to_all.total_ms() if self.experts is not None else None

    def reduce_gradients(self) -> None:
        """At the accumulation boundary, before clipping: reduce what the wrapper leaves unreduced (the routed
        experts split over expert-parallel ranks)."""
        if self.experts is not None:
            self.experts.reduce_gradients()

    def clip_gradients(self, clip: float):
        """Clip the gradients to a total norm of `clip`; returns the norm before clipping (a tensor). With split
        experts: the norm over every rank's experts and the wrapper's parameters together."""
        if self.experts is not None:
            params = list(self.model.parameters())
            norm = self.experts.total_norm(params)
            ids = {id(p) for p in self.experts.params}
            for group in ([p for p in params if id(p) not in ids], self.experts.params):
                # apart: FSDP's parameters are DTensors, the experts plain tensors, and one foreach op takes one kind
                torch.nn.utils.clip_grads_with_norm_(group, clip, norm)
            return norm
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: a DTensor over the shards

    def sync_gradients(self, boundary: bool):
        """A context for the forward (and the backward) of a micro-step: gradients are reduced only at the boundary."""
        return contextlib.nullcontext()

    def autocast(self):
        return contextlib.nullcontext()

    # the loop's interface
    @property
    def boundary(self) -> bool:
        return (self.micro_step + 1) % self.accumulation == 0

    def __call__(self, **inputs):
        with self.sync_gradients(self.boundary or not torch.is_grad_enabled()), self.autocast():
            return self.model(**inputs)

    def backward(self, loss) -> None:
        loss = loss / self.accumulation  # the mean over micro-steps, as DeepSpeed scales it
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        with self.sync_gradients(self.boundary):
            loss.backward()

    def step(self) -> None:
        boundary = self.boundary
        self.micro_step = (self.micro_step + 1) % self.accumulation
        if not boundary:
            return
        self.reduce_gradients()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        clip = self.settings.grad_clip if self.settings.grad_clip > 0 else float("inf")
        norm = self.clip_gradients(clip)
        self._grad_norm = norm  # read (one synchronisation) only when the record asks for it
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
            # The step's one read of the scale (a synchronisation; the scheduler must know whether to step). The
            # scale drops exactly when the step was skipped; the scale before it was read at the previous step.
            scale, self._scale = self._scale, self.scaler.get_scale()
            stepped = self._scale >= scale
        else:
            self.optimizer.step()
            stepped = True
        if stepped:
            self.scheduler.step()
        else:
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)

    def eval(self) -> None:
        self.model.eval()

    def train(self) -> None:
        self.model.train()

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def grad_norm(self):
        return self._grad_norm

    def loss_scale(self) -> float | None:
        return self._scale

    def ran(self) -> dict:
        """Precision, ZeRO-equivalent stage and batch: this engine takes them from the settings and nothing else."""
        s = self.settings
        return {"precision": s.precision, "zero_stage": s.zero_stage, "micro_batch_size": s.micro_batch_size,
                "grad_accum_steps": s.grad_accum_steps, "global_batch_size": s.derived_global_batch}

    def engine_state(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "skipped_steps": self.skipped_steps,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_engine_state(self, folder: Path) -> None:
        """The scheduler, scaler and skipped steps. A new world size has no file of its own for a new rank: they are
        the same on every rank, so rank 0's serve."""
        import torch.distributed as dist

        own = folder / engine_state_file(dist.get_rank())
        state = torch.load(own if own.is_file() else folder / engine_state_file(0), map_location="cpu",
                           weights_only=False)
        self.scheduler.load_state_dict(state["scheduler"])
        self.skipped_steps = state["skipped_steps"]
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
            self._scale = self.scaler.get_scale()


class HostClock:
    """Marks in host wall-clock milliseconds: on CPU a collective's future completes when its work has."""

    def mark(self) -> float:
        import time

        return time.perf_counter() * 1000.0

    def spans_ms(self, intervals: list[list]) -> list[tuple[float, float]]:
        return [(start, stop) for start, stop in intervals]


class CudaEventClock:
    """Marks as CUDA events on the current stream. An NCCL all-reduce's future "completes", and runs its callbacks,
    when the work is queued, not done; the callback runs with streams that wait for the work, so an event recorded
    there passes when the all-reduce has finished. Read (waiting for the last mark) only when asked."""

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def spans_ms(self, intervals: list[list]) -> list[tuple[float, float]]:
        if not intervals:
            return []
        for _, stop in intervals:
            stop.synchronize()
        origin = intervals[0][0]
        return [(origin.elapsed_time(start), origin.elapsed_time(stop)) for start, stop in intervals]


class CommIntervals:
    """Time with at least one collective in flight: the union of launch-to-completion intervals, which overlap each
    other and the backward pass, marked by a HostClock (CPU) or a CudaEventClock (CUDA)."""

    def __init__(self, clock):
        self.clock = clock
        self.pending: list[list] = []  # [start, stop or None]
        self.total = 0.0

    def launched(self) -> list:
        interval = [self.clock.mark(), None]
        self.pending.append(interval)
        return interval

    def completed(self, interval: list) -> None:
        interval[1] = self.clock.mark()

    def total_ms(self) -> float:
        """Milliseconds in flight over every interval completed so far (the rest wait for the next call)."""
        done = [interval for interval in self.pending if interval[1] is not None]
        self.pending = [interval for interval in self.pending if interval[1] is None]
        end = float("-inf")
        for start, stop in sorted(self.clock.spans_ms(done)):  # overlapping buckets count once
            start = max(start, end)
            if stop > start:
                self.total += stop - start
                end = stop
        return self.total


