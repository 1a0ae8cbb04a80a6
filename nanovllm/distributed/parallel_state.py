"""The tensor-parallel group object handed to every parallel layer, and the process groups
behind it when ranks are real processes.

Layers never read rank or world size from globals: they get a `TPGroup`. With
`process_group=None` the collectives are no-ops, which lets tests build rank-0 and
rank-1 copies of a layer in one process and combine their outputs by hand.

Across processes there are two groups, as in vLLM: the device group (nccl on CUDA, gloo
on CPU) carries the model's activations; the CPU group (gloo, the default group) carries
control traffic: the engine config, each step's inputs, the agreed KV block count.
"""

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Workers wait on the CPU group for rank 0's next step however long the user idles, so its
# collectives get no practical time limit. A dead peer still fails them at once: gloo
# reports the closed connection.
IDLE_TIMEOUT = timedelta(days=365)
# The device group only runs inside a step, where the ranks are in lockstep; a collective
# that waits this long means a rank hangs. Generous, for first-step compilation.
STEP_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    process_group: Any = None  # a torch.distributed group when ranks are real processes
    cpu_group: Any = None  # a gloo group for small CPU-side agreements (see module docstring)

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group (in place when the group is real)."""
        if self.world_size > 1 and self.process_group is not None:
            dist.all_reduce(x, group=self.process_group)
        return x

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's `x` along `dim` on rank 0; other ranks get None."""
        if self.world_size == 1 or self.process_group is None:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=dist.get_global_rank(self.process_group, 0), group=self.process_group)
        return torch.cat(parts, dim=dim) if self.rank == 0 else None

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value`, returned on every rank."""
        if self.world_size == 1 or self.cpu_group is None:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


SINGLE = TPGroup()


def init_cpu_group(store: dist.Store, rank: int, world_size: int) -> None:
    """Join the default (CPU, gloo) process group through `store`; every rank calls this first."""
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=IDLE_TIMEOUT)


def make_tp_group(device: torch.device) -> TPGroup:
    """The TPGroup over all ranks, with a device group for `device`; after init_cpu_group."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    device_group = dist.new_group(backend=backend, timeout=STEP_TIMEOUT)
    return TPGroup(dist.get_rank(), dist.get_world_size(), device_group, dist.group.WORLD)
