"""A model's decoder layers as one kernel call on CPU (`nanovllm_cpu::decoder_layers`,
kernels/cpu/decoder_layer.cpp), in place of compiling them, where every part of every layer
already runs on the CPU kernels: bf16 activations with the elementwise kernels on (the caller's
to know), each linear on a method that says how the kernel calls it (`fused_kernel_args`: the
GGUF block method and the packed bf16 one), one tensor-parallel rank, and, step by step, the CPU
attention backend. The call reads each layer's family description (models/decoder.py's
DecoderDescription: norms, activation, window, softcap), so every family built as a
DecoderLayer takes it, its MLP dense or a mixture of experts whose experts the CPU's MoE kernel
runs (a router, then the experts in blocks or packed bf16); what it lacks, `unfusable_reason` names.

The call runs, layer after layer, the kernels the eager layer would call, in its order and with
its roundings, so its output is the eager layers' bit for bit; what it saves is the glue between
them. A compiled layer still pays Python for every kernel call in its wrapper and for the call
into the graph, a large share of a single-sequence decode step (benchmarks/RESULTS.md); the
fused layers pay one call a step.

The platform makes the runner when the model's decoder stack is built (layers/decoder_layers.py),
from what is known then (linear methods, dtypes, tensor parallelism); the call's weights are
gathered at its first call, once they are loaded and repacked.
"""

import torch
from torch import nn

from nanovllm.attention.base import get_forward_context
from nanovllm.attention.cpu import CPUBackend
from nanovllm.layers.activation import KERNEL_ACTIVATION_IDS
from nanovllm.layers.decoder_layers import run_in_turn
from nanovllm.models.decoder import DecoderLayer, SparseMoeBlock



# A dense MLP's router slots: never read.
NO_ROUTER = (-1, [None, None, None], 0, 0, None)


def unfusable_reason(layers: list[nn.Module]) -> str | None:
    """Why `layers` (as built, before loading) cannot run as one kernel call, or None where they
    can. The caller knows whether the model is on the elementwise kernels in bf16."""
    if not layers:
        return "the model has no decoder layers"
    for i, layer in enumerate(layers):
        reason = _layer_reason(layer)
        if reason is not None:
            return f"layer {i}: {reason}"
    if len({(layer.input_layernorm.eps, layer.self_attn.attn.scale, layer.self_attn.attn.logit_softcap)
            for layer in layers}) != 1:
        return "the layers differ in norm eps, attention scale or softcap (the call takes one of each)"
    return None


def _norms(layer: DecoderLayer) -> list[nn.Module]:
    attn = layer.self_attn
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if layer.description.sandwich_norms:
        norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
    if attn.qk_norm:
        norms += [attn.q_norm, attn.k_norm]
    return norms


def _layer_reason(layer: nn.Module) -> str | None:
    if not isinstance(layer, DecoderLayer):
        return f"{type(layer).__name__} is not a DecoderLayer (models/decoder.py), the only kind the kernel runs"
    attn = layer.self_attn
    mlp = layer.feed_forward
    if isinstance(mlp, SparseMoeBlock):
        if mlp.shared_expert is not None:
            return "its mixture of experts has a shared expert (the call runs routed experts only)"
        if not hasattr(mlp.experts.moe_method, "fused_kernel_args"):
            return f"its experts' method ({type(mlp.experts.moe_method).__name__}) has no fused kernel"
    if layer.description.activation not in KERNEL_ACTIVATION_IDS:
        return f"its activation {layer.description.activation!r} has no kernel (only {', '.join(KERNEL_ACTIVATION_IDS)})"
    norms = _norms(layer)
    if any(norm.weight.dtype != torch.bfloat16 for norm in norms):
        return "a norm's weight is not bfloat16"
    if any(norm.eps != norms[0].eps for norm in norms):
        return "its norms differ in eps"
    for name, linear in (("qkv_proj", attn.qkv_proj), ("o_proj", attn.o_proj), *_mlp_linears(mlp)):
        if not hasattr(linear.linear_method, "fused_kernel_args"):
            return f"{name}'s linear method ({type(linear.linear_method).__name__}) has no fused kernel"
    if attn.qkv_proj.tp_group.world_size != 1:
        return "it runs tensor-parallel"
    if attn.rotary_emb.cos_sin_cache.dtype != torch.float32:
        return "its RoPE cache is not float32"
    return None


