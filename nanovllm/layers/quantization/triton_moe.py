"""The GPU's MoE method: dense experts (as the plain method holds them) run by the grouped Triton
kernels (kernels/triton_moe.py), a fixed number of launches a layer that CUDA graphs capture."""

import torch
from torch import nn

from nanovllm.layers.activation import KERNEL_ACTIVATION_IDS
from nanovllm.layers.quantization.moe_methods import UnquantizedMoEMethod



class TritonMoEMethod(UnquantizedMoEMethod):
    graph_capturable = True

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
              ) -> torch.Tensor:
        from nanovllm.kernels.triton_moe import fused_moe  # imports triton
        return fused_moe(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                         KERNEL_ACTIVATION_IDS[layer.activation])
