"""The CUDA platform: a decoder layer's elementwise modules (RMSNorm with its residual add, the
gated SiLU, rotary embedding) switched onto single Triton kernels (kernels/triton_elementwise.py)
once the weights are loaded. Graph capture and memory sizing are engine/cuda_graph.py's and
engine/gpu_memory.py's."""

import torch
from torch import nn

from nanovllm.kernels import triton_elementwise as kernels
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.platforms import Platform


class TritonRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return kernels.rms_norm(x, self.weight, self.eps, residual)


class TritonSiluAndMul(SiluAndMul):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.silu_and_mul(x)


class TritonRotaryEmbedding(RotaryEmbedding):
    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return kernels.rotary_embedding(positions, q, k, self.cos_sin_cache, self.head_dim)


# The same state, another forward: a module switches by its class, keeping its parameters and
# every reference to it.
TRITON_MODULES = {RMSNorm: TritonRMSNorm, SiluAndMul: TritonSiluAndMul, RotaryEmbedding: TritonRotaryEmbedding}


class CUDAPlatform(Platform):
    def prepare_model(self, model: nn.Module) -> None:
        for module in model.modules():
            kernel_class = TRITON_MODULES.get(type(module))
            if kernel_class is not None:
                module.__class__ = kernel_class
