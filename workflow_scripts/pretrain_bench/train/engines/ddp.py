"""PyTorch DistributedDataParallel behind `Engine`."""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from pretrain_bench.train.engines.base import engine_state_file, mmap_loads
from pretrain_bench.train.engines.torch_engine import CommIntervals, CudaEventClock, HostClock, TorchEngine

DDP_MODEL_FILE, DDP_OPTIMIZER_FILE = "model.pt", "optimizer.pt"


class DDPEngine(TorchEngine):
    """torch.nn.parallel.DistributedDataParallel: replicated fp32 parameters, gradients and AdamW states; bf16/fp16
    through autocast (fp16 with torch.amp.GradScaler); accumulation micro-steps under no_sync. At one rank the model
    is not wrapped (`wrap`)."""

    rank_libraries = ("torch.nn.parallel",)

    comm_method = ("DDP communication hook on rank 0: wall-clock while any gradient-bucket all-reduce was in "
                   "flight (union of launch-to-completion intervals, CUDA events on a GPU; they overlap the backward "
                   "pass), summed over steady-state steps ÷ their step time")
    comm_timing_is_free = True  # the hook times its all-reduces without synchronising anything

    def wrap(self, model):
        self.module = model  # what is saved and loaded: the model itself, wrapped or not
        self._comm = CommIntervals(CudaEventClock() if self.device == "cuda" else HostClock())
        self.split_experts(model)
        if self.alone():
            # Alone, DDP would all-reduce every gradient with itself (dividing it by 1), and under train.compile its
            # graph-splitting at the buckets (dynamo's DDPOptimizer, made for overlapping the all-reduces with the
            # backward) would cut the compiled model into 3 graphs: with compile on, a 1-rank step in the wrapper
            # measured 0.88× ZeRO-0's, which trains the model unwrapped (bench/bench_trainer.py, 4 rounds of 32
            # steps). So one rank trains the model unwrapped, as DeepSpeed's ZeRO-0 skips its all-reduce alone: the
            # same gradients, the same checkpoint files, and the 1-rank cell a DDP series' speedup divides by is the
            # plain model's speed, not the wrapper's.
            return model
        return self.wrap_ddp(model)

    @staticmethod
    def alone() -> bool:
        import torch.distributed as dist

        return dist.get_world_size() == 1

    def wrap_ddp(self, model):
        """`model` in DistributedDataParallel, its buckets fixed and its all-reduce timed."""
        from torch.nn.parallel import DistributedDataParallel

        # gradient_as_bucket_view: the gradients are views into DDP's communication buckets, not a second copy
        # (the memory model counts 4Ψ of gradients, not 8Ψ)
        ids = [torch.cuda.current_device()] if self.device == "cuda" else None
        if self.experts is not None:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, self.experts.names)
        ddp = DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)
        # Exact resume: DDP's first iteration reduces all gradients in one bucket, then rebuilds its buckets in the
        # order the first backward produced them. A resumed run would reduce its first step in the one bucket where
        # the uninterrupted run used the rebuilt ones, and a ring all-reduce's summation order depends on where an
        # element sits in its bucket, so the losses would drift in the last bits. Fixing the layout now (the
        # Join hook's own calls: parameters in definition order, DDP's usual bucket sizes) makes every step of
        # every run reduce in the same buckets; the price is buckets in definition rather than backward order.
        ddp.reducer._push_all_rebuilt_params()
        ddp.reducer._rebuild_buckets()
        ddp.register_comm_hook(None, self._timed_allreduce)
        return ddp

    def _timed_allreduce(self, state, bucket):
        """DDP's own all-reduce hook, timed from launch to completion (marked in the future's callback)."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        interval = self._comm.launched()

        def done(future):
            self._comm.completed(interval)
            return future.value()

        return allreduce_hook(state, bucket).then(done)

    def comm_ms(self) -> float:
        """Milliseconds with at least one all-reduce in flight, over the run so far."""
        return self._comm.total_ms()

    def sync_gradients(self, boundary: bool):
        return contextlib.nullcontext() if boundary or self.model is self.module else self.model.no_sync()

    def autocast(self):
        precision = self.settings.precision
        if precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)

    def save(self, folder: Path, writer, client_state: dict) -> None:
        """Every file passes through `writer` (hashed while written)."""
        import torch.distributed as dist

        rank = dist.get_rank()
        module_state, optimizer_state = self.module.state_dict(), self.optimizer.state_dict()
        if self.experts is not None:  # the whole experts, gathered from rank 0's expert-parallel group
            whole = self.experts.whole_states(module_state, optimizer_state, saving=rank == 0)
            module_state, optimizer_state = whole or (module_state, optimizer_state)
        if rank == 0:  # every rank holds the same states (but its experts, gathered here)
            writer.save({"module": module_state, "client_state": client_state}, folder / DDP_MODEL_FILE)
            writer.save({"optimizer": optimizer_state}, folder / DDP_OPTIMIZER_FILE)
        writer.save(self.engine_state(), folder / engine_state_file(rank))

    def load(self, folder: Path) -> None:
        """Mapped, not read (mmap_loads gives what outlives the load memory of its own, so a pruned checkpoint's
        disk is freed)."""
        with mmap_loads():
            module_state = torch.load(folder / DDP_MODEL_FILE, map_location="cpu", weights_only=False,
                                      mmap=True)["module"]
            optimizer_state = torch.load(folder / DDP_OPTIMIZER_FILE, map_location="cpu", weights_only=False,
                                         mmap=True)["optimizer"]
            if self.experts is not None:  # the checkpoint holds the whole experts: this rank's slice of them
                module_state, optimizer_state = self.experts.own_states(module_state, optimizer_state)
            self.module.load_state_dict(module_state)
            self.optimizer.load_state_dict(optimizer_state)
            self.load_engine_state(folder)

    @classmethod
    def holds_checkpoint(cls, folder: Path) -> bool:
        return (folder / DDP_MODEL_FILE).is_file()

    @classmethod
    def read_model_state(cls, folder: Path, *, lazy: bool) -> dict:
        """Rank 0's state dict, fp32."""
        return torch.load(folder / DDP_MODEL_FILE, map_location="cpu", weights_only=False, mmap=True)["module"]


