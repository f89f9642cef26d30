"""The routed experts split over expert-parallel ranks under the DDP and FSDP engines (train.expert_parallel): which
parameters they are, their gradients averaged over the ranks holding the same experts, the total gradient norm over
all ranks' experts, and checkpoints that hold the whole experts (gathered on save, sliced on load), so a checkpoint of
an expert-parallel run reads, exports and resumes like one of EP 1.

Neither wrapper knows experts that differ between ranks: DDP would average them over all ranks, and FSDP would shard
and gather them as one tensor of the whole world. They are left out of both (DistributedDataParallel's parameters to
ignore, fully_shard's ignored_params), kept whole on the ranks that hold them, and reduced here, once per optimizer
step.
"""
from __future__ import annotations

import torch

from pretrain_bench.train.models.expert_parallel import (
    expert_groups,
    expert_layers,
    expert_parameter_names,
    shard_experts,
)


class ExpertShards:
    """This rank's slice of every MoE layer's routed experts, and the groups it shares them with."""

    def __init__(self, model, size: int, intervals=None):
        """`intervals`: where the MoE layers mark their all-to-alls' time in flight (a CommIntervals), or None."""
        import torch.distributed as dist

        self.world, self.size = dist.get_world_size(), size
        self.group, self.data_group = expert_groups(self.world, size)
        self.place = shard_experts(model, self.group, size, dist.get_rank() % size, intervals)
        self.names = expert_parameter_names(model)
        self.params = [getattr(experts, part) for _, experts in expert_layers(model)
                       for part in ("gate_up_proj", "down_proj")]
        self.count = expert_layers(model)[0][1].count  # experts per rank and layer
        ids = {id(p) for p in self.params}
        # the experts' places in the optimizer's state dict (its parameters are the model's, in this order)
        self.indices = [i for i, p in enumerate(model.parameters()) if id(p) in ids]

    # ---- gradients ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Average the experts' gradients as DDP averages the others: each rank's gradient of its experts holds the
        contributions of its expert-parallel group's tokens (the combine's backward brought them here); summed over
        the expert-data-parallel group it holds every rank's, and ÷ world size is DDP's mean over the ranks."""
        import torch.distributed as dist

        for p in self.params:
            if p.grad is None:  # no token reached this rank's experts of a layer in any micro-step
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.data_group is not None:
            dist.all_reduce(flat, group=self.data_group)
        flat /= self.world
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    def total_norm(self, params) -> torch.Tensor:
        """The L2 norm of all gradients of the model over every rank's experts: the replicated parameters' norm on
        this rank, and the experts' squared norms summed over the expert-parallel group (each expert is on one of
        its ranks)."""
        import torch.distributed as dist

        ids = {id(p) for p in self.params}
        shared = [p.grad for p in params if p.grad is not None and id(p) not in ids]
        own = torch.nn.utils.get_total_norm([p.grad for p in self.params], 2.0).float() ** 2
        dist.all_reduce(own, group=self.group)
        rest = torch.nn.utils.get_total_norm(shared, 2.0)
        rest = rest.full_tensor() if hasattr(rest, "full_tensor") else rest  # FSDP: a DTensor over the shards
        return (rest.float() ** 2 + own).sqrt()

    # ---- checkpoints -------------------------------------------------------------------------------------------

    def rows(self) -> slice:
        return slice(self.place.first, self.place.first + self.count)

    def gather(self, tensor: torch.Tensor, saving: bool) -> torch.Tensor | None:
        """The whole (E, ...) tensor of this rank's slice (E/EP, ...) on the saving rank (None elsewhere)."""
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(self.size)] if saving else None
        dist.gather(tensor.contiguous(), parts, group=self.group, group_dst=0)
        return torch.cat(parts) if saving else None

    def whole_states(self, module_state: dict, optimizer_state: dict, saving: bool) -> tuple[dict, dict] | None:
        """The model's and the optimizer's state dicts with every expert tensor whole, on the saving rank (global
        rank 0; the other ranks of its expert-parallel group send their slices, every other group skips it)."""
        import torch.distributed as dist

        if dist.get_rank() >= self.size:  # not in the saving rank's expert-parallel group
            return None
        module_state = dict(module_state)
        for name in self.names:
            module_state[name] = self.gather(module_state[name], saving)
        state = dict(optimizer_state["state"])
        for index in self.indices:
            state[index] = {key: self.gather(value, saving) if torch.is_tensor(value) and value.dim() else value
                            for key, value in state[index].items()}
        return (module_state, {**optimizer_state, "state": state}) if saving else None

    def whole_named(self, module_state: dict, optimizer_state: dict, saving: bool) -> dict | None:
        """Takes the experts out of FQN-keyed state dicts (torch.distributed.checkpoint.state_dict's, which FSDP
        saves with torch.distributed.checkpoint: a plain tensor there is taken for one replicated on every rank, so
        one rank's slice would stand for all) and returns them whole on the saving rank: {"module": {name: tensor},
        "optimizer": {name: {key: value}}} (None elsewhere). The dicts are changed in place."""
        import torch.distributed as dist

        module = {name: module_state.pop(name) for name in self.names}
        optimizer = {name: optimizer_state["state"].pop(name) for name in self.names
                     if name in optimizer_state["state"]}  # no state before the first step
        if dist.get_rank() >= self.size:  # not in the saving rank's expert-parallel group
            return None
        whole = {"module": {name: self.gather(tensor, saving) for name, tensor in module.items()},
                 "optimizer": {name: {key: self.gather(value, saving) if torch.is_tensor(value) and value.dim()
                                      else value for key, value in sorted(state.items())}
                               for name, state in optimizer.items()}}
        return whole if saving else None

    def own_named(self, whole: dict) -> tuple[dict, dict]:
        """whole_named's whole experts cut to this rank's slice: ({name: tensor}, {name: optimizer state})."""
        rows = self.rows()
        return ({name: tensor[rows].clone() for name, tensor in whole["module"].items()},
                {name: {key: value[rows].clone() if torch.is_tensor(value) and value.dim() else value
                        for key, value in state.items()} for name, state in whole["optimizer"].items()})

    def own_states(self, module_state: dict, optimizer_state: dict) -> tuple[dict, dict]:
        """Whole state dicts (a checkpoint's) with every expert tensor cut to this rank's slice (copies: nothing
        keeps the checkpoint's file mapped)."""
        rows = self.rows()
        module_state = dict(module_state)
        for name in self.names:
            module_state[name] = module_state[name][rows].clone()
        state = dict(optimizer_state["state"])
        for index in self.indices:
            state[index] = {key: value[rows].clone() if torch.is_tensor(value) and value.dim() else value
                            for key, value in state[index].items()}
        return module_state, {**optimizer_state, "state": state}
