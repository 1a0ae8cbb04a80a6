"""The CPU compile keeps a bf16 matmul followed by an add rounding where eager does: Inductor's
own rewrite into `addmm` adds inside the GEMM in fp32 and rounds once, which moved about a
quarter of a residual stream's elements by a bf16 ulp (on the path without the CPU kernels,
where linears are plain matmuls)."""

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.platforms.cpu_compile import compile_with_dynamic_tokens

torch.manual_seed(0)
HIDDEN = 576
X = (torch.randn(57, HIDDEN) * 3).bfloat16()
RESIDUAL = (torch.randn(57, HIDDEN) * 10).bfloat16()
SCALE = (1 + 0.3 * torch.randn(HIDDEN)).bfloat16()


class ProjectAndAdd(nn.Module):
    """o_proj(x) + residual, then (when `scaled`) a pointwise op that Inductor fuses the sum into,
    as the next RMSNorm does."""

    def __init__(self, bias: bool, scaled: bool):
        super().__init__()
        self.weight = nn.Parameter((torch.randn(HIDDEN, HIDDEN) * 0.05).bfloat16(), requires_grad=False)
        self.bias = nn.Parameter(torch.randn(HIDDEN).bfloat16(), requires_grad=False) if bias else None
        self.scaled = scaled

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        summed = F.linear(x, self.weight, self.bias) + residual
        return summed * SCALE if self.scaled else summed


def compiled_and_eager(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode():
        eager = module(X, RESIDUAL)
        return eager, compile_with_dynamic_tokens(module)(X, RESIDUAL)


def test_matmul_then_add_rounds_like_eager():
    eager, compiled = compiled_and_eager(ProjectAndAdd(bias=False, scaled=False))
    assert torch.equal(eager, compiled)


def test_sum_fused_into_what_reads_it_is_rounded_first():
    eager, compiled = compiled_and_eager(ProjectAndAdd(bias=False, scaled=True))
    assert torch.equal(eager, compiled)


def test_bias_stays_inside_the_gemm_as_in_eager():
    # Eager's linear adds a bias inside the GEMM itself; splitting it out would differ.
    eager, compiled = compiled_and_eager(ProjectAndAdd(bias=True, scaled=True))
    assert torch.equal(eager, compiled)
