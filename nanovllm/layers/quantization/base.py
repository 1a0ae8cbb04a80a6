"""The interface every linear method implements."""

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethod(ABC):
    """Stores and multiplies one linear layer's weight: y = x W^T (+ b).

    `create_weights` gives the layer the parameters a checkpoint loads into (each wired to the
    layer's `weight_loader`); `process_weights_after_loading` may then repack them for a kernel;
    `apply` runs the product, and `embed` looks rows up where the weight is an embedding's.
    Chosen once, when the layer is built (quantization/chooser.py): no layer checks a device or a
    flag."""

    # Whether a step streams the whole loaded weight from memory (few rows of x against every
    # weight row), so that the platform should lay it where memory reads fastest.
    streams_weight: bool = False

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool) -> None: ...

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def logits(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """hidden W^T for an LM head, in fp32: the sampler's dtype, and the dtype a method whose
        kernel sums in fp32 keeps unrounded (bf16 logits of a 135M model tie at its top tokens)."""
        return self.apply(layer, hidden, None).float()

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight, for an embedding that stores its table through this method."""
        return F.embedding(ids, layer.weight)


def create_bias(layer: nn.Module, output_size: int, bias: bool) -> None:
    """The layer's dense bias parameter, wired to its weight loader, or None."""
    if bias:
        layer.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
        layer.bias.weight_loader = layer.weight_loader
    else:
        layer.register_parameter("bias", None)
