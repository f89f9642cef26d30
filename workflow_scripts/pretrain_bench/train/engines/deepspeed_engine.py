"""DeepSpeed (ZeRO 0-3, offload) behind `Engine`, with what only it needs: its comms-logger total, the Muon stand-ins,
the universal copy of a checkpoint for another world size."""
from __future__ import annotations

import warnings
from datetime import timedelta
from pathlib import Path

import torch

from pretrain_bench.train.checkpoints.files import UNIVERSAL_SUFFIX, CheckpointError, tag_for
from pretrain_bench.train.engines.base import Engine, EngineRun, lr_schedule, mmap_loads, number

DS_MODEL_FILE = "mp_rank_00_model_states.pt"  # DeepSpeed's module (and, at ZeRO-0, its whole state)


def fused_adam_prebuilt() -> bool:
    """Whether this DeepSpeed install ships a compiled FusedAdam (DS_BUILD_FUSED_ADAM=1 at install); otherwise it
    would be compiled at the first step with nvcc, which a machine without the CUDA toolkit does not have."""
    try:
        from deepspeed.git_version_info import installed_ops

        return bool(installed_ops.get("fused_adam"))
    except ImportError:
        return False


def describe_cpu_once() -> dict | None:
    """py-cpuinfo's description of this machine's CPU, asked once in this process and its forks: from then on
    `cpuinfo.get_cpu_info` returns a copy of it. None where py-cpuinfo fails: then it is left as it is, and DeepSpeed
    falls back to `lscpu` as it does without this.

    py-cpuinfo starts a fresh interpreter for every call (`cpuinfo.py --json`, which runs `file`, `uname` and `lscpu`:
    about 1 CPU-s), and a CPU rank under train.offload_optimizer cpu made three: two as DeepSpeed's CPU Adam op builder
    chose its compiler flags, one in DeepSpeedCPUAdam itself (its CPU vendor). Asked in torchrun's agent before it
    forks the ranks, the answer is the same CPU's for every rank. Hand-written because py-cpuinfo keeps no answer."""
    import copy

    import cpuinfo

    asked = getattr(cpuinfo.get_cpu_info, "described", None)
    if asked is None:
        try:
            asked = cpuinfo.get_cpu_info()
        except Exception:
            return None

        def get_cpu_info() -> dict:
            return copy.deepcopy(asked)

        get_cpu_info.described = asked
        cpuinfo.get_cpu_info = get_cpu_info
    return copy.deepcopy(asked)


_comm_total_ms = 0.0  # deepspeed_comm_ms's running total: what earlier calls took out of DeepSpeed's logger
_all_to_all_total_ms = 0.0  # of which AutoEP's all-to-alls (kept apart: all_to_all_ms)
ALL_TO_ALL_OPS = ("all_to_all_single", "all_to_all")  # deepspeed.comm op names (AutoEP's dispatch and combine)


def deepspeed_all_to_all_ms() -> float:
    """Total milliseconds of deepspeed.comm all-to-alls on this rank so far (within deepspeed_comm_ms's total)."""
    deepspeed_comm_ms()
    return _all_to_all_total_ms


def deepspeed_comm_ms() -> float:
    """Total milliseconds spent in deepspeed.comm collectives on this rank so far (DeepSpeed's comms logger).

    deepspeed.comm times each op name with one of its synchronised timers and appends the timer's running total (not
    the op's own duration) to the logger's lists, so the largest value per op name is that op's time since the timer
    was last reset. Left alone, nothing is ever reset: every op appends to the lists, and each op's
    `elapsed(reset=False)` re-reads every start/stop pair its timer holds (on CUDA one event query each), so a
    collective costs more with every one before it. So each call takes the per-op totals, resets those timers and
    empties the logger, and keeps the sum here: called every step, the records held stay one step's worth.
    """
    global _comm_total_ms, _all_to_all_total_ms
    from deepspeed.comm import comm as ds_comm

    logger = getattr(ds_comm, "comms_logger", None)
    recorded = getattr(logger, "comms_dict", {})
    for name, by_size in recorded.items():
        spent = max((max(record[1]) for record in by_size.values() if record[1]), default=0.0)
        _comm_total_ms += spent
        if name in ALL_TO_ALL_OPS:
            _all_to_all_total_ms += spent
        ds_comm.timers(name).reset()  # the logger's record names are the timers' names (comm.timed_op)
    if logger is not None:
        logger.reset_data()
    return _comm_total_ms


