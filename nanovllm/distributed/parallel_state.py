"""The tensor-parallel group object handed to every parallel layer.

Layers never read rank or world size from globals: they get a `TPGroup`. With
`process_group=None` the collectives are no-ops, which lets tests build rank-0 and
rank-1 copies of a layer in one process and combine their outputs by hand.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    process_group: Any = None  # a torch.distributed group when ranks are real processes

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


SINGLE = TPGroup()
