"""The attention layer: reshapes heads and delegates to the step's attention backend.

The model runner binds `k_cache`/`v_cache` (one layer's slice of the paged cache) after
allocating the cache; until then the layer cannot run.
"""

import torch
from torch import nn

from nanovllm.attention.base import get_forward_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache = self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H*D], k/v: [T, KVH*D] -> [T, H*D]."""
        ctx = get_forward_context()
        o = ctx.backend.forward(
            q.view(-1, self.num_heads, self.head_dim),
            k.view(-1, self.num_kv_heads, self.head_dim),
            v.view(-1, self.num_kv_heads, self.head_dim),
            self.k_cache, self.v_cache, ctx.metadata, self.scale,
        )
        return o.reshape(-1, self.num_heads * self.head_dim)
