"""The gated SiLU activation of Llama-style MLPs."""

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def __init__(self):
        super().__init__()
        self.use_cpu_kernel = False  # set by kernels.cpu.use_elementwise_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., 2 * I] holding [gate | up] -> silu(gate) * up, [..., I]."""
        if self.use_cpu_kernel:
            return torch.ops.nanovllm_cpu.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
