"""Portable attention over the paged KV cache in plain PyTorch (CPU and any device).

New keys/values are scattered into the cache by slot. Decode rows (one query token)
are batched: their contexts are gathered by block table into one padded tensor and
attended in a single call, so large decode batches cost no per-sequence Python. Prefill
chunks are few per step and attend one sequence at a time with a causal mask offset by
the sequence's cached prefix. A sliding window narrows the masks (made once a step for each
window size the layers use); a logit softcap, which PyTorch's fused attention does not take,
runs the attention as its plain matmuls and softmax, as HF's eager attention does.
"""

from dataclasses import dataclass, field

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
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> its mask, made once a step

    def window_mask(self, window: int) -> torch.Tensor:
        """[q rows, context] True where a query sees a key under a sliding window."""
        if window not in self.windowed:
            q_len, device = self.q_end - self.q_start, self.block_ids.device
            q_pos = torch.arange(self.context_len - q_len, self.context_len, device=device)[:, None]
            keys = torch.arange(self.context_len, device=device)[None, :]
            self.windowed[window] = (keys <= q_pos) & (keys > q_pos - window)
        return self.windowed[window]


@dataclass
class TorchNativeMetadata:
    slot_mapping: torch.Tensor
    decode_rows: torch.Tensor | None  # query rows of decode sequences
    decode_block_tables: torch.Tensor | None  # [Bd, max_blocks], padding pointed at block 0
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, max_blocks * block_size], True = visible
    decode_context_lens: torch.Tensor | None  # [Bd]
    prefills: list[PrefillChunk]
    decode_windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> its mask

    def decode_window_mask(self, window: int) -> torch.Tensor:
        if window not in self.decode_windowed:
            keys = torch.arange(self.decode_mask.shape[-1], device=self.decode_mask.device)
            first = (self.decode_context_lens - window)[:, None, None, None]
            self.decode_windowed[window] = self.decode_mask & (keys >= first)
        return self.decode_windowed[window]


class TorchNativeBackend(AttentionBackend):
    def prepare(self, layout: BatchLayout) -> TorchNativeMetadata:
        device = layout.slot_mapping.device
        decode_idx = [i for i, n in enumerate(layout.query_lens) if n == 1]
        decode_rows = decode_tables = decode_mask = decode_lens = None
        if decode_idx:
            idx = torch.tensor(decode_idx, device=device)
            tables = layout.block_tables[idx]
            # Blocks that cover the longest context (a table's entries before a sliding window may
            # be -1, freed, as its padding is): pointed at block 0 and masked.
            max_blocks = -(-int(layout.context_lens[idx].max()) // self.block_size)
            decode_tables = tables[:, :max_blocks].clamp(min=0)
            positions = torch.arange(max_blocks * self.block_size, device=device)
            decode_lens = layout.context_lens[idx].long()
            decode_mask = (positions[None, :] < decode_lens[:, None])[:, None, None, :]
            decode_rows = layout.cu_seqlens_q[idx].long()
        prefills = prefill_chunks(layout, self.block_size)
        return TorchNativeMetadata(layout.slot_mapping, decode_rows, decode_tables, decode_mask, decode_lens, prefills)

    def forward(self, q, k, v, k_cache, v_cache, metadata: TorchNativeMetadata, scale, window, softcap):
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
            mask = metadata.decode_window_mask(window) if window else metadata.decode_mask
            o[metadata.decode_rows] = attend(qd, keys, values, mask, False, scale, softcap).squeeze(2)
        attend_prefills(o, q, k, v, k_cache, v_cache, metadata.prefills, scale, window, softcap)
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
        # Entries freed behind a sliding window (-1) are pointed at block 0: masked, never seen.
        block_ids = layout.block_tables[i, :-(-ctx // block_size)].clamp(min=0)
        mask = None
        if ctx > q_len:
            # Query j sits at position ctx - q_len + j and sees keys up to there.
            q_pos = torch.arange(ctx - q_len, ctx, device=device)
            mask = torch.arange(ctx, device=device)[None, :] <= q_pos[:, None]
        chunks.append(PrefillChunk(cu[i], cu[i + 1], block_ids, ctx, mask))
    return chunks


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, causal: bool,
           scale: float, softcap: float) -> torch.Tensor:
    """q [..., H, Lq, D] against keys/values [..., KVH, Lk, D] (H a multiple of KVH); `mask`
    True where visible (broadcast to the scores), or `causal` with none."""
    if not softcap:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=q.shape[-3] != keys.shape[-3])
    group = q.shape[-3] // keys.shape[-3]
    keys, values = keys.repeat_interleave(group, dim=-3), values.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values)


def attend_prefills(o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, chunks: list[PrefillChunk], scale: float, window: int, softcap: float) -> None:
    """Causal attention of each chunk into o. A chunk with no cached prefix attends to its own
    new k/v; one that continues a prompt reads its whole context from the (written) cache."""
    kvh, d = k.shape[1], k.shape[2]
    for chunk in chunks:
        rows = slice(chunk.q_start, chunk.q_end)
        if chunk.mask is None:
            keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
        else:
            keys = k_cache[chunk.block_ids].view(-1, kvh, d)[:chunk.context_len].transpose(0, 1)
            values = v_cache[chunk.block_ids].view(-1, kvh, d)[:chunk.context_len].transpose(0, 1)
        mask = chunk.window_mask(window) if window else chunk.mask
        out = attend(q[rows].transpose(0, 1), keys, values, mask, mask is None, scale, softcap)
        o[rows] = out.transpose(0, 1)
