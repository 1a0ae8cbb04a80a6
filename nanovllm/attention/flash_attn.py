"""Attention through flash-attn 2 (CUDA, fp16/bf16), used when it is installed and supports
the KV block size.

Importing this module fails without the `flash_attn` package; the CUDA platform then picks Triton.
New K/V go into the cache with the Triton store kernel (slot -1 writes nowhere). Decode-only
steps call `flash_attn_with_kvcache` (split-KV decoding, CUDA-graph safe: the metadata only
aliases the layout's tensors); steps with a prefill chunk call `flash_attn_varlen_func` over
the paged cache. Both align the causal mask bottom-right, so a chunk after a cached prefix
sees the prefix and itself up to each query's position.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from nanovllm.attention.base import AttentionBackend, BatchLayout
from nanovllm.attention.triton import store_kvcache

# flash-attn 2 reads a paged KV cache only in blocks of a multiple of 256 tokens.
PAGE_BLOCK_MULTIPLE = 256


def flash_attn_supports(dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    """flash-attn 2 needs fp16/bf16, head dims up to 256 in steps of 8, Ampere or newer,
    and paged blocks of a multiple of 256 tokens."""
    return (dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 256
            and block_size % PAGE_BLOCK_MULTIPLE == 0 and torch.cuda.get_device_capability()[0] >= 8)


@dataclass
class FlashAttnMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 = padded lane
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    cu_seqlens_k: torch.Tensor | None  # [B+1] int32; None on decode-only steps, which do not need it
    context_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_context_len: int


class FlashAttnBackend(AttentionBackend):
    supports_cuda_graphs = True

    def prepare(self, layout: BatchLayout) -> FlashAttnMetadata:
        cu_seqlens_k = None
        if layout.max_query_len > 1:
            cu_seqlens_k = F.pad(layout.context_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return FlashAttnMetadata(layout.slot_mapping, layout.cu_seqlens_q, cu_seqlens_k, layout.context_lens,
                                 layout.block_tables, layout.max_query_len, layout.max_context_len)

    def forward(self, q, k, v, k_cache, v_cache, metadata: FlashAttnMetadata, scale, window, softcap):
        store_kvcache(k, v, k_cache, v_cache, metadata.slot_mapping)
        # flash-attn's window counts the keys left of the query's own: (window - 1, 0); -1 is none.
        options = dict(softmax_scale=scale, causal=True, block_table=metadata.block_tables,
                       window_size=(window - 1, 0) if window else (-1, -1), softcap=softcap)
        if metadata.cu_seqlens_k is None:  # decode: one query token per sequence
            out = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=metadata.context_lens,
                                          **options)
            return out.squeeze(1)
        return flash_attn_varlen_func(q, k_cache, v_cache, metadata.cu_seqlens_q, metadata.cu_seqlens_k,
                                      metadata.max_query_len, metadata.max_context_len, **options)