def _mlp_linears(mlp: nn.Module) -> list[tuple[str, nn.Module]]:
    """The linear layers of an MLP the call multiplies through their linear methods."""
    if isinstance(mlp, SparseMoeBlock):
        return [("gate", mlp.gate)]
    return [("gate_up_proj", mlp.gate_up_proj), ("down_proj", mlp.down_proj)]


def kernel_args(layer: DecoderLayer) -> tuple[list, list[int]]:
    """A layer's share of the call's weights and settings, in the layout decoder_layer.cpp names."""
    attn, description, mlp = layer.self_attn, layer.description, layer.feed_forward
    sandwich = description.sandwich_norms
    weights = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
               layer.pre_feedforward_layernorm.weight if sandwich else None,
               layer.post_feedforward_layernorm.weight if sandwich else None, attn.rotary_emb.cos_sin_cache,
               attn.q_norm.weight if attn.qk_norm else None, attn.k_norm.weight if attn.qk_norm else None]
    # Each linear's (kind, weight tensors, row threshold, activation bits), in the call's order
    # (qkv, o, gate_up, down, router): a mixture of experts' gate_up and down are its experts'.
    linears = [linear.linear_method.fused_kernel_args(linear) + (linear.bias,) for linear in (attn.qkv_proj, attn.o_proj)]
    moe = (0, 0, 0, 0)  # experts, experts a token, renormalised, an expert's intermediate size
    if isinstance(mlp, SparseMoeBlock):
        experts = mlp.experts
        linears += [(*args, None) for args in experts.moe_method.fused_kernel_args(experts)]
        linears.append(mlp.gate.linear_method.fused_kernel_args(mlp.gate) + (mlp.gate.bias,))
        moe = (experts.num_experts, experts.top_k, int(experts.renormalize), experts.intermediate_per_rank)
    else:
        linears += [linear.linear_method.fused_kernel_args(linear) + (linear.bias,)
                    for linear in (mlp.gate_up_proj, mlp.down_proj)]
        linears.append(NO_ROUTER)
    for _, tensors, _, _, bias in linears:
        weights += [*tensors, bias]
    settings = [attn.attn.num_heads, attn.attn.num_kv_heads, attn.head_dim, attn.attn.sliding_window,
                int(sandwich), KERNEL_ACTIVATION_IDS[description.activation], *moe]
    return weights, [*settings, *(kind for kind, *_ in linears), *(rows for _, _, rows, _, _ in linears),
                     *(bits for *_, bits, _ in linears)]


class FusedDecoderLayers:
    """Runs DecoderLayers (only where unfusable_reason is None) as one kernel call; on any other
    attention backend the layers run in turn."""

    def __init__(self, layers: list[DecoderLayer]):
        self.layers = layers
        self.weights: list | None = None  # gathered at the first call: loaded and repacked by then
        self.settings: list[int] = []
        self.attentions = [layer.self_attn.attn for layer in layers]
        self.eps = layers[0].input_layernorm.eps

    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor):
        ctx = get_forward_context()
        if type(ctx.backend) is not CPUBackend:
            return run_in_turn(self.layers, positions, hidden, residual)
        if self.weights is None:
            self.weights = []
            for layer in self.layers:
                weights, settings = kernel_args(layer)
                self.weights += weights
                self.settings += settings
        layout = ctx.metadata
        # The caches are read at each call: the engine binds them after the layers are built.
        first = self.attentions[0]
        return torch.ops.nanovllm_cpu.decoder_layers(
            hidden, residual, positions, self.weights, self.settings, self.eps, first.scale, first.logit_softcap,
            [attn.k_cache for attn in self.attentions], [attn.v_cache for attn in self.attentions],
            layout.slot_mapping, layout.cu_seqlens_q, layout.context_lens, layout.block_tables)
