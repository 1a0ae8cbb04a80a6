"""The CPU's MoE method for dense bf16 experts: each expert's gate/up and down weights packed once
loaded for the packed linear kernel (kernels/cpu/linear.cpp), and the experts run by one kernel
call a layer (`packed_moe`, kernels/cpu/moe.cpp), which groups the step's tokens by expert, runs
each selected expert's rows through the packed kernel and sums each token's experts.

The dense weights the checkpoint loads into are dropped once packed: the packed copies are the
only ones kept.
"""

import torch
from torch import nn

from nanovllm.kernels import cpu as cpu_kernels
from nanovllm.layers.activation import KERNEL_ACTIVATION_IDS
from nanovllm.layers.quantization.moe_methods import UnquantizedMoEMethod



class CPUPackedBF16MoEMethod(UnquantizedMoEMethod):
    streams_weight = True  # a decode step reads every selected expert's packed weights

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        for name in ("w13_weight", "w2_weight"):
            param = getattr(layer, name)
            param.data = torch.stack([cpu_kernels.pack_linear_weight(expert) for expert in param.data])

    def fused_kernel_args(self, layer: nn.Module) -> list[tuple[int, list, int, int]]:
        """The experts as a fused layer's kernel takes them (kernels/cpu/decoder_layer.cpp): kind -1
        (packed bf16) for gate_up and down, their packed weights."""
        return [(-1, [layer.w13_weight, None, None], 0, 0), (-1, [layer.w2_weight, None, None], 0, 0)]

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
              ) -> torch.Tensor:
        return torch.ops.nanovllm_cpu.packed_moe(x, topk_ids, topk_weights, layer.w13_weight, layer.w2_weight,
                                                 layer.intermediate_per_rank, KERNEL_ACTIVATION_IDS[layer.activation])
