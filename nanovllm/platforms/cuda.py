"""The CUDA platform: a decoder layer's elementwise ops (RMSNorm with its residual add, the gated
SiLU, rotary embedding) built on single Triton kernels (their `forward_cuda`, which calls
kernels/triton_elementwise.py). Graph capture and memory sizing are engine/cuda_graph.py's and
engine/gpu_memory.py's."""

from collections.abc import Callable

from nanovllm.layers.custom_op import CustomOp
from nanovllm.platforms import Platform


class CUDAPlatform(Platform):
    def choose_forward(self, op: CustomOp) -> Callable:
        return op.forward_cuda
