"""Modules with a forward per platform (vLLM's CustomOp shape): each elementwise op states its
plain PyTorch forward (`forward_native`) and, where a platform has kernels for it, that
platform's (`forward_cpu`, `forward_cuda`); which one runs is decided once, when the module is
built, by the platform the model is built for (layers/build_context.py's `built_for`: its
`choose_forward`). Nothing is swapped after load: a module keeps its class, and its forward is
the one it was built with.

Outside `built_for` (a layer made in a test, a tool) modules run `forward_native`.
"""

from torch import nn

from nanovllm.layers.build_context import platform_being_built_for


class CustomOp(nn.Module):
    """An op whose forward is chosen at construction among forward_native / _cpu / _cuda."""

    def __init__(self):
        super().__init__()
        platform = platform_being_built_for()
        self._forward = self.forward_native if platform is None else platform.choose_forward(self)

    def forward(self, *args, **kwargs):
        return self._forward(*args, **kwargs)

    @property
    def forward_name(self) -> str:
        """Which forward this module was built with ("forward_native", "forward_cpu", ...)."""
        return self._forward.__name__

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    # A platform without a kernel for the op runs the native forward.
    def forward_cpu(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)