MUON_MODULES = ("deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.zero.muon.original_muon")


def skip_muon_import() -> None:
    """Stand in for DeepSpeed's Muon modules in a run whose optimizer is not Muon.

    DeepSpeed's ZeRO optimizers import them at set-up and again in every gradient reduction (stage_1_and_2's
    average_tensor and _get_flat_partition_unpadded), only to test `isinstance(optimizer, MuonWithAuxAdam)` or to
    have `muon_update` at hand for parameters marked `use_muon`, which only a Muon optimizer marks. Importing them
    applies torch.compile to Muon's kernels, which loads inductor's compiler: about 0.9 s of every ZeRO-1/2 rank's
    start on CPU. Hand-written because DeepSpeed has no switch for it. The stand-ins hold a class that no optimizer
    is an instance of and a `muon_update` that refuses to run; a process that already imported the real modules
    keeps them."""
    import sys
    import types

    if any(name in sys.modules for name in MUON_MODULES):
        return

    class MuonWithAuxAdam:  # never instantiated: DeepSpeed's isinstance tests are all it is for
        pass

    def muon_update(*args, **kwargs):
        raise RuntimeError("DeepSpeed's Muon update was called in a run built without Muon "
                           "(pretrain_bench.train.engines.deepspeed_engine.skip_muon_import stands in for it)")

    for name in MUON_MODULES:
        module = types.ModuleType(name, "pretrain-bench's stand-in: this run's optimizer is not Muon")
        module.MuonWithAuxAdam, module.muon_update, module.adam_update = MuonWithAuxAdam, muon_update, muon_update
        sys.modules[name] = module


# torch.optim.Optimizer's methods that torch wraps with torch._disable_dynamo, which imports torch._dynamo on the
# first call of each (the wrapper keeps dynamo from tracing them inside a compiled region).
DYNAMO_WRAPPED_OPTIMIZER_METHODS = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")
# Attribute where torch._disable_dynamo caches, on the wrapped function, what to call instead of it.
_DISABLE_CACHE = "__dynamo_disable"


def optimizers_without_dynamo() -> list[str]:
    """Keep torch's optimizers from importing torch._dynamo in a rank that compiles nothing; returns the wrappers
    that now skip it, empty where this torch's wrappers are not shaped as below (nothing is changed then).

    Nothing else in an eager DeepSpeed rank imports torch._dynamo, whose import is about a third of the rank's
    start-up (1.1 CPU-s on one rank, more where ranks share cores; README "Process start-up"): torch's Optimizer
    does, in two wrappers whose work is for compiled code only. Hand-written because torch has no switch for either:
    - the methods above are wrapped by torch._disable_dynamo, which imports dynamo at the first call to build a
      version of the method that dynamo does not trace, and caches it on the method. Here the method itself is
      cached instead, which is what that version runs outside a compiled region;
    - Adam's (so AdamW's) `step` is wrapped by `_use_grad_for_differentiable`, which imports dynamo at every call
      to place graph breaks (no-ops outside a compiled region) around the step, run in the grad mode of the
      optimizer's `differentiable`. Here `step` runs in that grad mode, without the graph breaks.
    The optimizer's arithmetic is untouched: the same kernels, the same bits. For ranks with train.compile off only:
    a compiled model imports dynamo anyway, and then torch's wrappers stay. ZeRO-3 imports it too (its parameter
    hooks are wrapped by torch.compiler.disable), as do DDP and FSDP (DistributedDataParallel.__init__, fully_shard's
    DTensor conversion): ZeRO-0, 1 and 2 ranks gain, with or without optimizer offload."""
    import functools

    import torch
    from torch.optim import Adam, Optimizer

    changed = []
    for name in DYNAMO_WRAPPED_OPTIMIZER_METHODS:
        method = getattr(Optimizer, name)
        wrapped = getattr(method, "__wrapped__", None)
        if wrapped is not None and _made_by(method, "_disable_dynamo"):
            if getattr(wrapped, _DISABLE_CACHE, None) is None:
                setattr(wrapped, _DISABLE_CACHE, wrapped)
            changed.append(f"Optimizer.{name}")
    step = Adam.step
    wrapped = getattr(step, "__wrapped__", None)
    if wrapped is not None and _made_by(step, "_use_grad_for_differentiable"):
        def eager_step(self, *args, **kwargs):
            with torch.set_grad_enabled(self.defaults["differentiable"]):
                return wrapped(self, *args, **kwargs)

        Adam.step = functools.update_wrapper(eager_step, wrapped)
    if _made_by(Adam.step, "optimizers_without_dynamo"):
        changed.append("Adam.step")
    return changed


