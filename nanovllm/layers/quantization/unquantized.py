"""The plain method: a dense [output, input] weight in the model's dtype, multiplied by F.linear."""

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.quantization.base import LinearMethod, create_bias


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool) -> None:
        layer.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader
        create_bias(layer, output_size, bias)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)
