"""CPU attention over the paged KV cache with the compiled kernels
(nanovllm/kernels/cpu/attention.cpp).

One kernel call per layer attends every query row of the step, decodes and prefill chunks
alike, reading each sequence's context in place through its block table: no gathered copies,
no masks, no per-sequence Python. The step's layout is the metadata as it is.

The cache is head-major ([KVH, blocks, block_size * head_dim] per layer: a sequence's
consecutive blocks of one head are one stream) and has this backend's own order inside a
block (keys pair-of-dims major, values pair-of-tokens major; see kernels/cpu/attention.cpp),
which is what lets the kernel run on bf16 dot-product instructions without shuffles; so
head_dim and block_size must be even.

No kernel here reads a slot at or past a sequence's context length, and every slot below it
was written by this step or an earlier one, so the cache may start uninitialised.
"""

import torch

from nanovllm.attention.base import AttentionBackend, BatchLayout
from nanovllm.kernels import cpu as cpu_kernels


def cpu_backend_supports(head_dim: int, block_size: int) -> bool:
    return head_dim % 2 == 0 and block_size % 2 == 0 and cpu_kernels.available()


class CPUBackend(AttentionBackend):
    needs_zeroed_cache = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
        if not cpu_backend_supports(head_dim, block_size):
            raise ValueError(f"the CPU attention backend needs the compiled CPU kernels and an even head_dim "
                             f"and block_size (got {head_dim} and {block_size})")
        super().__init__(num_heads, num_kv_heads, head_dim, block_size)

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        # Head-major: one head's blocks back to back, so consecutive block ids read as one stream.
        return (self.num_kv_heads, num_blocks, self.block_size * self.head_dim)

    def prepare(self, layout: BatchLayout) -> BatchLayout:
        return layout

    def forward(self, q, k, v, k_cache, v_cache, metadata: BatchLayout, scale, window, softcap):
        torch.ops.nanovllm_cpu.store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        o = torch.empty_like(q)
        torch.ops.nanovllm_cpu.paged_attention(o, q, k_cache, v_cache, metadata.cu_seqlens_q,
                                               metadata.context_lens, metadata.block_tables, scale, window, softcap)
        return o
