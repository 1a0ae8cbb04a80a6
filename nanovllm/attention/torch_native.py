"""Portable attention over the paged KV cache in plain PyTorch (CPU and any device).

New keys/values are scattered into the cache by slot. Decode rows (one query token)
are batched: their contexts are gathered by block table into one padded tensor and
attended in a single call, so large decode batches cost no per-sequence Python. Prefill
chunks are few per step and attend one sequence at a time with a causal mask offset by
the sequence's cached prefix.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanovllm.attention.base import AttentionBackend, BatchLayout


@dataclass
class PrefillChunk:
    q_start: int
    q_end: int
    block_ids: torch.Tensor  # blocks covering the context
    context_len: int
    mask: torch.Tensor | None  # None: no cached prefix, plain causal attention


@dataclass
class TorchNativeMetadata:
    slot_mapping: torch.Tensor
    decode_rows: torch.Tensor | None  # query rows of decode sequences
    decode_block_tables: torch.Tensor | None  # [Bd, max_blocks], padding pointed at block 0
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, max_blocks * block_size], True = visible
    prefills: list[PrefillChunk]


class TorchNativeBackend(AttentionBackend):
    def prepare(self, layout: BatchLayout) -> TorchNativeMetadata:
        device = layout.slot_mapping.device
        decode_idx = [i for i, n in enumerate(layout.query_lens) if n == 1]
        decode_rows = decode_tables = decode_mask = None
        if decode_idx:
            idx = torch.tensor(decode_idx, device=device)
            tables = layout.block_tables[idx]
            max_blocks = int((tables >= 0).sum(1).max())
            decode_tables = tables[:, :max_blocks].clamp(min=0)
            positions = torch.arange(max_blocks * self.block_size, device=device)
            decode_mask = (positions[None, :] < layout.context_lens[idx, None])[:, None, None, :]
            decode_rows = layout.cu_seqlens_q[idx].long()
        prefills = prefill_chunks(layout, self.block_size)
        return TorchNativeMetadata(layout.slot_mapping, decode_rows, decode_tables, decode_mask, prefills)

    def forward(self, q, k, v, k_cache, v_cache, metadata: TorchNativeMetadata, scale):
        kvh, d = self.num_kv_heads, self.head_dim
        k_cache.view(-1, kvh, d).index_copy_(0, metadata.slot_mapping, k)
        v_cache.view(-1, kvh, d).index_copy_(0, metadata.slot_mapping, v)
        o = torch.empty_like(q)
        gqa = self.num_heads != kvh
        if metadata.decode_rows is not None:
            bd = metadata.decode_rows.numel()
            keys = k_cache[metadata.decode_block_tables].view(bd, -1, kvh, d).transpose(1, 2)
            values = v_cache[metadata.decode_block_tables].view(bd, -1, kvh, d).transpose(1, 2)
            qd = q[metadata.decode_rows].unsqueeze(2)  # [Bd, H, 1, D]
            out = F.scaled_dot_product_attention(qd, keys, values, attn_mask=metadata.decode_mask,
                                                 scale=scale, enable_gqa=gqa)
            o[metadata.decode_rows] = out.squeeze(2)
        attend_prefills(o, q, k, v, k_cache, v_cache, metadata.prefills, scale)
        return o


def prefill_chunks(layout: BatchLayout, block_size: int) -> list[PrefillChunk]:
    """One chunk per sequence with more than one new token, in batch order."""
    cu = layout.cu_seqlens_q.tolist()
    context_lens = layout.context_lens.tolist()
    device = layout.slot_mapping.device
    chunks = []
    for i, q_len in enumerate(layout.query_lens):
        if q_len == 1:
            continue
        ctx = context_lens[i]
        block_ids = layout.block_tables[i, :-(-ctx // block_size)]
        mask = None
        if ctx > q_len:
            # Query j sits at position ctx - q_len + j and sees keys up to there.
            q_pos = torch.arange(ctx - q_len, ctx, device=device)
            mask = torch.arange(ctx, device=device)[None, :] <= q_pos[:, None]
        chunks.append(PrefillChunk(cu[i], cu[i + 1], block_ids, ctx, mask))
    return chunks


def attend_prefills(o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, chunks: list[PrefillChunk], scale: float) -> None:
    """Causal attention of each chunk into o. A chunk with no cached prefix attends to its own
    new k/v; one that continues a prompt reads its whole context from the (written) cache."""
    kvh, d = k.shape[1], k.shape[2]
    gqa = q.shape[1] != kvh
    for chunk in chunks:
        rows = slice(chunk.q_start, chunk.q_end)
        if chunk.mask is None:
            keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
        else:
            keys = k_cache[chunk.block_ids].view(-1, kvh, d)[:chunk.context_len].transpose(0, 1)
            values = v_cache[chunk.block_ids].view(-1, kvh, d)[:chunk.context_len].transpose(0, 1)
        out = F.scaled_dot_product_attention(q[rows].transpose(0, 1), keys, values, attn_mask=chunk.mask,
                                             is_causal=chunk.mask is None, scale=scale, enable_gqa=gqa)
        o[rows] = out.transpose(0, 1)
