"""The attention layer: reshapes heads and delegates to the step's attention backend.

The model runner binds `k_cache`/`v_cache` (one layer's slice of the paged cache) after
allocating the cache; until then the layer cannot run.

Under `torch.compile` the backend call goes through the custom op `nanovllm::attention`,
which the compiler sees as one opaque call that writes this layer's cache: the step's
metadata (Python lists, per-step ints) stays outside the graph, so one compiled graph serves
every step, and every layer of every model of the same shape.
"""

import torch
from torch import nn

from nanovllm.attention.base import get_forward_context


class Attention(nn.Module):
    """`sliding_window`: a query sees only the last that many positions, its own included;
    `logit_softcap`: scores become cap * tanh(scores / cap) before the softmax. Both kept as the
    backends take them, 0 for none."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window: int = sliding_window or 0
        self.logit_softcap: float = logit_softcap or 0.0
        self.k_cache = self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H*D], k/v: [T, KVH*D] -> [T, H*D]."""
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        attend = torch.ops.nanovllm.attention if torch.compiler.is_compiling() else _attention
        o = attend(q, k, v, self.k_cache, self.v_cache, self.scale, self.sliding_window, self.logit_softcap)
        return o.reshape(-1, self.num_heads * self.head_dim)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scale: float, window: int, softcap: float) -> torch.Tensor:
    ctx = get_forward_context()
    return ctx.backend.forward(q, k, v, k_cache, v_cache, ctx.metadata, scale, window, softcap)


# Defined through torch.library.Library rather than custom_op: the same op at a fraction of the
# call overhead, which counts once per layer and step. The compiler calls it on
# the cache tensors themselves: declared mutations of graph inputs stay in place, no copies.
_lib = torch.library.Library("nanovllm", "DEF")
_lib.define("attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, float scale, "
            "int window, float softcap) -> Tensor")
_lib.impl("attention", _attention, "CompositeExplicitAutograd")


@torch.library.register_fake("nanovllm::attention")
def _(q, k, v, k_cache, v_cache, scale, window, softcap):
    return torch.empty_like(q)
