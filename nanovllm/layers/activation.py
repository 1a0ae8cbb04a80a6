"""The gated activations of the MLPs: x [..., 2 * I] holding [gate | up] -> act(gate) * up, one
kernel on the CPU kernels (and the SiLU one, Llama's and most families', on CUDA too)."""

import torch
import torch.nn.functional as F

from nanovllm.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.nanovllm_cpu.silu_and_mul(x)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        from nanovllm.kernels import triton_elementwise
        return triton_elementwise.silu_and_mul(x)


class GeluTanhAndMul(CustomOp):
    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.nanovllm_cpu.gelu_tanh_and_mul(x)


# By the names HF configs give them (`hidden_act`, Gemma's `hidden_activation`).
GATED_ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}
# The compiled kernels' id of each (decoder_layer.cpp's Activation, the `activation` argument of
# moe.cpp's and triton_moe.py's experts).
KERNEL_ACTIVATION_IDS = {"silu": 0, "gelu_pytorch_tanh": 1}


def gated_activation(name: str) -> CustomOp:
    if name not in GATED_ACTIVATIONS:
        raise ValueError(f"hidden activation {name!r} is not supported; supported: {', '.join(GATED_ACTIVATIONS)}")
    return GATED_ACTIVATIONS[name]()
