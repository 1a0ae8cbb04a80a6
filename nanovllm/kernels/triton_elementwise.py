"""The elementwise parts of a decoder layer as single Triton kernels, for GPUs: RMSNorm (with the
residual add before it), the gated SiLU, and rotary embedding of q and k in one launch. In
eager steps (prefills, mixed steps) torch runs each of these as several kernels with
intermediates in memory; CUDA graphs remove the launches but not the extra traffic.

Each computes what its torch module computes, in the same precision steps: statistics and
rotations in fp32, results cast back where the module casts (layers/layernorm.py,
activation.py, rotary_embedding.py). They run on CPU tensors under TRITON_INTERPRET=1, for tests.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, summed_ptr, x_stride_t, x_stride_h,
                     residual_stride, n_cols, eps, NUM_HEADS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     BLOCK: tl.constexpr):
    """One row: token row // NUM_HEADS, head row % NUM_HEADS (per-head norms read q and k in
    place, strided inside the fused qkv output)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    src = (row // NUM_HEADS) * x_stride_t + (row % NUM_HEADS) * x_stride_h
    x = tl.load(x_ptr + src + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # the sum in the model dtype, like the residual stream
        x = x + tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        tl.store(summed_ptr + row * n_cols + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, 0) / n_cols + eps)
    normed = (x32 * inv_rms).to(x.dtype)  # cast back before the weight multiply, as HF does
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n_cols + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x [T, N] or [T, H, N] (strided rows and heads allowed) -> norm(x), contiguous; with
    `residual` (x's shape, 2-D): (norm(x + residual), x + residual)."""
    assert x.stride(-1) == 1 and (residual is None or (residual.dim() == 2 and residual.stride(-1) == 1))
    heads = x.shape[1] if x.dim() == 3 else 1
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if residual is not None else out
    _rms_norm_kernel[(x.shape[0] * heads,)](
        x, residual if residual is not None else x, weight, out, summed, x.stride(0),
        x.stride(1) if x.dim() == 3 else 0, residual.stride(0) if residual is not None else 0, n, eps,
        NUM_HEADS=heads, HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n))
    return out if residual is None else (out, summed)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=mask, other=0.0)
    gate32 = gate.to(tl.float32)
    silu = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype)  # F.silu's result, in the model dtype
    tl.store(out_ptr + row * n_cols + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


SILU_BLOCK = 1024


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] holding [gate | up] -> silu(gate) * up, [T, I]."""
    assert x.stride(-1) == 1
    rows, width = x.shape
    out = torch.empty((rows, width // 2), dtype=x.dtype, device=x.device)
    block = min(SILU_BLOCK, triton.next_power_of_2(width // 2))
    _silu_and_mul_kernel[(rows, triton.cdiv(width // 2, block))](x, out, x.stride(0), width // 2, BLOCK=block)
    return out


@triton.jit
def _rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, cos_sin_ptr, q_stride, k_stride,
                 NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """One (token, head) of q or of k: the head's halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    half = HEAD_DIM // 2
    dims = tl.arange(0, BLOCK)
    mask = dims < half
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_sin_ptr + position * HEAD_DIM + dims, mask=mask, other=0.0)
    sin = tl.load(cos_sin_ptr + position * HEAD_DIM + half + dims, mask=mask, other=0.0)
    if head < NUM_Q_HEADS:
        src = q_ptr + token * q_stride + head * HEAD_DIM
        dst = q_out_ptr + (token * NUM_Q_HEADS + head) * HEAD_DIM
    else:
        src = k_ptr + token * k_stride + (head - NUM_Q_HEADS) * HEAD_DIM
        dst = k_out_ptr + (token * NUM_K_HEADS + head - NUM_Q_HEADS) * HEAD_DIM
    x1 = tl.load(src + dims, mask=mask, other=0.0)
    x2 = tl.load(src + half + dims, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(dst + dims, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(dst + half + dims, (b * cos + a * sin).to(x1.dtype), mask=mask)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                     head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T], q [T, H*D], k [T, KVH*D] (rows may be strided) -> rotated (q, k), new tensors;
    cos_sin_cache [max_position, D] fp32: cos then sin of each position's angles."""
    assert q.stride(-1) == k.stride(-1) == 1 and cos_sin_cache.is_contiguous()
    num_q_heads, num_k_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype,
                                                                                  device=k.device)
    _rope_kernel[(q.shape[0], num_q_heads + num_k_heads)](
        q, k, q_out, k_out, positions, cos_sin_cache, q.stride(0), k.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HEAD_DIM=head_dim,
        BLOCK=triton.next_power_of_2(head_dim // 2))
    return q_out, k_out
