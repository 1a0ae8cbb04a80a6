"""RMSNorm, optionally fused with the residual add that precedes it.

The statistics are computed in fp32 and the result cast back before the weight multiply,
as HF Llama/Qwen do. A family whose norms multiply by (1 + w) (Gemma) gives a weight offset of
1: the weight loader stores offset + w (summed in fp32), so every forward and kernel multiplies
by the weight as it is. Inputs are never modified: `x.float()` returns `x` itself when x is
already fp32, so an in-place op here could clobber the caller's tensor. On the CPU kernels and
on CUDA (Triton) one kernel does the add and the norm, rounding where this code does.
"""

import torch
from torch import nn

from nanovllm.layers.custom_op import CustomOp
from nanovllm.loader.weights import default_weight_loader


class RMSNorm(CustomOp):
    def __init__(self, hidden_size: int, eps: float = 1e-6, weight_offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        default_weight_loader(param, loaded_weight.float() + self.weight_offset, shard_id)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return self._norm(x)
        summed = x + residual  # in the model dtype, like HF's residual stream
        return self._norm(summed), summed

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return torch.ops.nanovllm_cpu.rms_norm(x, self.weight, self.eps)
        return torch.ops.nanovllm_cpu.add_rms_norm(x, residual, self.weight, self.eps)

    def forward_cuda(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        from nanovllm.kernels import triton_elementwise
        return triton_elementwise.rms_norm(x, self.weight, self.eps, residual)
