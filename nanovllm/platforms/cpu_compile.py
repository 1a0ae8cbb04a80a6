"""torch.compile on CPU, the CPU's answer to CUDA graphs: decoder layers compiled a few at a
time into one graph that serves every step (prefill, decode and mixed), rounding as eager does.
"""

import types

import torch
from torch import nn

from nanovllm.platforms.inductor_rounding import UnfuseReducedPrecisionAddmm

# One object for every compile: Dynamo reuses a graph only for an equal backend, and the pass
# compares by identity.
COMPILE_OPTIONS = {"emulate_precision_casts": True, "post_grad_custom_post_pass": UnfuseReducedPrecisionAddmm()}

# Decoder layers per compiled call. Each call into a compiled graph costs tens of microseconds of
# Python and Dynamo, once per call and step; two layers a call halve that and divide every usual
# layer count, while more save less and compile longer (figures in benchmarks/RESULTS.md).
LAYERS_PER_GRAPH = 2


def compile_with_dynamic_tokens(module: nn.Module) -> None:
    """torch.compile `module`'s forward with the leading (token) dim of its tensor arguments
    dynamic and everything else static. The token dim is marked unbacked, a size the compiler
    may not specialise on (not even 1, which it otherwise gives a graph of its own), so one graph
    serves every step; static shapes elsewhere keep the guards cheap (the cache never resizes).

    emulate_precision_casts: the fused kernels round to bf16 wherever the eager code does (after
    the residual add, the norm, RoPE, SiLU). Without it Inductor keeps fused intermediates in
    fp32 and each layer drifts from eager by a bf16 ulp or so, which over a model's layers can
    turn a near-tied greedy token the other way. With it, and with matmuls rounded before the
    residual add as eager rounds them (see inductor_rounding), a layer's output equals eager's
    up to the order of the norm's sum (see test_compiled_layers_round_like_eager)."""
    compiled = torch.compile(module.forward, fullgraph=True, options=COMPILE_OPTIONS)

    def forward(*args):
        for arg in args:
            torch._dynamo.decorators.mark_unbacked(arg, 0)
        return compiled(*args)

    module.forward = forward


class LayerGroup(nn.Module):
    """Consecutive decoder layers as one call, (positions, hidden, residual) -> (hidden, residual):
    the unit compiled on CPU."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor):
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return hidden, residual


def with_own_code(cls: type, name: str) -> type:
    """A subclass of `cls` whose method `name` runs a copy of its code object. Dynamo keeps the
    graphs it compiled for a function on the function's code object, at most recompile_limit
    (8) of them: every engine made in a process (tests make dozens) would add its own to one
    shared list until Dynamo refused to compile; with a copy each engine's graphs are its own
    and go with it."""
    method = getattr(cls, name)
    code = method.__code__.replace()  # a new code object, equal to the old
    copy = types.FunctionType(code, method.__globals__, method.__name__, method.__defaults__, method.__closure__)
    return type(cls.__name__, (cls,), {name: copy, "__module__": cls.__module__, "__doc__": cls.__doc__})


def compile_decoder_layers(decoder: nn.Module) -> None:
    """Replace `decoder.layers` (called in turn as layer(positions, hidden, residual)) by
    compiled groups of LAYERS_PER_GRAPH of them, which the decoder calls the same way.

    Groups of layers, not the whole model: every group of the model shares a single compiled
    graph (parameters and cache are graph inputs), so a model's layers compile once (a last,
    shorter group adds a graph; another engine compiles its own, mostly from Inductor's caches);
    the whole model as one graph compiles many times longer. Attention is one opaque op
    and the linear op picks its kernel by row count at run time, so one graph serves prefill,
    decode and mixed steps alike. Weights are loaded by then: the groups' parameter names no
    longer matter."""
    layers = list(decoder.layers)
    group_class = with_own_code(LayerGroup, "forward")
    groups = [group_class(layers[i:i + LAYERS_PER_GRAPH]) for i in range(0, len(layers), LAYERS_PER_GRAPH)]
    for group in groups:
        compile_with_dynamic_tokens(group)
    decoder.layers = nn.ModuleList(groups)
