"""The gated SiLU activation of Llama-style MLPs (one kernel on the CPU kernels and on CUDA)."""

import torch
import torch.nn.functional as F

from nanovllm.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., 2 * I] holding [gate | up] -> silu(gate) * up, [..., I]."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.nanovllm_cpu.silu_and_mul(x)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        from nanovllm.kernels import triton_elementwise
        return triton_elementwise.silu_and_mul(x)
