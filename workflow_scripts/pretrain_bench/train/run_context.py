"""What the launcher decides for every rank of one job, handed to each rank on its command line: `LaunchContext`.

The launcher (pretrain_bench.train.launcher) resolves the device, divides the cores and probes pinned memory in the
job's own GPU slot; pretrain.py reads the result back with `--context` into the same frozen dataclass.

CPU ranks are pinned to disjoint cores (`pin_rank`, first thing in each rank): rank k of the node runs on the k-th
block of `threads_per_rank` cores of the node's usable cores, with as many torch/OpenMP threads. Unpinned, each
rank's OpenMP threads spread over every core and collapse under contention (a 1-rank cell on a busy 2-core machine
ran 15× slower unpinned than pinned to one core). With more ranks than cores there are no disjoint blocks: every
rank runs one thread on all the cores, which the OS balances, and the run is recorded as oversubscribed.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from pretrain_bench.core.io import key_differences


def usable_cpus() -> tuple[int, ...]:
    """The CPU ids this process may run on (its affinity mask: a scheduler's or taskset's share), in order."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def core_blocks(cpus: Sequence[int], ranks: int) -> list[tuple[int, ...]]:
    """The cores of each of `ranks` ranks: disjoint blocks of len(cpus) // ranks cores (cores left over stay idle).
    With more ranks than cores, every rank gets all of them (oversubscribed): pinned in turn, two ranks sharing one
    core would each get half of it while another core ran one rank, and the step waits for the slowest rank."""
    cpus = tuple(cpus)
    if ranks > len(cpus):
        return [cpus] * ranks
    size = len(cpus) // ranks
    return [cpus[rank * size:(rank + 1) * size] for rank in range(ranks)]


@dataclass(frozen=True)
class LaunchContext:
    """The launcher's decisions for the ranks of one job."""

    device: str  # cpu | cuda: what the launcher resolved train.device to
    threads_per_rank: int  # torch and OpenMP threads of each rank: max(1, cores // ranks)
    oversubscribed: bool  # more ranks than cores on this node: 1 thread per rank, timings contended
    pin_memory: bool  # host memory may be pinned (False where the launcher's probe in the job's slot could not pin)
    cpus: tuple = ()  # the node's usable cores, divided among its ranks (core_blocks); () where ranks are not pinned
    ranks: int = 1  # ranks on this node

    @classmethod
    def for_job(cls, device: str, ranks: int, cores: int, cpus: Sequence[int] | None = None) -> LaunchContext:
        """`ranks` ranks on `cores` cores of this node (the ids `cpus`, by default 0..cores-1); pinning of host
        memory allowed until a probe says otherwise. CPU ranks are pinned to their cores; CUDA ranks are not."""
        cpus = tuple(range(cores)) if cpus is None else tuple(cpus)
        return cls(device=device, threads_per_rank=max(1, cores // ranks), oversubscribed=ranks > cores,
                   pin_memory=True, cpus=cpus if device == "cpu" else (), ranks=ranks)

    def rank_cores(self, local_rank: int) -> tuple[int, ...] | None:
        """The cores rank `local_rank` of this node is pinned to; None where ranks are not pinned."""
        return core_blocks(self.cpus, self.ranks)[local_rank] if self.cpus else None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> LaunchContext:
        """The context `to_json` wrote; a missing (required) or unknown field is refused by name."""
        values = json.loads(text)
        missing, unknown = key_differences(cls, values)
        if missing or unknown:
            raise ValueError(f"launch context {text!r}: missing {missing}, unknown {unknown}")
        return cls(**{**values, "cpus": tuple(values.get("cpus", ()))})


def pin_rank(context: LaunchContext, local_rank: int) -> tuple[int, ...] | None:
    """Pin this process to its cores (LaunchContext.rank_cores), before torch starts its threads; returns them."""
    cores = context.rank_cores(local_rank)
    if cores is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    return cores


def rank_placement(rank: int, threads: int) -> dict:
    """Where this rank ran: its host, the cores it could run on (its affinity) and its torch threads."""
    import socket

    return {"rank": rank, "host": socket.gethostname(), "cores": list(usable_cpus()), "threads": threads}
