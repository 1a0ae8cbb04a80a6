"""The attention-backend interface and the per-step forward context.

A backend owns two things: turning a scheduled batch into its own metadata
(`prepare`), and running attention for one layer over the paged KV cache
(`forward`). The model runner sets the forward context around each model call; the
`Attention` layer reads it, so model code stays free of cache bookkeeping.
"""

from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class BatchLayout:
    """Per-step description of the flat token batch, built by the model runner with numpy.

    Sequences are laid out back to back in the flat batch; sequence i owns query rows
    cu_seqlens_q[i]:cu_seqlens_q[i+1] and sees context_lens[i] keys (cached + new).
    """

    query_lens: "list[int]"
    context_lens: torch.Tensor  # [B] int32, keys visible to each sequence after this step
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with -1
    max_query_len: int
    max_context_len: int


class AttentionBackend(ABC):
    # True when `prepare` only aliases the layout's tensors and `forward` neither syncs with
    # the host nor reads host values beyond the layout's ints: a decode step can then be
    # captured once and replayed over persistent input buffers (CUDA graphs).
    supports_cuda_graphs: bool = False
    # False when no kernel ever reads a cache slot that no step has written: the cache can then
    # be allocated uninitialised (no multi-GB zeroing at start-up, no pages touched until used).
    needs_zeroed_cache: bool = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's K cache (V's is the same): token-major by default. A backend
        with its own order inside a block overrides it, keeping block_size * kv_heads *
        head_dim elements per block (the memory accounting counts on that)."""
        return (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @abstractmethod
    def prepare(self, layout: BatchLayout) -> object:
        """Build this backend's metadata for one step (shared by all layers)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: object, scale: float, window: int, softcap: float) -> torch.Tensor:
        """Write the new k/v into the cache, then attend.

        q: [T, H, D], k/v: [T, KVH, D]; caches: one layer's, in this backend's `kv_cache_shape`.
        `window` > 0: a query at position p sees keys p - window + 1 .. p only (a sliding
        window), else every key up to p; `softcap` > 0: scores (after `scale`) become
        softcap * tanh(scores / softcap) before the softmax. Returns [T, H, D]. Every new k/v of the step is in the cache before any query reads it:
        the scheduler lets a sequence attend to blocks another writes in the same step (the
        later streams of an n > 1 request).
        """


@dataclass
class ForwardContext:
    backend: AttentionBackend
    metadata: object


_context: ForwardContext | None = None


@contextmanager
def forward_context(backend: AttentionBackend, metadata: object):
    global _context
    previous, _context = _context, ForwardContext(backend, metadata)
    try:
        yield
    finally:
        _context = previous


def get_forward_context() -> ForwardContext:
    if _context is None:
        raise RuntimeError("attention ran outside forward_context(); the model runner sets it for each step")
    return _context
