"""The CPU GGUF MoE method: a mixture of experts' weights kept in their GGUF block formats and run by
one kernel call a layer (`gguf_moe`, kernels/cpu/moe.cpp), which groups the step's tokens by the
expert they chose, reads each selected expert's blocks once, and sums each token's experts.

All experts' gate and up rows lie in one byte tensor ([experts x 2 x intermediate, row bytes]: an
expert's gate rows, then its up rows) and their down rows in another ([experts x hidden, row
bytes]), each repacked at load into its type's lanes layout as the linear methods' blocks are
(cpu_gguf.py). Gate and up share one type; down may have its own (Q4_K_M keeps some layers' down
projections in Q6_K). x is quantized to each projection's activation bits as a linear layer of that
type would be, so an expert's output is what two such linear layers would give, bit for bit.
"""

import torch
from torch import nn

from nanovllm.layers.activation import KERNEL_ACTIVATION_IDS
from nanovllm.layers.quantization.cpu_gguf import activation_bits, blocks_of, kernel_blocks
from nanovllm.layers.quantization.moe_methods import MoEMethod
from nanovllm.loader.quantized import BLOCK_TYPES, QuantizedTensor, row_bytes

# Rows of an expert up to which its weight rows stream from their blocks (the row kernel, in passes
# of eight rows), above which its rows run the tiled kernel: an expert's few hundred KB stay in
# cache between passes, so streaming beats decoding them into tiles further than a dense layer's
# threshold (cpu_gguf.MAX_STREAMING_ROWS; figures in benchmarks/RESULTS.md). Either gives the same bits.
MOE_MAX_STREAMING_ROWS = 64


class CPUGGUFMoEMethod(MoEMethod):
    streams_weight = True  # a decode step reads every selected expert's blocks

    def __init__(self, w13_type: str, w2_type: str):
        self.types = {"gate": w13_type, "up": w13_type, "down": w2_type}
        self.w13_type, self.w2_type = w13_type, w2_type
        self.w13_kernel_type, self.w2_kernel_type = BLOCK_TYPES[w13_type], BLOCK_TYPES[w2_type]

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        layer.w13_weight = nn.Parameter(torch.empty(num_experts * 2 * intermediate_size,
                                                    row_bytes(self.w13_type, hidden_size), dtype=torch.uint8),
                                        requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(num_experts * hidden_size,
                                                   row_bytes(self.w2_type, intermediate_size), dtype=torch.uint8),
                                       requires_grad=False)

    def expert_rows(self, layer: nn.Module, param: nn.Parameter, expert: int, projection: str) -> torch.Tensor:
        if projection == "down":
            return param.data[expert * self.hidden_size:(expert + 1) * self.hidden_size]
        first = (2 * expert + (projection == "up")) * self.intermediate_size
        return param.data[first:first + self.intermediate_size]

    def checkpoint_rows(self, loaded: QuantizedTensor, projection: str) -> torch.Tensor:
        return blocks_of(loaded, self.types[projection], f" for the experts' {projection} projection")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.w13_weight.data, self.w13_kernel_type = kernel_blocks(layer.w13_weight.data, self.w13_type,
                                                                    self.hidden_size)
        layer.w2_weight.data, self.w2_kernel_type = kernel_blocks(layer.w2_weight.data, self.w2_type,
                                                                  self.intermediate_size)

    def fused_kernel_args(self, layer: nn.Module) -> list[tuple[int, list, int, int]]:
        """The experts as a fused layer's kernel takes them (kernels/cpu/decoder_layer.cpp): its
        gate_up and down linears' (kind, weight tensors, streaming rows, activation bits)."""
        return [(self.w13_kernel_type, [layer.w13_weight, None, None], MOE_MAX_STREAMING_ROWS,
                 activation_bits([self.w13_type])),
                (self.w2_kernel_type, [layer.w2_weight, None, None], MOE_MAX_STREAMING_ROWS,
                 activation_bits([self.w2_type]))]

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
              ) -> torch.Tensor:
        return torch.ops.nanovllm_cpu.gguf_moe(
            x, topk_ids, topk_weights, layer.w13_weight, self.w13_kernel_type, layer.w2_weight, self.w2_kernel_type,
            self.intermediate_size, KERNEL_ACTIVATION_IDS[layer.activation], MOE_MAX_STREAMING_ROWS,
            activation_bits([self.w13_type]), activation_bits([self.w2_type]))