def _made_by(function, decorator: str) -> bool:
    """Whether `function` is the wrapper that torch's `decorator` returns (its code's qualified name, e.g.
    `_disable_dynamo.<locals>.inner`: functools.wraps gives the wrapper the wrapped function's own names)."""
    code = getattr(function, "__code__", None)
    return getattr(code, "co_qualname", "").startswith(f"{decorator}.<locals>.")


class DeepSpeedEngine(Engine):
    """DeepSpeed (ZeRO 0-3, offload) from the ds_config of the settings (settings.deepspeed_config)."""

    comm_method = ("DeepSpeed comms_logger (prof_all) on rank 0: wall-clock of every deepspeed.comm collective "
                   "(synchronised), summed over steady-state steps ÷ their step time; includes time spent waiting "
                   "for slower ranks")

    rank_libraries = ("deepspeed", "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage_1_and_2")

    @classmethod
    def preload(cls, settings) -> None:
        """Also DeepSpeed's probe of its ops (which runs compilers) and its shared-memory collectives op, which
        init_distributed loads on CPU, and under train.offload_optimizer cpu the CPU Adam op that DeepSpeedCPUAdam
        loads: all are kept by DeepSpeed per process (OpBuilder._loaded_ops), so forked ranks find them done."""
        from pretrain_bench.train.launcher import wait_out_stale_build_locks

        super().preload(settings)
        wait_out_stale_build_locks()
        from deepspeed.comm.torch import build_shm_op

        build_shm_op()
        if settings.offload_optimizer == "cpu":
            from deepspeed.accelerator import get_accelerator

            describe_cpu_once()
            try:
                get_accelerator().create_op_builder("CPUAdamBuilder").load(verbose=False)
            except Exception:  # each rank tries again, and fails with DeepSpeedCPUAdam's message as a fresh one does
                pass

    @staticmethod
    def init_distributed(backend: str, timeout: timedelta) -> None:
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)

    @classmethod
    def build_precision(cls, settings) -> str:
        # DeepSpeed keeps the module in the training precision; its optimizer holds the fp32 master copy.
        return settings.precision

    def __init__(self, model, settings, run: EngineRun):
        import deepspeed

        from pretrain_bench.train.engines.spec import deepspeed_config

        self.ds_config = deepspeed_config(settings, run.device, run.total_steps, fused_adam=fused_adam_prebuilt(),
                                       pin_memory=run.pin_memory, comms_logger=run.measure_comm)
        if "expert_parallel" in self.ds_config:
            # the router's scale, given: AutoEP otherwise reads it off model.config into its route_scale and then
            # warns, once per MoE layer and rank, that the value it read overrides the one it set
            self.ds_config["expert_parallel"]["routed_scaling_factor"] = model.config.routed_scaling_factor
        if run.reshape:  # DDP's files and FSDP's DCP folder load at any world size; DeepSpeed's through a universal one
            self.ds_config["checkpoint"] = {"load_universal": True}
        if self.ds_config["optimizer"]["type"].lower() != "muon":
            skip_muon_import()
        if not settings.compile:
            optimizers_without_dynamo()
        # DeepSpeed 0.19's ZeRO-1/2 step all-gathers the updated partitions with
        # torch.distributed.all_gather_into_tensor, which torch 2.13 marks deprecated: a FutureWarning (two lines)
        # per rank in every training log, about a call the user cannot change.
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                                category=FutureWarning)
        self.settings, self.reshape, self.measure_comm = settings, run.reshape, run.measure_comm
        if run.config_dir is not None:
            self.write_config(run.config_dir)
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                    config=self.ds_config,
                                                    lr_scheduler=lr_schedule(settings, run.total_steps))
        if settings.expert_parallel > 1:  # AutoEP replaced the MoE layers: the model's balancing follows
            from pretrain_bench.train.engines.autoep import attach

            attach(self.engine.module)
        if settings.zero_stage == 0 and self.engine.dp_world_size == 1:
            # Alone, ZeRO-0's backward would still flatten every gradient, all-reduce it with itself and copy it
            # back: about 7 % of a step on CPU (bench/bench_trainer.py), for an average over one rank, which is the
            # gradient itself. ZeRO-1/2/3 reduce through their optimizer's own hooks and keep this path.
            self.engine.enable_backward_allreduce = False

    def write_config(self, folder: Path) -> None:
        """ds_config.json: the config DeepSpeed was given (train.deepspeed merged in)."""
        import json

        (Path(folder) / "ds_config.json").write_text(json.dumps(self.ds_config, indent=2))

    def __call__(self, **inputs):
        return self.engine(**inputs)

    def comm_ms(self) -> float:
        """The collectives' milliseconds but AutoEP's all-to-alls (all_to_all_ms)."""
        return deepspeed_comm_ms() - (deepspeed_all_to_all_ms() if self.settings.expert_parallel > 1 else 0.0)

    def all_to_all_ms(self) -> float | None:
        """AutoEP's all-to-alls (dispatch and combine, forward and backward, and the count exchanges) in
        milliseconds so far, timed by DeepSpeed's comms logger as the other collectives; None without expert
        parallelism or where the comms logger is off (EngineRun.measure_comm)."""
        return deepspeed_all_to_all_ms() if self.settings.expert_parallel > 1 and self.measure_comm else None

    def backward(self, loss) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()

    def eval(self) -> None:
        self.engine.eval()

    def train(self) -> None:
        self.engine.train()

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def grad_norm(self):
        return self.engine.get_global_grad_norm()

    @property
    def skipped_steps(self) -> int:
        return self.engine.skipped_steps

    def loss_scale(self) -> float | None:
        return number(getattr(self.engine.optimizer, "cur_scale", None) if self.settings.precision == "fp16" else None)

    def ran(self) -> dict:
        """Precision, ZeRO stage and batch as DeepSpeed parsed them from the merged ds_config (train.deepspeed
        included): what the summary reports, so it cannot disagree with what ran."""
        engine = self.engine
        precision = "fp16" if engine.fp16_enabled() else "bf16" if engine.bfloat16_enabled() else "fp32"
        if engine.torch_autocast_enabled():
            precision += f"+autocast({str(engine.torch_autocast_dtype()).removeprefix('torch.')})"
        return {"precision": precision, "zero_stage": int(engine.zero_optimization_stage()),
                "micro_batch_size": engine.train_micro_batch_size_per_gpu(),
                "grad_accum_steps": engine.gradient_accumulation_steps(),
                "global_batch_size": engine.train_batch_size()}

    def save(self, folder: Path, writer, client_state: dict) -> None:
        """Every file DeepSpeed writes goes through `writer` (hashed while written)."""
        engine = self.engine
        writer.zipfile = getattr(engine.checkpoint_engine, "zipfile_serialization", True)
        engine.checkpoint_engine.save = writer.save
        try:
            engine.save_checkpoint(str(folder.parent), tag=folder.name, client_state=client_state)
        finally:
            del engine.checkpoint_engine.save  # back to the engine's own method

    def checkpoint_folder(self, root: Path, step: int) -> Path:
        """At another world size: a universal copy of the checkpoint (rank 0 converts it once, the others wait)."""
        if self.reshape:
            return Path(root) / universal_tag(root, step)
        return super().checkpoint_folder(root, step)

    def load(self, folder: Path) -> None:
        """DeepSpeed's optimizer shards are mapped, not copied, beside the states already allocated (mmap_loads
        gives what outlives the load memory of its own, so a pruned checkpoint's disk is freed)."""
        with mmap_loads():
            loaded, _ = self.engine.load_checkpoint(str(folder.parent), tag=folder.name)
            if loaded is not None and self.reshape:
                self.load_buffers(folder)
        if loaded is None:  # DeepSpeed only warns when it finds nothing to load
            import torch.distributed as dist

            raise FileNotFoundError(f"DeepSpeed found no checkpoint files of rank {dist.get_rank()} in {folder}")

    def load_buffers(self, folder: Path) -> None:
        """The module's saved buffers (a DeepSeek router's auxiliary-loss-free bias) into the model, from universal
        checkpoint `folder`. DeepSpeed 0.19.8 restores only parameters from a universal checkpoint (its engine skips
        the module's state dict under checkpoint.load_universal), so without this a run resumed at another world size
        would route with zero biases. ds_to_universal copies the model-states files, whose module state dict holds
        every persistent buffer (the same on every rank: any file serves)."""
        states = sorted(folder.glob("*model_states.pt"))
        if not states:
            raise FileNotFoundError(f"{folder} has no model-states file to restore the module's buffers from")
        module = torch.load(states[0], map_location="cpu", weights_only=False, mmap=True)["module"]
        with torch.no_grad():
            for name, buffer in self.engine.module.named_buffers():
                if name in module:
                    buffer.copy_(module[name])

    @staticmethod
    def zero_partitioned(folder: Path) -> bool:
        """ZeRO-1/2/3: the optimizer states are partitioned over the ranks (zero_pp_rank_* files)."""
        return bool(list(folder.glob("*optim_states.pt")) and (list(folder.glob("zero_pp_rank_*"))
                                                               or list(folder.glob("bf16_zero_pp_rank_*"))))

    @classmethod
    def holds_checkpoint(cls, folder: Path) -> bool:
        return (folder / DS_MODEL_FILE).is_file() or cls.zero_partitioned(folder)

    @classmethod
    def read_model_state(cls, folder: Path, *, lazy: bool) -> dict:
        """ZeRO-1/2/3: the partitions merged by DeepSpeed's zero_to_fp32 (with AutoEP's experts: by
        ds_to_universal, autoep.consolidate); ZeRO-0: the model file's module."""
        from pretrain_bench.train.engines.autoep import consolidate, is_autoep_checkpoint

        if is_autoep_checkpoint(folder):
            return consolidate(folder)
        if cls.zero_partitioned(folder):
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            return get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name, lazy_mode=lazy)
        return torch.load(folder / DS_MODEL_FILE, map_location="cpu", weights_only=False, mmap=lazy)["module"]


def universal_tag(root: Path, step: int) -> str:
    """Tag of a universal (world-size-independent) copy of checkpoint `step`, made once by rank 0.

    DeepSpeed's ds_to_universal merges the ZeRO partitions into per-parameter files that any world size can load
    (with `checkpoint.load_universal` in the DeepSpeed config). The copy is written to a temporary folder and
    renamed when complete; the original checkpoint is never modified.
    """
    import os
    import shutil
    import subprocess
    import sys

    import torch.distributed as dist

    tag = f"{tag_for(step)}{UNIVERSAL_SUFFIX}"
    target = Path(root) / tag
    if dist.get_rank() == 0 and not (target / "zero").is_dir():
        tmp = Path(root) / f"{tag}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        result = subprocess.run(
            [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
             str(Path(root) / tag_for(step)), "--output_folder", str(tmp), "--inject_missing_state",
             "--num_extract_workers", "1", "--num_merge_workers", "1"],
            capture_output=True, text=True)
        if result.returncode:
            raise CheckpointError(f"converting {Path(root) / tag_for(step)} to a universal checkpoint failed:\n"
                                  f"{result.stderr[-2000:]}")
        os.replace(tmp, target)
    dist.barrier()
    return tag


