"""The gated SiLU activation of Llama-style MLPs."""

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., 2 * I] holding [gate | up] -> silu(gate) * up, [..., I]."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
