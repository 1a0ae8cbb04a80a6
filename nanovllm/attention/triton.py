"""Paged attention in Triton (CUDA; also runs on CPU tensors under TRITON_INTERPRET=1, for tests).

Two kernels. `store_kvcache` writes each new token's K/V rows into its cache slot; a slot of
-1 marks a padded lane (CUDA-graph padding) and writes nowhere. `paged_attention` serves
decode and prefill chunks alike: sequence i's queries are the last query_len of its
context_len positions, so query j sits at position context_len - query_len + j and sees
every key up to there, a cached prefix included. Keys are read through the block table, one
tile of keys at a time (a tile may span pages: each key looks up its own block), with an
online softmax accumulated in fp32.

One program serves one (sequence, KV head, query tile). Its rows are query tokens x the
query heads that share that KV head (GQA), so each K/V tile is loaded once for the whole
group: decode, which is bound by reading the cache, reads it once per KV head.

Decode with few sequences would leave most of a GPU's multiprocessors idle (one program per
sequence and KV head), so a decode-only step of few sequences splits each context into up to
MAX_KV_SPLITS parts, flash-decoding style: each program attends over its part and writes its
unnormalized output with its running max and sum, and a second kernel merges the parts. The
number of parts depends on the batch size and the GPU's multiprocessors (and, in eager steps,
the longest context): a CUDA graph captured for a batch size keeps it, and as a runtime
argument it compiles nothing new. Parts beyond a short context find no key and weigh nothing in the merge.

The metadata holds only tensors plus the longest query length, and `prepare` copies
nothing, so a decode step is captured by CUDA graphs over persistent buffers.
"""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.attention.base import AttentionBackend, BatchLayout

LOG2_E = 1.4426950408889634
# Rows per program: decode has one query token, so only its GQA group fills rows; prefill
# tiles hold several tokens. 16 is the smallest tile tl.dot accepts.
DECODE_BLOCK_M = 16
PREFILL_BLOCK_M = 64
BLOCK_N = 64  # keys per tile
MAX_KV_SPLITS = 16
PROGRAMS_PER_MULTIPROCESSOR = 2  # what a split decode aims for
# Without CUDA (the interpreter) the split is planned for an H200's 132 multiprocessors, so the
# tests run the split path a GPU would.
INTERPRETER_MULTIPROCESSORS = 132


