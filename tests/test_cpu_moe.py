"""The CPU mixture-of-experts kernel (`gguf_moe`, kernels/cpu/moe.cpp) against a plain per-expert
loop over the block kernels, and against dense fp32 experts.

The reference runs each expert the step selected on the rows that chose it through
`gguf_linear` (gate/up, then down with fp32 output), the elementwise gated SiLU between, and sums
each token's slots in fp32: the arithmetic the kernel promises, so the two agree to the last bits
of the weighted sum. Every block type the engine keeps, rows with a tail of blocks past the last
group of 256 values, top-k 1 to 8, tokens that all pick one expert (a tiled GEMM of many rows)
and tokens spread over every expert (streamed rows); a token's output alone equals its output in
the batch, bit for bit.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import random_gguf_blocks
from nanovllm.kernels import cpu as cpu_kernels
from nanovllm.layers.quantization.cpu_gguf import MAX_STREAMING_ROWS, activation_bits, kernel_blocks
from nanovllm.layers.quantization.moe_methods import dense_moe
from nanovllm.loader.quantized import BLOCK_TYPES, block_values

if not cpu_kernels.available():
    pytest.skip("the CPU kernels could not be built here", allow_module_level=True)

EXPERTS = 8


def shapes(qtype: str) -> tuple[int, int]:
    """(hidden, intermediate): a tail of 32-value blocks past the groups where the type has them."""
    return (512, 256) if block_values(qtype) == 256 else (288, 96)


def expert_weights(gate_up_type: str, down_type: str, hidden: int, intermediate: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    w13 = torch.from_numpy(random_gguf_blocks(gate_up_type, EXPERTS * 2 * intermediate, hidden, rng, scale=0.002))
    w2 = torch.from_numpy(random_gguf_blocks(down_type, EXPERTS * hidden, intermediate, rng, scale=0.002))
    return w13, w2


def routing(tokens: int, k: int, spread: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    if spread:
        ids = torch.stack([torch.randperm(EXPERTS, generator=generator)[:k] for _ in range(tokens)])
    else:  # every token's first choice is expert 3
        ids = torch.stack([torch.cat([torch.tensor([3]), torch.randperm(EXPERTS - 1, generator=generator)[:k - 1] + 4])
                           % EXPERTS for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k, generator=generator), dim=-1)
    return weights, ids


def run_kernel(x, weights, ids, w13, gate_up_type, w2, down_type, intermediate):
    (w13_lanes, w13_kind), (w2_lanes, w2_kind) = (kernel_blocks(w13, gate_up_type, x.shape[1]),
                                                  kernel_blocks(w2, down_type, intermediate))
    return torch.ops.nanovllm_cpu.gguf_moe(x, ids, weights, w13_lanes, w13_kind, w2_lanes, w2_kind, intermediate, 0,
                                           MAX_STREAMING_ROWS, activation_bits([gate_up_type]),
                                           activation_bits([down_type]))


def reference(x, weights, ids, w13, gate_up_type, w2, down_type, intermediate):
    """The per-expert loop over gguf_linear, each token's slots summed in order in fp32."""
    hidden = x.shape[1]
    (w13_lanes, w13_kind), (w2_lanes, w2_kind) = (kernel_blocks(w13, gate_up_type, hidden),
                                                  kernel_blocks(w2, down_type, intermediate))
    down = torch.zeros(*ids.shape, hidden)
    for expert in ids.unique().tolist():
        tokens, slots = torch.nonzero(ids == expert, as_tuple=True)
        rows = slice(expert * 2 * intermediate, (expert + 1) * 2 * intermediate)
        gate_up = torch.ops.nanovllm_cpu.gguf_linear(x[tokens], w13_lanes[rows], w13_kind, None, MAX_STREAMING_ROWS,
                                                     activation_bits([gate_up_type]))
        if x.dtype == torch.bfloat16:
            activated = torch.ops.nanovllm_cpu.silu_and_mul(gate_up)
        else:
            activated = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        down[tokens, slots] = torch.ops.nanovllm_cpu.gguf_linear(
            activated.float(), w2_lanes[expert * hidden:(expert + 1) * hidden], w2_kind, None, MAX_STREAMING_ROWS,
            activation_bits([down_type]))
    out = torch.zeros(x.shape[0], hidden)
    for slot in range(ids.shape[1]):
        out = out + weights[:, slot, None] * down[:, slot]
    return out.to(x.dtype)


def assert_same_sums(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to the rounding of the weighted sum's last operations (one bf16 step where x is bf16)."""
    ulp = 2.0 ** -7 if got.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), expected.float(), rtol=ulp, atol=ulp * expected.abs().max().item())


@pytest.mark.parametrize("qtype", list(BLOCK_TYPES))
@pytest.mark.parametrize("tokens,k,spread", [(1, 8, True), (5, 2, True), (40, 1, False), (40, 4, False),
                                             (30, 3, True)])
def test_the_kernel_is_the_per_expert_loop(qtype, tokens, k, spread):
    hidden, intermediate = shapes(qtype)
    w13, w2 = expert_weights(qtype, qtype, hidden, intermediate)
    weights, ids = routing(tokens, k, spread, seed=tokens + k)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)).to(dtype)
        got = run_kernel(x, weights, ids, w13, qtype, w2, qtype, intermediate)
        assert got.dtype == dtype and got.shape == x.shape
        assert_same_sums(got, reference(x, weights, ids, w13, qtype, w2, qtype, intermediate))


