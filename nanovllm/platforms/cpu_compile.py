"""torch.compile on CPU, the CPU's answer to CUDA graphs: decoder layers compiled a few at a
time into one graph that serves every step (prefill, decode and mixed), rounding as eager does,
and called after the warm-up without Dynamo in between.
"""

import types

import torch
from torch import nn
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from nanovllm.platforms.inductor_rounding import UnfuseReducedPrecisionAddmm

# One object for every compile: Dynamo reuses a graph only for an equal backend, and the pass
# compares by identity.
COMPILE_OPTIONS = {"emulate_precision_casts": True, "post_grad_custom_post_pass": UnfuseReducedPrecisionAddmm()}

# Decoder layers per compiled call. Each call into a compiled graph costs some microseconds of
# Python, once per call and step; two layers a call halve that and divide every usual layer
# count, while more save less and compile longer (figures in benchmarks/RESULTS.md).
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
    graphs it compiled for a function on the function's code object: with a copy for each kind
    of group of each engine, each code object gets exactly one graph (the one call_directly
    calls), and graphs go with their engine instead of piling up on one code object past
    Dynamo's recompile limit (tests make dozens of engines in a process)."""
    method = getattr(cls, name)
    code = method.__code__.replace()  # a new code object, equal to the old
    copy = types.FunctionType(code, method.__globals__, method.__name__, method.__defaults__, method.__closure__)
    return type(cls.__name__, (cls,), {name: copy, "__module__": cls.__module__, "__doc__": cls.__doc__})


def compile_decoder_layers(decoder: nn.Module) -> None:
    """Replace `decoder.layers` (called in turn as layer(positions, hidden, residual)) by
    compiled groups of LAYERS_PER_GRAPH of them, which the decoder calls the same way.

    Groups of layers, not the whole model: every full group of the model shares a single
    compiled graph (parameters and cache are graph inputs), so a model's layers compile once (a
    last, shorter group adds a graph; another engine compiles its own, mostly from Inductor's
    caches); the whole model as one graph compiles many times longer. Attention is one opaque op
    and the linear op picks its kernel by row count at run time, so one graph serves prefill,
    decode and mixed steps alike. Weights are loaded by then: the groups' parameter names no
    longer matter."""
    layers = list(decoder.layers)
    sizes = [min(LAYERS_PER_GRAPH, len(layers) - i) for i in range(0, len(layers), LAYERS_PER_GRAPH)]
    group_classes = {size: with_own_code(LayerGroup, "forward") for size in set(sizes)}
    groups, start = [], 0
    for size in sizes:
        groups.append(group_classes[size](layers[start:start + size]))
        start += size
    for group in groups:
        compile_with_dynamic_tokens(group)
    decoder.layers = nn.ModuleList(groups)


def call_directly(decoder: nn.Module) -> None:
    """After the warm-up compiled the groups of compile_decoder_layers: each group calls the code
    Dynamo made of its forward (which calls the compiled graph) as a plain function, without
    Dynamo's frame hook, cache lookup and guards in between. So a step cannot trigger a
    recompile (a changed intra-op thread count, which Dynamo guards on, no longer matters), and
    no process-wide guard setting is needed that would also reach the user's own compiled code.
    Nothing is lost that a step needs: steps pass what the warm-up passed (inference tensors of
    the same dtypes, devices and static shapes; the token count is unbacked), and the graph
    still asserts its inputs' sizes and strides. Dynamo's cache is read through its debug
    accessor, the one view of it there is."""
    for group in decoder.layers:
        code = type(group).forward.__code__
        entries = _debug_get_cache_entry_list(code)
        if len(entries) != 1:
            raise RuntimeError(f"expected the warm-up to compile one graph per group, found {len(entries)}")
        function = types.FunctionType(entries[0].code, type(group).forward.__globals__, "forward")
        group.forward = types.MethodType(function, group)
