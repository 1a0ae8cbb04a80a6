"""A model's decoder layers as one module, called as layers(positions, hidden, residual) ->
(hidden, residual), each layer taking and returning that pair in turn.

How the stack runs is decided when it is built, by the platform the model is built for
(`Platform.layer_runner`, asked through layers/build_context.py): in turn (the default), or by a
runner the platform makes, such as the CPU's one fused kernel call or its compiled groups of
layers. A runner is a plain callable holding the layers, not a submodule: the model's modules,
their classes and their parameter names (`layers.<i>.…`, this being a ModuleList) stay as built.
"""

from collections.abc import Callable, Iterable

import torch
from torch import nn

from nanovllm.layers.build_context import platform_being_built_for


def run_in_turn(layers: Iterable[nn.Module], positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    for layer in layers:
        hidden, residual = layer(positions, hidden, residual)
    return hidden, residual


class DecoderLayers(nn.ModuleList):
    def __init__(self, layers: Iterable[nn.Module]):
        super().__init__(layers)
        platform = platform_being_built_for()
        # Decided once; None: in turn.
        self.runner: Callable | None = None if platform is None else platform.layer_runner(list(self))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.runner is not None:
            return self.runner(positions, hidden, residual)
        return run_in_turn(self, positions, hidden, residual)
