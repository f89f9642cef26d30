"""PyTorch FSDP2 (fully_shard) behind `Engine`, and the reading of its torch.distributed.checkpoint folder."""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch

from pretrain_bench.train.engines.base import engine_state_file
from pretrain_bench.train.engines.torch_engine import TorchEngine

DCP_FOLDER = "dcp"
# train.expert_parallel: the routed experts, whole (every rank's slice gathered on rank 0), with their AdamW states
EXPERTS_FILE = "experts.pt"


class FSDPEngine(TorchEngine):
    """FSDP2 (torch.distributed.fsdp.fully_shard) on every decoder layer and the whole model: fp32 shards of the
    parameters, gradients and AdamW states (ZeRO-3's layout); bf16/fp16 compute through MixedPrecisionPolicy with
    fp32 gradient reduction (fp16 with the sharded gradient scaler)."""

    rank_libraries = ("torch.distributed.fsdp",)

    def wrap(self, model):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device, (dist.get_world_size(),))
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.settings.precision]
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        self.split_experts(model)
        # split experts stay whole on their ranks, outside FSDP (expert_shards.py); 16-bit compute casts them in
        # the MoE layer (native_deepseek.Experts.grouped_rows) as FSDP's policy casts the rest
        ignored = set(self.experts.params) if self.experts is not None else None
        for layer in model.model.layers:  # one all-gather per decoder layer, freed after its use
            fully_shard(layer, mesh=mesh, mp_policy=policy, ignored_params=ignored)
        fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored)  # embeddings, final norm and head
        return model

    def optimizer_params(self):
        """Split experts apart from the rest: AdamW's fused (and foreach) kernels take one param group's tensors in
        one call, and cannot mix FSDP's DTensors with the experts' plain tensors."""
        if self.experts is None:
            return self.model.parameters()
        ids = {id(p) for p in self.experts.params}
        return [{"params": [p for p in self.model.parameters() if id(p) not in ids]},
                {"params": list(self.experts.params)}]

    def optimizer_kwargs(self) -> dict:
        # fp16: ShardedGradScaler hands a fused optimizer a found_inf of shape (1,) where fused AdamW expects a
        # 0-dim tensor ("output with shape [] doesn't match the broadcast shape [1]" at the first step; torch
        # distributed/fsdp/sharded_grad_scaler.py against optim/adam.py), so fp16 steps through the foreach kernel
        if self.settings.precision == "fp16":
            return {"foreach": True}
        return super().optimizer_kwargs()

    def make_scaler(self):
        # the plain GradScaler checks only this rank's gradient shards for inf/NaN; the sharded one agrees
        # across ranks, so every rank skips the same steps
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(self.device)

    def sync_gradients(self, boundary: bool):
        self.model.set_requires_gradient_sync(boundary)
        return contextlib.nullcontext()

    def save(self, folder: Path, writer, client_state: dict) -> None:
        """engine_rank<r>.pt passes through `writer` (hashed while written). The DCP folder is written by
        torch.distributed.checkpoint's own FileSystemWriter, which takes no file object to write through: its files
        are hashed when the checkpoint is committed (checkpoint.write_marker reads every file of the folder that no
        writer recorded), and the marker lists them, with their sizes and sha256, like every other file."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        experts = None
        if self.experts is not None:  # out of the DCP folder, whole, into EXPERTS_FILE
            experts = self.experts.whole_named(model_state, optimizer_state, saving=dist.get_rank() == 0)
        try:
            dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=str(folder / DCP_FOLDER))
        except CheckpointException as error:  # a BaseException: carry it as the error the save expects
            raise OSError(f"torch.distributed.checkpoint failed writing {folder / DCP_FOLDER}: {error}") from None
        if experts is not None:
            writer.save(experts, folder / EXPERTS_FILE)
        writer.save(self.engine_state(), folder / engine_state_file(dist.get_rank()))

    def load(self, folder: Path) -> None:
        """torch.distributed.checkpoint reads through buffers, which cannot be mapped."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        if self.experts is not None:  # not in the DCP folder: this rank's slice of EXPERTS_FILE's whole experts
            for name in self.experts.names:
                model_state.pop(name)
                optimizer_state["state"].pop(name, None)
        state = {"model": model_state, "optim": optimizer_state}
        try:
            dcp.load(state, checkpoint_id=str(folder / DCP_FOLDER))  # resharded to this world size as needed
        except CheckpointException as error:
            raise RuntimeError(f"torch.distributed.checkpoint failed reading {folder / DCP_FOLDER}: {error}") from None
        if self.experts is not None:
            modules, optimizers = self.experts.own_named(torch.load(folder / EXPERTS_FILE, map_location="cpu",
                                                                    weights_only=False))
            state["model"].update(modules)
            state["optim"]["state"].update(optimizers)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.load_engine_state(folder)

    @classmethod
    def holds_checkpoint(cls, folder: Path) -> bool:
        return (folder / DCP_FOLDER / ".metadata").is_file()

    @classmethod
    def read_model_state(cls, folder: Path, *, lazy: bool) -> dict:
        """The whole model: the DCP folder's tensors, and an expert-parallel run's experts from EXPERTS_FILE."""
        state = read_dcp_model(folder / DCP_FOLDER)
        if (folder / EXPERTS_FILE).is_file():
            state.update(torch.load(folder / EXPERTS_FILE, map_location="cpu", weights_only=False,
                                    mmap=True)["module"])
        return state


def read_dcp_model(folder: Path) -> dict:
    """The model's full state dict from a torch.distributed.checkpoint folder written by FSDPEngine, in one process
    (no process group): tensors are allocated from the folder's metadata and filled by dcp.load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(folder))
    metadata = reader.read_metadata().state_dict_metadata
    state = {key[len("model."):]: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.items()
             if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    nested = {"model": state}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(nested, storage_reader=reader, no_dist=True)
    return nested["model"]

