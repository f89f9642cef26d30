"""What the launcher decides for every rank of one job, handed to each rank on its command line: `LaunchContext`.

The launcher (pretrain_bench.launcher) resolves the device, divides the cores and probes pinned memory in the job's
own GPU slot; pretrain.py reads the result back with `--context` into the same frozen dataclass.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class LaunchContext:
    """The launcher's decisions for the ranks of one job."""

    device: str  # cpu | cuda: what the launcher resolved train.device to
    threads_per_rank: int  # torch and OpenMP threads of each rank: max(1, cores // ranks)
    oversubscribed: bool  # more ranks than cores on this node: 1 thread per rank, timings contended
    pin_memory: bool  # host memory may be pinned (False where the launcher's probe in the job's slot could not pin)

    @classmethod
    def for_job(cls, device: str, ranks: int, cores: int) -> LaunchContext:
        """`ranks` ranks on `cores` cores of this node; pinning allowed until a probe says otherwise."""
        return cls(device=device, threads_per_rank=max(1, cores // ranks), oversubscribed=ranks > cores,
                   pin_memory=True)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> LaunchContext:
        """The context `to_json` wrote; a missing or unknown field is refused by name."""
        values = json.loads(text)
        names = {field.name for field in fields(cls)}
        if set(values) != names:
            raise ValueError(f"launch context {text!r}: missing {sorted(names - set(values))}, "
                             f"unknown {sorted(set(values) - names)}")
        return cls(**values)