def test_gate_up_and_down_in_different_types():
    """Q4_K_M keeps some layers' down projections in Q6_K beside Q4_K gate/up."""
    hidden, intermediate = 512, 256
    w13, w2 = expert_weights("Q4_K", "Q6_K", hidden, intermediate)
    weights, ids = routing(12, 8, True)
    x = torch.randn(12, hidden).bfloat16()
    got = run_kernel(x, weights, ids, w13, "Q4_K", w2, "Q6_K", intermediate)
    assert_same_sums(got, reference(x, weights, ids, w13, "Q4_K", w2, "Q6_K", intermediate))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_near_dense_fp32_experts(qtype):
    """Against the dense experts (the blocks dequantized) in fp32: x's 16- or 8-bit rounding apart."""
    hidden, intermediate = shapes(qtype)
    w13, w2 = expert_weights(qtype, qtype, hidden, intermediate)
    weights, ids = routing(20, 2, True)
    x = torch.randn(20, hidden)
    dense13 = torch.ops.nanovllm_cpu.gguf_dequantize(w13, BLOCK_TYPES[qtype], hidden).view(EXPERTS, -1, hidden)
    dense2 = torch.ops.nanovllm_cpu.gguf_dequantize(w2, BLOCK_TYPES[qtype], intermediate).view(EXPERTS, hidden, -1)
    expected = dense_moe(x, dense13, dense2, weights, ids, "silu")
    got = run_kernel(x, weights, ids, w13, qtype, w2, qtype, intermediate)
    tolerance = 0.05 if activation_bits([qtype]) == 8 else 1e-3
    assert (got - expected).norm() / expected.norm() < tolerance


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K"])
def test_a_tokens_output_does_not_depend_on_the_batch(qtype):
    hidden, intermediate = shapes(qtype)
    w13, w2 = expert_weights(qtype, qtype, hidden, intermediate)
    weights, ids = routing(48, 4, False)
    x = torch.randn(48, hidden).bfloat16()
    batch = run_kernel(x, weights, ids, w13, qtype, w2, qtype, intermediate)
    for t in (0, 17, 47):
        alone = run_kernel(x[t:t + 1], weights[t:t + 1], ids[t:t + 1], w13, qtype, w2, qtype, intermediate)
        assert torch.equal(alone[0], batch[t])


def test_bad_arguments_are_named():
    w13, w2 = expert_weights("Q8_0", "Q8_0", 288, 96)
    x = torch.randn(2, 288).bfloat16()
    weights, ids = routing(2, 2, True)
    with pytest.raises(RuntimeError, match="expert id 9 is outside 0..7"):
        run_kernel(x, weights, torch.tensor([[0, 9], [1, 2]]), w13, "Q8_0", w2, "Q8_0", 96)
    with pytest.raises(RuntimeError, match="topk_weights must be fp32"):
        run_kernel(x, weights.double(), ids, w13, "Q8_0", w2, "Q8_0", 96)


@pytest.mark.parametrize("tokens,k,spread", [(1, 8, True), (30, 2, True), (40, 4, False)])
def test_packed_bf16_experts_are_the_per_expert_loop(tokens, k, spread):
    """Dense bf16 experts (`packed_moe`): each selected expert's rows through the packed linear
    kernel, the gated SiLU between, each token's slots summed in fp32 in order."""
    hidden, intermediate = 96, 48
    generator = torch.Generator().manual_seed(tokens)
    w13 = (torch.randn(EXPERTS, 2 * intermediate, hidden, generator=generator) / hidden ** 0.5).bfloat16()
    w2 = (torch.randn(EXPERTS, hidden, intermediate, generator=generator) / intermediate ** 0.5).bfloat16()
    x = torch.randn(tokens, hidden, generator=generator).bfloat16()
    weights, ids = routing(tokens, k, spread, seed=tokens)
    packed13 = torch.stack([cpu_kernels.pack_linear_weight(w) for w in w13])
    packed2 = torch.stack([cpu_kernels.pack_linear_weight(w) for w in w2])
    got = torch.ops.nanovllm_cpu.packed_moe(x, ids, weights, packed13, packed2, intermediate, 0)
    down = torch.zeros(tokens, k, hidden)
    for expert in ids.unique().tolist():
        rows, slots = torch.nonzero(ids == expert, as_tuple=True)
        gate_up = cpu_kernels.linear_packed(x[rows], packed13[expert], None, 2 * intermediate)
        down[rows, slots] = cpu_kernels.linear_packed(torch.ops.nanovllm_cpu.silu_and_mul(gate_up), packed2[expert],
                                                      None, hidden).float()
    expected = sum(weights[:, slot, None] * down[:, slot] for slot in range(k))
    assert_same_sums(got, expected.bfloat16())
    near = dense_moe(x.float(), w13.float(), w2.float(), weights, ids, "silu")
    assert (got.float() - near).norm() / near.norm() < 0.02  # bf16 roundings apart