@triton.jit
def _store_kvcache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    k_stride_t, k_stride_h, v_stride_t, v_stride_h,
    cache_stride_block, cache_stride_tok, cache_stride_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padded lane: it owns no slot, so it writes nowhere
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(k_ptr + token * k_stride_t + heads * k_stride_h + dims, mask=mask)
    v = tl.load(v_ptr + token * v_stride_t + heads * v_stride_h + dims, mask=mask)
    dst = (slot // PAGE) * cache_stride_block + (slot % PAGE) * cache_stride_tok + heads * cache_stride_head + dims
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


# The block table's width grows with the longest context of an eager step: left to Triton, its
# stride would be specialized on (1, a multiple of 16, other) and recompile mid-run.
@triton.jit(do_not_specialize=["block_tables_stride", "num_splits"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, o_ptr,
    cu_seqlens_q_ptr, context_lens_ptr, block_tables_ptr,
    part_acc_ptr, part_stats_ptr,  # with SPLIT_KV: fp32 [T, H, num_splits, D] and [T, H, num_splits, 2]
    scale_log2,  # softmax scale * log2(e): the softmax runs in base 2
    window,  # with HAS_WINDOW: a row at position p sees keys p - window + 1 .. p
    softcap_log2,  # with HAS_SOFTCAP: the softcap * log2(e), so that base-2 scores x become c tanh(x / c)
    num_splits,  # parts of the keys (SPLIT_KV); a runtime value, so changing it compiles nothing
    q_stride_t, q_stride_h, o_stride_t, o_stride_h, block_tables_stride,
    cache_stride_block, cache_stride_tok, cache_stride_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    TOKENS_PER_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPLIT_KV: tl.constexpr, NUM_HEADS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Axis 2: the query tile, or (decode split over the keys) the part of the keys.
    if SPLIT_KV:
        tile = 0
        split = tl.program_id(2)
    else:
        tile = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if tile * TOKENS_PER_TILE >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)

    # Row r is query token tile * TOKENS_PER_TILE + r // GROUP of this chunk, in query head
    # kv_head * GROUP + r % GROUP. Rows past TOKENS_PER_TILE * GROUP are padding.
    rows = tl.arange(0, BLOCK_M)
    tok = tile * TOKENS_PER_TILE + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < TOKENS_PER_TILE * GROUP) & (tok < q_len)
    q_pos = context_len - q_len + tok  # each row's position in its sequence
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_offsets = (q_start + tok)[:, None] * q_stride_t + head[:, None] * q_stride_h + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # A finite floor instead of -inf: a row that sees no key yet keeps exp2(m - m) = 1, not NaN.
    m = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    denom = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys past this tile's last query position are invisible to all of its rows.
    last_tok = tl.minimum(q_len, (tile + 1) * TOKENS_PER_TILE) - 1
    kv_end = context_len - q_len + last_tok + 1
    kv_start = 0
    if HAS_WINDOW and not SPLIT_KV:  # from the key tile of the first key this tile's first row sees
        kv_start = tl.maximum(context_len - q_len + tile * TOKENS_PER_TILE - window + 1, 0) // BLOCK_N * BLOCK_N
    if SPLIT_KV:  # this program's part: whole key tiles, the last part possibly short or empty
        part = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
        kv_start = split * part
        kv_end = tl.minimum(kv_end, kv_start + part)
    # Keys before the tile's first row's window are invisible to all its rows, and their blocks may
    # have been freed (-1 in the table): never loaded.
    kv_first = 0
    if HAS_WINDOW:
        kv_first = tl.maximum(context_len - q_len + tile * TOKENS_PER_TILE - window + 1, 0)
    for start in range(kv_start, kv_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = (keys < kv_end) & (keys >= kv_first)
        block = tl.load(block_tables_ptr + seq * block_tables_stride + keys // PAGE, mask=key_ok, other=0)
        kv_offsets = (block.to(tl.int64) * cache_stride_block + (keys % PAGE) * cache_stride_tok
                      + kv_head * cache_stride_head)[:, None] + dims[None, :]
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if HAS_SOFTCAP:  # tanh(u) = 1 - 2 / (exp(2u) + 1)
            u = scores / softcap_log2
            scores = softcap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))
        visible = key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (keys[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        rescale = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        denom = denom * rescale + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    if SPLIT_KV:  # the merge kernel normalizes
        part_row = ((q_start + tok) * NUM_HEADS + head) * num_splits + split
        tl.store(part_acc_ptr + part_row[:, None] * BLOCK_D + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(part_stats_ptr + part_row * 2, m, mask=row_ok)
        tl.store(part_stats_ptr + part_row * 2 + 1, denom, mask=row_ok)
    else:
        # A row that saw no key (a padded lane with context_len 0) outputs zeros, not 0/0.
        out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        o_offsets = (q_start + tok)[:, None] * o_stride_t + head[:, None] * o_stride_h + dims[None, :]
        tl.store(o_ptr + o_offsets, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kv_splits_kernel(
    part_acc_ptr, part_stats_ptr, o_ptr, o_stride_t, o_stride_h, num_splits,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One (token, head): the parts' outputs rescaled to the overall max and summed, over the
    parts' summed denominators (parts that saw no key have a zero sum and weigh nothing)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < num_splits
    row = (token * NUM_HEADS + head) * num_splits + splits
    m = tl.load(part_stats_ptr + row * 2, mask=split_ok, other=-1.0e30)
    denom = tl.load(part_stats_ptr + row * 2 + 1, mask=split_ok, other=0.0)
    m_all = tl.max(m, 0)
    weight = tl.exp2(m - m_all)
    dims = tl.arange(0, BLOCK_D)
    acc = tl.load(part_acc_ptr + row[:, None] * BLOCK_D + dims[None, :], mask=split_ok[:, None], other=0.0)
    total = tl.sum(denom * weight, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + token * o_stride_t + head * o_stride_h + dims, out.to(o_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def store_kvcache_config(num_kv_heads: int, head_dim: int, block_size: int) -> dict:
    """The store kernel's compile-time parameters."""
    return dict(NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE=block_size,
                BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim))


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """k/v: [T, KVH, D] (last dim contiguous); caches: [num_blocks, block_size, KVH, D]; slot -1 = skip."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k.stride(2) == v.stride(2) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    _store_kvcache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        **store_kvcache_config(num_kv_heads, head_dim, k_cache.shape[1]),
    )


@functools.cache
def multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_MULTIPROCESSORS
    return torch.cuda.get_device_properties(device).multi_processor_count


def kv_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_context_len: int,
              num_multiprocessors: int) -> int:
    """Parts to split each context into: 1 but for decode-only steps whose (sequence, KV head)
    programs are too few to fill the GPU, and never more than the longest context's key tiles."""
    if max_query_len != 1:
        return 1
    wanted = triton.cdiv(PROGRAMS_PER_MULTIPROCESSOR * num_multiprocessors, num_seqs * num_kv_heads)
    return max(1, min(MAX_KV_SPLITS, wanted, triton.cdiv(max_context_len, BLOCK_N)))


def paged_attention_config(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                           max_query_len: int, dtype: torch.dtype, splits: int = 1, window: int = 0,
                           softcap: float = 0.0) -> dict:
    """The attention kernel's compile-time parameters: a decode tile when every sequence has
    one query token, else a prefill tile; rows are tokens x the GQA group."""
    group = num_heads // num_kv_heads
    block_m = max(DECODE_BLOCK_M if max_query_len == 1 else PREFILL_BLOCK_M, triton.next_power_of_2(group))
    return dict(
        GROUP=group, HEAD_DIM=head_dim, PAGE=block_size, TOKENS_PER_TILE=block_m // group,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        # fp32 models stay exact (no TF32), so greedy tokens match an fp32 reference.
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        SPLIT_KV=splits > 1, NUM_HEADS=num_heads, HAS_WINDOW=window > 0, HAS_SOFTCAP=softcap > 0,
    )


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                    max_query_len: int, scale: float, max_context_len: int, splits: int | None = None,
                    window: int = 0, softcap: float = 0.0) -> None:
    """Attend q [T, H, D] over the paged cache into `out` [T, H, D] (see the module docstring).
    `splits`: parts of the keys per decode program (None: kv_splits' choice); `window` and
    `softcap` as AttentionBackend.forward takes them (0: none)."""
    assert q.stride(2) == out.stride(2) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    num_seqs, num_heads, num_kv_heads = context_lens.shape[0], q.shape[1], k_cache.shape[2]
    if splits is None:
        splits = kv_splits(num_seqs, num_kv_heads, max_query_len, max_context_len, multiprocessors(q.device))
    config = paged_attention_config(num_heads, num_kv_heads, q.shape[2], k_cache.shape[1], max_query_len, q.dtype,
                                    splits, window, softcap)
    part_acc = part_stats = out  # unused unless the keys are split
    if splits > 1:
        part_acc = torch.empty(q.shape[0], num_heads, splits, config["BLOCK_D"], dtype=torch.float32, device=q.device)
        part_stats = torch.empty(q.shape[0], num_heads, splits, 2, dtype=torch.float32, device=q.device)
    axis2 = splits if splits > 1 else triton.cdiv(max_query_len, config["TOKENS_PER_TILE"])
    _paged_attention_kernel[(num_seqs, num_kv_heads, axis2)](
        q, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables, part_acc, part_stats,
        scale * LOG2_E, window, softcap * LOG2_E, splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        **config,
    )
    if splits > 1:
        _merge_kv_splits_kernel[(q.shape[0], num_heads)](
            part_acc, part_stats, out, out.stride(0), out.stride(1), splits,
            NUM_HEADS=num_heads, HEAD_DIM=q.shape[2], BLOCK_S=MAX_KV_SPLITS, BLOCK_D=config["BLOCK_D"],
        )


@dataclass
class TritonMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 = padded lane
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    context_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int  # sets the tile shape and grid; 1 for decode-only steps
    max_context_len: int  # a bound (max_model_len under CUDA graphs); caps the key split


class TritonBackend(AttentionBackend):
    supports_cuda_graphs = True
    # Every load from the cache is masked by the context length (other=0): an unwritten slot
    # is never read, so the cache needs no zeroing at start-up.
    needs_zeroed_cache = False

    def prepare(self, layout: BatchLayout) -> TritonMetadata:
        return TritonMetadata(layout.slot_mapping, layout.cu_seqlens_q, layout.context_lens,
                              layout.block_tables, layout.max_query_len, layout.max_context_len)

    def forward(self, q, k, v, k_cache, v_cache, metadata: TritonMetadata, scale, window, softcap):
        store_kvcache(k, v, k_cache, v_cache, metadata.slot_mapping)
        o = torch.empty_like(q)
        paged_attention(q, k_cache, v_cache, o, metadata.cu_seqlens_q, metadata.context_lens,
                        metadata.block_tables, metadata.max_query_len, scale, metadata.max_context_len,
                        window=window, softcap=softcap)
        return o
