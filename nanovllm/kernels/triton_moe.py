"""A mixture of experts' experts on GPUs as grouped GEMMs in Triton (vLLM's fused_moe design): a fixed
number of launches whatever the number of experts or how the tokens chose them, every size static,
so a decode step's experts replay in a CUDA graph.

The step's (token, slot) pairs are sorted by expert and each expert's run padded to a multiple of
BLOCK_M (`align_by_expert`, torch ops on device: no host sync); each program of the first kernel
takes one block of one expert's rows and a slice of the intermediate dimension, gathers those
tokens' x, and writes act(gate) * up; each program of the second multiplies a block by the
expert's down rows, scales each row by its routing weight and writes it to its pair's own row,
so no two programs write one place (no atomics: the sum over a token's slots is a torch sum after,
in slot order). Accumulation in fp32; the activation rounded to the model dtype as the dense
layers round it. They run on CPU tensors under TRITON_INTERPRET=1, for tests.
"""

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # a block of one expert's rows: decode steps have few rows an expert


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_experts): pair ids (token * k + slot) grouped by expert, each expert's run
    padded with the sentinel P (= tokens * k) to a multiple of block_m, in a buffer of the largest
    size any routing needs (P + experts * (block_m - 1), rounded up to blocks); and each block's
    expert (num_experts past the used blocks)."""
    flat = topk_ids.reshape(-1)
    pairs = flat.numel()
    capacity = triton.cdiv(pairs + num_experts * (block_m - 1), block_m) * block_m
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    sorted_pairs = torch.full((capacity,), pairs, dtype=torch.int64, device=flat.device)
    sorted_pairs[(padded_end - padded)[sorted_experts] + rank] = order
    block_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)
    return sorted_pairs, block_experts


@triton.jit
def _block_pairs(sorted_pairs_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """This program's block of sorted pairs: their positions in the sorted buffer, their pair ids,
    and which are real (not padding)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    return rows, pairs, pairs < num_pairs


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, num_pairs, hidden, intermediate,
                    num_experts, top_k, ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    expert = tl.load(block_experts_ptr + tl.program_id(0))
    if expert < num_experts:
        rows, pairs, valid = _block_pairs(sorted_pairs_ptr, num_pairs, BLOCK_M)
        tokens = tl.where(valid, pairs // top_k, 0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < intermediate
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_expert = w13_ptr + expert.to(tl.int64) * 2 * intermediate * hidden
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < hidden
            x = tl.load(x_ptr + tokens[:, None] * hidden + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            w_gate = tl.load(w_expert + cols[None, :] * hidden + ks[:, None], mask=col_ok[None, :] & k_ok[:, None],
                             other=0.0)
            w_up = tl.load(w_expert + (intermediate + cols[None, :]) * hidden + ks[:, None],
                           mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            gate = tl.dot(x, w_gate, gate)
            up = tl.dot(x, w_up, up)
        # The projections rounded to the model dtype, then act(gate) rounded, times up: the dense
        # layers' steps.
        gate = gate.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = up.to(out_ptr.dtype.element_ty).to(tl.float32)
        if ACTIVATION == 0:
            activated = gate / (1.0 + tl.exp(-gate))
        else:  # tanh GELU, tanh(u) = 2 sigmoid(2u) - 1
            u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            activated = 0.5 * gate * (2.0 / (1.0 + tl.exp(-2.0 * u)))
        activated = activated.to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + rows[:, None] * intermediate + cols[None, :], (activated * up).to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, w2_ptr, weights_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, num_pairs, hidden,
                 intermediate, num_experts, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    expert = tl.load(block_experts_ptr + tl.program_id(0))
    if expert < num_experts:
        rows, pairs, valid = _block_pairs(sorted_pairs_ptr, num_pairs, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < hidden
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_expert = w2_ptr + expert.to(tl.int64) * hidden * intermediate
        for k0 in range(0, intermediate, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < intermediate
            h = tl.load(h_ptr + rows[:, None] * intermediate + ks[None, :], mask=valid[:, None] & k_ok[None, :],
                        other=0.0)
            w = tl.load(w_expert + cols[None, :] * intermediate + ks[:, None], mask=col_ok[None, :] & k_ok[:, None],
                        other=0.0)
            acc = tl.dot(h, w, acc)
        # The expert's output in the model dtype, as a dense down projection gives it, then weighted.
        acc = acc.to(h_ptr.dtype.element_ty).to(tl.float32)
        weight = tl.load(weights_ptr + pairs, mask=valid, other=0.0)
        tl.store(out_ptr + pairs[:, None] * hidden + cols[None, :], acc * weight[:, None],
                 mask=valid[:, None] & col_ok[None, :])


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: int) -> torch.Tensor:
    """x [T, hidden]; w13 [E, 2I, hidden] (gate rows, then up); w2 [E, hidden, I]; topk_weights fp32
    and topk_ids [T, k]; activation 0 silu, 1 tanh GELU -> [T, hidden] in x's dtype."""
    tokens, hidden = x.shape
    num_experts, intermediate = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    pairs = tokens * top_k
    sorted_pairs, block_experts = align_by_expert(topk_ids, num_experts)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    activated = torch.empty(sorted_pairs.numel(), intermediate, dtype=x.dtype, device=x.device)
    block_n, block_k = 32, 32
    _gate_up_kernel[(block_experts.numel(), triton.cdiv(intermediate, block_n))](
        x, w13, activated, sorted_pairs, block_experts, pairs, hidden, intermediate, num_experts, top_k,
        ACTIVATION=activation, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)
    per_pair = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(block_experts.numel(), triton.cdiv(hidden, block_n))](
        activated, w2, topk_weights.reshape(-1).float().contiguous(), per_pair, sorted_pairs, block_experts, pairs,
        hidden, intermediate, num_experts, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)
    return per_pair.view(tokens, top_k, hidden).sum(1).to(x.dtype)
