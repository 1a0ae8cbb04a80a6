"""The CPU bf16 method: the dense weight plus two copies laid out for the CPU kernels
(nanovllm/kernels/cpu.py): the packed decode kernel's panels, which a step of a few rows streams
once at memory bandwidth, and oneDNN's own blocked layout, which saves oneDNN reordering the
weight on every larger step. The `linear` op picks between them by row count.

The copies cost twice the weights' size in RAM. One method object serves every layer of a model
(the platform makes it once): it sizes one arena for all their packed copies as the layers are
built, in transparent huge pages (hardware prefetchers stop at page boundaries), and fills each
layer's part of it once the layer is loaded.

Made `every_step_packed`, it runs the packed kernel for any number of rows and keeps no oneDNN
copy: each output element is then computed alike whatever the step's size (batch invariance), for
weights small enough that the GEMM's speed does not matter (a router)."""

import math

import torch
from torch import nn

from nanovllm.kernels import cpu as cpu_kernels
from nanovllm.layers.quantization.unquantized import UnquantizedLinearMethod


class CPUPackedBF16LinearMethod(UnquantizedLinearMethod):
    def __init__(self, every_step_packed: bool = False):
        self.every_step_packed = every_step_packed
        # A constant to the compiled graphs.
        self.max_packed_rows = 2 ** 62 if every_step_packed else cpu_kernels.packed_max_rows()
        self.arena_elements = 0  # every layer built with this method: the arena's size
        self.arena: torch.Tensor | None = None  # mapped at the first layer's turn, once all are built
        self.arena_filled = 0

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool) -> None:
        super().create_weights(layer, input_size, output_size, bias)
        self.arena_elements += math.prod(cpu_kernels.packed_shape(layer.weight))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """The layer's packed copies: panels in its part of the arena, and oneDNN's."""
        if self.arena is None:
            self.arena = cpu_kernels.empty_mapped((self.arena_elements,), torch.bfloat16, huge_pages=True)
        shape = cpu_kernels.packed_shape(layer.weight)
        size = math.prod(shape)
        part = self.arena[self.arena_filled:self.arena_filled + size].view(shape)
        self.arena_filled += size
        layer.register_buffer("packed_weight", cpu_kernels.pack_linear_weight(layer.weight, out=part),
                              persistent=False)
        onednn = (cpu_kernels.onednn_pack(layer.weight, owner=layer)
                  if torch.backends.mkldnn.is_available() and not self.every_step_packed else None)
        layer.register_buffer("onednn_weight", onednn, persistent=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.nanovllm_cpu.linear(x, layer.weight, layer.packed_weight, bias, self.max_packed_rows,
                                             layer.onednn_weight)

    def fused_kernel_args(self, layer: nn.Module) -> tuple[int, list, int, int]:
        """The linear as one fused layer's kernel takes it (kernels/cpu/decoder_layer.cpp): its
        kind (-1: this method), weight tensors, the rows up to which the packed kernel runs and
        activation bits (0: x stays bf16)."""
        return -1, [layer.weight, layer.packed_weight, layer.onednn_weight], self.max_packed_rows, 0
