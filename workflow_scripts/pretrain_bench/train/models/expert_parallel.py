"""Expert parallelism (train.expert_parallel) for the native DeepSeek model: each rank of an expert-parallel group of
EP ranks keeps E/EP of every MoE layer's routed experts (`shard_experts`), and a MoE layer sends each (token, slot)
pair to the rank holding its expert and the expert's output back, with two all-to-alls (`routed_across`, GShard's
dispatch and combine, Lepikhin et al. 2020 §2.2).

Written here rather than taken from a library: DeepSpeed-MoE, Megatron-Core and torchtitan each bring their own
MoE layer, router and parallel engine, none of them the native model's fused (E, 2I, H) experts under torch's
DistributedDataParallel; what they share with this is only the dispatch and combine, which torch's autograd-aware
all_to_all_single_autograd (torch.distributed._functional_collectives, gloo and NCCL) makes a few lines.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ExpertGroup:
    """One rank's place in expert parallelism: the process group of the EP ranks that split the experts, this
    rank's index in it, and the global index of its first expert."""

    group: object  # torch.distributed.ProcessGroup
    size: int  # EP
    index: int  # this rank's position in the group
    first: int  # the global index of this rank's first expert
    # where the all-to-alls' time in flight is marked (the engine's CommIntervals: launched(), completed(span)), or None
    intervals: object = None


def expert_groups(world: int, size: int):
    """(this rank's expert-parallel group, its expert-data-parallel group or None) over `world` ranks: consecutive
    runs of `size` ranks split the experts; the ranks at the same position of every run hold the same experts and
    average their gradients (None when world == size: no other rank holds them). Every rank creates every group, in
    the same order, as torch.distributed.new_group requires."""
    import torch.distributed as dist

    rank = dist.get_rank()
    mine = data = None
    for start in range(0, world, size):  # expert-parallel groups: ranks start .. start+size-1
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
    if world > size:
        for position in range(size):  # expert-data-parallel groups: position, position+size, ...
            group = dist.new_group(list(range(position, world, size)))
            if rank % size == position:
                data = group
    return mine, data


def expert_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every MoE layer's routed experts (native_deepseek.Experts, known by its fused
    tensors: this module sits below the model's), in depth order."""
    return [(name, module) for name, module in model.named_modules()
            if hasattr(module, "parallel") and isinstance(getattr(module, "gate_up_proj", None), nn.Parameter)]


def expert_parameter_names(model: nn.Module) -> list[str]:
    """The state-dict names of the routed experts' fused tensors (gate_up_proj and down_proj of every MoE layer)."""
    return [f"{name}.{part}" for name, _ in expert_layers(model) for part in ("gate_up_proj", "down_proj")]


@torch.no_grad()
def shard_experts(model: nn.Module, group, size: int, index: int, intervals=None) -> ExpertGroup:
    """Keep this rank's E/EP experts of every MoE layer (rows index·E/EP … of the fused tensors) and route through
    the group, its all-to-alls timed by `intervals` (when given). The model was built whole from the run's seed, so
    the experts are the slices of EP 1's."""
    layers = expert_layers(model)
    count = layers[0][1].count // size
    place = ExpertGroup(group, size, index, index * count, intervals)
    for _, experts in layers:
        rows = slice(place.first, place.first + count)
        experts.gate_up_proj = nn.Parameter(experts.gate_up_proj[rows].clone())
        experts.down_proj = nn.Parameter(experts.down_proj[rows].clone())
        experts.count, experts.parallel = count, place
    return place


def _exchange(x: torch.Tensor, receive: list[int], send: list[int], group, intervals=None) -> torch.Tensor:
    """All-to-all of the rows of `x` (send[r] rows to rank r, in order) that carries gradients back the same way.
    With `intervals`, both directions are timed: the forward from launch to its wait, the backward's (autograd's
    reverse all-to-all) from when the output's gradient is ready, which launches it, to when `x`'s gradient is, which
    it produces."""
    from torch.distributed import _functional_collectives as funcol

    span = intervals.launched() if intervals is not None else None
    out = funcol.all_to_all_single_autograd(x.contiguous(), receive, send, group)
    out = out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out
    if span is not None:
        intervals.completed(span)
        if out.requires_grad and x.requires_grad:
            backward = []
            out.register_hook(lambda grad: backward.append(intervals.launched()))
            x.register_hook(lambda grad: intervals.completed(backward.pop()) if backward else None)
    return out


def _counts_exchange(out: torch.Tensor, send: torch.Tensor, group, intervals, *splits) -> None:
    """A plain (no gradient) all-to-all of `send` into `out`, timed by `intervals` when given."""
    import torch.distributed as dist

    span = intervals.launched() if intervals is not None else None
    dist.all_to_all_single(out, send, *splits, group=group)
    if span is not None:
        intervals.completed(span)


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


@torch.compiler.disable  # data-dependent split sizes
def routed_across(experts, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The routed experts' output (N, H) for (N, H) tokens `x` whose (N, K) `indices` name global experts, with the
    experts split over the expert-parallel group (`experts.parallel`). Each pair's output is weighted in float32 and
    a token's K outputs summed in float32, in the (token, slot) order the unsplit layer sums them in."""
    place = experts.parallel
    tokens, top_k = indices.shape
    slots = indices.reshape(-1)  # (S,) global expert of each (token, slot) pair
    order = torch.sort(slots, stable=True)[1]  # (S,) pairs by expert, so by the rank holding it
    # 1) how many pairs go to each rank, and which expert each is for (no gradient)
    send_counts = torch.bincount(slots // experts.count, minlength=place.size)  # (EP,)
    receive_counts = torch.empty_like(send_counts)
    _counts_exchange(receive_counts, send_counts, place.group, place.intervals)
    send, receive = send_counts.tolist(), receive_counts.tolist()
    sent_experts = slots[order]  # (S,)
    got_experts = sent_experts.new_empty(sum(receive))  # (R,)
    _counts_exchange(got_experts, sent_experts, place.group, place.intervals, receive, send)
    # 2) dispatch: the pairs' token rows to the ranks of their experts
    rows = _exchange(x[order // top_k], receive, send, place.group, place.intervals)  # (R, H) by source rank, expert
    local = got_experts - place.first  # (R,) this rank's expert of each received row
    arrange = torch.sort(local, stable=True)[1]  # (R,) by expert across source ranks
    out = experts.grouped_rows(rows[arrange], torch.bincount(local, minlength=experts.count))  # (R, H)
    if rows.requires_grad and not out.requires_grad:  # no row came here: the backward's all-to-all still runs
        out = out + rows.sum() * 0
    # 3) combine: the outputs back to the pairs' ranks, weighted, summed per token
    back = _exchange(out[_inverse(arrange)], send, receive, place.group, place.intervals)  # (S, H) in `order`
    weighted = back.float() * weights.reshape(-1)[order].unsqueeze(-1)  # (S, H) float32
    return weighted[_inverse(order)].view(tokens, top_k, -1).sum(dim=1).to(x.dtype)  # (N, H)
