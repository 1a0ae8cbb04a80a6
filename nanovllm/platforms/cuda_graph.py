"""CUDA graphs for decode steps: one captured forward per batch-size bucket, replayed over
persistent input buffers.

A decode-only step (every sequence computes one token) of n sequences replays the graph of
the smallest bucket >= n. Its inputs are copied into the first n lanes of buffers allocated
once at the largest bucket; the other lanes are padding that writes nowhere (slot -1) and
reads nothing (context length 0), so their outputs are ignored. Steps with a prefill chunk,
or more sequences than the largest bucket, run eagerly. All graphs share one memory pool,
captured largest first; an output is only valid until the next replay. The pool is captured
after the KV cache is sized, in the headroom `gpu_memory_utilization` leaves; its size is
measured and logged, with a warning when it outgrows that headroom.
"""

import bisect
import logging
from dataclasses import dataclass

import torch

from nanovllm.attention.base import AttentionBackend, BatchLayout, forward_context

PAD_SLOT = -1  # the KV-store kernels skip this slot: a padded lane writes nowhere
logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Buckets covering every batch size up to max_num_seqs: 1, 2, 4, 8, then every 8 up to
    256 and every 32 beyond, always ending at max_num_seqs (so padding is at most 7, then 31)."""
    sizes = [size for size in (1, 2, 4, 8) if size < max_num_seqs]
    size = 16
    while size < max_num_seqs:
        sizes.append(size)
        size += 8 if size < 256 else 32
    return sizes + [max_num_seqs]


def select_bucket(sizes: list[int], batch_size: int) -> int | None:
    """The smallest bucket that holds batch_size sequences; None past the largest."""
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


@dataclass
class DecodeInputs:
    """Persistent decode inputs, one lane per sequence, sized for the largest bucket.

    Graphs read these exact tensors, so every step copies into them in place.
    """

    input_ids: torch.Tensor  # [max_bs] int64
    positions: torch.Tensor  # [max_bs] int64
    slot_mapping: torch.Tensor  # [max_bs] int64, PAD_SLOT on padded lanes
    context_lens: torch.Tensor  # [max_bs] int32, 0 on padded lanes
    cu_seqlens_q: torch.Tensor  # [max_bs + 1] int32, fixed 0..max_bs: one query token per lane
    block_tables: torch.Tensor  # [max_bs, max_blocks_per_seq] int32
    max_model_len: int

    @classmethod
    def allocate(cls, max_batch_size: int, max_model_len: int, block_size: int,
                 device: torch.device) -> "DecodeInputs":
        # len(prompt) + max_tokens <= max_model_len is enforced at admission, so no block table is wider.
        max_blocks = -(-max_model_len // block_size)
        long = dict(dtype=torch.int64, device=device)
        return cls(
            input_ids=torch.zeros(max_batch_size, **long),
            positions=torch.zeros(max_batch_size, **long),
            slot_mapping=torch.full((max_batch_size,), PAD_SLOT, **long),
            context_lens=torch.zeros(max_batch_size, dtype=torch.int32, device=device),
            cu_seqlens_q=torch.arange(max_batch_size + 1, dtype=torch.int32, device=device),
            block_tables=torch.zeros(max_batch_size, max_blocks, dtype=torch.int32, device=device),
            max_model_len=max_model_len,
        )

    def layout(self, batch_size: int) -> BatchLayout:
        """The first batch_size lanes as a decode layout. Its host ints are bounds, not this
        step's values (the graph bakes them in): max_context_len is max_model_len."""
        return BatchLayout(
            query_lens=[1] * batch_size,
            context_lens=self.context_lens[:batch_size],
            cu_seqlens_q=self.cu_seqlens_q[:batch_size + 1],
            slot_mapping=self.slot_mapping[:batch_size],
            block_tables=self.block_tables[:batch_size],
            max_query_len=1,
            max_context_len=self.max_model_len,
        )

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout, bucket: int) -> None:
        """Copy one decode step (n sequences) into lanes 0..n-1 and pad lanes n..bucket-1."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(layout.slot_mapping)
        self.context_lens[:n].copy_(layout.context_lens)
        # Entries past a table's width are stale but never read: a lane reads only the
        # blocks its context length covers.
        self.block_tables[:n, :layout.block_tables.shape[1]].copy_(layout.block_tables)
        if n < bucket:
            self.input_ids[n:bucket].zero_()
            self.positions[n:bucket].zero_()
            self.slot_mapping[n:bucket].fill_(PAD_SLOT)
            self.context_lens[n:bucket].zero_()


class CUDAGraphRunner:
    """Captures `model(input_ids, positions)` for decode batches and replays it."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, max_num_seqs: int,
                 max_model_len: int, block_size: int, device: torch.device):
        self.model = model
        self.backend = backend
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.inputs = DecodeInputs.allocate(self.sizes[-1], max_model_len, block_size, device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def forward(self, bucket: int) -> torch.Tensor:
        """The model over the first `bucket` lanes of the buffers: what a graph captures."""
        metadata = self.backend.prepare(self.inputs.layout(bucket))
        with forward_context(self.backend, metadata):
            return self.model(self.inputs.input_ids[:bucket], self.inputs.positions[:bucket])

    @torch.inference_mode()
    def capture(self, headroom_bytes: int | None = None) -> int:
        """Capture every bucket; returns the bytes the graphs took (their pool, warm-ups'
        workspaces included). `headroom_bytes`: what the KV sizing left free for them."""
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        pool = None
        for bucket in reversed(self.sizes):  # largest first: its pool then serves the smaller ones
            self.forward(bucket)  # warm-up outside the capture: kernels compiled, workspaces made
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.forward(bucket)
            pool = graph.pool()
            self.graphs[bucket] = (graph, hidden)
        torch.cuda.synchronize()
        taken = torch.cuda.memory_reserved() - before
        logger.info("captured CUDA graphs for %d batch sizes (1-%d): %.0f MiB", len(self.sizes), self.sizes[-1],
                    taken / 2**20)
        if headroom_bytes is not None and taken > headroom_bytes:
            logger.warning("the CUDA graphs took %.0f MiB, more than the %.0f MiB that gpu_memory_utilization "
                           "leaves free: lower it, or max_num_seqs", taken / 2**20, headroom_bytes / 2**20)
        return taken

    def can_run(self, layout: BatchLayout) -> bool:
        return layout.max_query_len == 1 and len(layout.query_lens) <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        """Replay the step's bucket; returns hidden states [n, hidden_size], valid until the next replay."""
        n = input_ids.shape[0]
        bucket = select_bucket(self.sizes, n)
        self.inputs.load(input_ids, positions, layout, bucket)
        graph, hidden = self.graphs[bucket]
        graph.replay()
        return hidden[:n]
