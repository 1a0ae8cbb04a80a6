"""The CPU bf16 method: the dense weight plus two copies laid out for the CPU kernels
(nanovllm/kernels/cpu.py): the packed decode kernel's panels, which a step of a few rows streams
once at memory bandwidth, and oneDNN's own blocked layout, which saves oneDNN reordering the
weight on every larger step. The `linear` op picks between them by row count.

The copies cost twice the weights' size in RAM. `pack_all` packs every layer of a model into
one arena in transparent huge pages (hardware prefetchers stop at page boundaries)."""

import math

import torch
from torch import nn

from nanovllm.kernels import cpu as cpu_kernels
from nanovllm.layers.quantization.unquantized import UnquantizedLinearMethod


class CPUPackedBF16LinearMethod(UnquantizedLinearMethod):
    def __init__(self):
        self.max_packed_rows = cpu_kernels.packed_max_rows()  # a constant to the compiled graphs

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.nanovllm_cpu.linear(x, layer.weight, layer.packed_weight, bias, self.max_packed_rows,
                                             layer.onednn_weight)

    def fused_kernel_args(self, layer: nn.Module) -> tuple[int, list, int, int]:
        """The linear as one fused layer's kernel takes it (kernels/cpu/decoder_layer.cpp): its
        kind (-1: this method), weight tensors, the rows up to which the packed kernel runs and
        activation bits (0: x stays bf16)."""
        return -1, [layer.weight, layer.packed_weight, layer.onednn_weight], self.max_packed_rows, 0

    @classmethod
    def pack_all(cls, layers: list[nn.Module]) -> None:
        """Give each loaded bf16 CPU layer its packed copies and this method."""
        if not layers:
            return
        shapes = [cpu_kernels.packed_shape(layer.weight) for layer in layers]
        arena = cpu_kernels.empty_mapped((sum(math.prod(s) for s in shapes),), torch.bfloat16, huge_pages=True)
        with_onednn = torch.backends.mkldnn.is_available()
        method, offset = cls(), 0
        for layer, shape in zip(layers, shapes):
            size = math.prod(shape)
            packed = cpu_kernels.pack_linear_weight(layer.weight, out=arena[offset:offset + size].view(shape))
            offset += size
            layer.register_buffer("packed_weight", packed, persistent=False)
            onednn = cpu_kernels.onednn_pack(layer.weight, owner=layer) if with_onednn else None
            layer.register_buffer("onednn_weight", onednn, persistent=False)
            layer.linear_method = method
