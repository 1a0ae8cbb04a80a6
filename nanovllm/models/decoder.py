"""The dense decoder every family is built as, on the parallel layers: embedding, decoder layers
(attention and a gated MLP, each behind an RMSNorm), final norm, LM head.

A family states how it differs as data, a `DecoderDescription` read from its HF config by its
class's `describe` (models/<family>.py): biases, q/k norm, the norms' weight offset and whether
the attention's and the MLP's outputs are normed too, the MLP's activation, the embedding scale,
the attention scale and logit softcap, each layer's kind (full or sliding window, with its own
RoPE), the final logit softcap, and for a mixture of experts (`MoEDescription`) which layers'
MLPs are sparse and how they route. Platforms read the same description off the built layers (the
CPU's fused path), so a new dense family needs no forward of its own.

Parameter names mirror HF's, except that q/k/v and gate/up are packed (`qkv_proj`,
`gate_up_proj`); `packed_modules_mapping` tells the loader how HF names map onto them (a family
whose checkpoints store them packed already maps nothing). Every module that holds a weight is
built with its prefix (its name in the model), by which the LinearMethodChooser gives it its
linear method. A sparse layer's block (`SparseMoeBlock`) is its family's HF module (`mlp`, or
Mixtral's `block_sparse_moe`): a router (`gate`), the experts as one FusedMoE layer (`experts`,
loaded through the family's `expert_params_mapping`) and, in Qwen2-MoE, a shared expert beside
them with its sigmoid gate.
"""

from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.distributed.parallel_state import TPGroup
from nanovllm.layers.activation import gated_activation
from nanovllm.layers.attention import Attention
from nanovllm.layers.decoder_layers import DecoderLayers
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.fused_moe import FusedMoE
from nanovllm.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear,
                                    divide)
from nanovllm.layers.quantization.chooser import LinearMethodChooser
from nanovllm.layers.rotary_embedding import RotaryEmbedding, get_rope, rope_parameters_from_config

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class MoEDescription:
    """A mixture of experts' MLPs: `sparse_layers` says which layers have one (the others keep a
    dense MLP of the config's intermediate_size)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # an expert's
    renormalize: bool  # the chosen experts' weights renormalised to sum to 1
    sparse_layers: tuple[bool, ...]
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert; 0: none
    module_name: str = "mlp"  # the block's HF name (Mixtral: block_sparse_moe)


@dataclass(frozen=True)
class DecoderDescription:
    """How a family's decoder differs from Llama's (the defaults)."""

    qkv_bias: bool = False  # bias on the q/k/v projections
    o_bias: bool = False  # bias on the output projection
    mlp_bias: bool = False  # bias on the MLP's projections
    qk_norm: bool = False  # a per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3)
    # Every RMSNorm multiplies by (norm_weight_offset + w): Gemma's checkpoints store w around 0.
    norm_weight_offset: float = 0.0
    # A norm on the attention's and the MLP's outputs too, before each residual add (Gemma 2/3).
    sandwich_norms: bool = False
    activation: str = "silu"  # the gated MLP's, of layers/activation.py's GATED_ACTIVATIONS
    embedding_scale: float | None = None  # the embeddings multiplied by it (Gemma: sqrt(hidden))
    attention_scale: float | None = None  # q.k's scale; None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # scores become cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # the logits likewise
    # Each layer's kind (FULL_ATTENTION or SLIDING_ATTENTION), which picks its RoPE (a config may
    # give each kind its own) and, when `sliding_window` is set, whether it sees only the last that
    # many positions (its own included). Empty: every layer full.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    moe: MoEDescription | None = None

    def layer_type(self, index: int) -> str:
        return self.layer_types[index] if self.layer_types else FULL_ATTENTION

    def window(self, index: int) -> int | None:
        return self.sliding_window if self.layer_type(index) == SLIDING_ATTENTION else None

    def sparse(self, index: int) -> bool:
        return self.moe is not None and self.moe.sparse_layers[index]


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_layers(config) -> dict:
    """The description's `layer_types` and `sliding_window` from an HF config: each layer's kind as
    the config states it (`layer_types`), or, for a config with only a `sliding_window`
    (Mistral), every layer sliding. A window at least as long as any position the model accepts
    never slides (the kinds still pick each layer's RoPE)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None and window is not None:
        types = [SLIDING_ATTENTION] * config.num_hidden_layers
    if not types:
        return {}
    if len(types) != config.num_hidden_layers or not set(types) <= {FULL_ATTENTION, SLIDING_ATTENTION}:
        raise ValueError(f"layer_types={types!r}: expected {config.num_hidden_layers} entries of "
                         f"{FULL_ATTENTION!r} or {SLIDING_ATTENTION!r}")
    if window is not None and window < 1:
        raise ValueError(f"sliding_window={window} must be at least 1")
    slides = window is not None and window < config.max_position_embeddings
    return {"layer_types": tuple(types), "sliding_window": window if slides else None}


class DecoderAttention(nn.Module):
    def __init__(self, config, description: DecoderDescription, index: int, rotary_emb: RotaryEmbedding,
                 tp_group: TPGroup, linear_methods: LinearMethodChooser | None, prefix: str):
        super().__init__()
        head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, tp_group=tp_group, bias=description.qkv_bias,
                                          linear_methods=linear_methods, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size,
                                        tp_group=tp_group, bias=description.o_bias, linear_methods=linear_methods,
                                        prefix=f"{prefix}.o_proj")
        self.rotary_emb = rotary_emb  # shared by every layer of its kind: its cache is large
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.head_dim = head_dim
        if description.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, description.norm_weight_offset)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, description.norm_weight_offset)
        self.qk_norm = description.qk_norm
        scale = description.attention_scale if description.attention_scale is not None else head_dim ** -0.5
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim, scale,
                              sliding_window=description.window(index),
                              logit_softcap=description.attn_logit_softcap)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            q = self.q_norm(q.unflatten(-1, (-1, self.head_dim))).flatten(-2)
            k = self.k_norm(k.unflatten(-1, (-1, self.head_dim))).flatten(-2)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class DecoderMLP(nn.Module):
    """`reduce_results` False leaves the all-reduce of tensor-parallel partial sums to the caller."""

    def __init__(self, config, description: DecoderDescription, tp_group: TPGroup,
                 linear_methods: LinearMethodChooser | None, prefix: str, intermediate_size: int | None = None,
                 reduce_results: bool = True):
        super().__init__()
        intermediate_size = intermediate_size or config.intermediate_size
        divide(intermediate_size, tp_group.world_size, "intermediate_size")
        bias = description.mlp_bias
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [intermediate_size] * 2,
                                                       tp_group=tp_group, bias=bias, linear_methods=linear_methods,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, config.hidden_size, tp_group=tp_group, bias=bias,
                                           linear_methods=linear_methods, prefix=f"{prefix}.down_proj",
                                           reduce_results=reduce_results)
        self.act_fn = gated_activation(description.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """A sparse layer's MLP: the router's logits pick each token's experts; their weighted sum, plus
    the shared expert's output scaled by sigmoid of its gate where there is one, all-reduced once
    under tensor parallelism."""

    def __init__(self, config, description: DecoderDescription, tp_group: TPGroup,
                 linear_methods: LinearMethodChooser | None, prefix: str):
        super().__init__()
        moe = description.moe
        self.tp_group = tp_group
        # A token's experts must not depend on the rest of its step (batch invariance).
        self.gate = ReplicatedLinear(config.hidden_size, moe.num_experts, linear_methods=linear_methods,
                                     prefix=f"{prefix}.gate", batch_invariant=True)
        self.experts = FusedMoE(moe.num_experts, moe.top_k, config.hidden_size, moe.intermediate_size,
                                tp_group=tp_group, renormalize=moe.renormalize, activation=description.activation,
                                linear_methods=linear_methods, prefix=f"{prefix}.experts")
        self.shared_expert = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = DecoderMLP(config, description, tp_group, linear_methods, f"{prefix}.shared_expert",
                                            moe.shared_expert_intermediate_size, reduce_results=False)
            self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, linear_methods=linear_methods,
                                                       prefix=f"{prefix}.shared_expert_gate")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp_group.all_reduce(out)


class DecoderLayer(nn.Module):
    """(hidden, residual) in and out: each norm before a block adds the residual stream first.
    With sandwich norms the pre-MLP norm is HF's `pre_feedforward_layernorm` and
    `post_attention_layernorm` norms the attention's output; without, `post_attention_layernorm`
    is the pre-MLP norm (Llama's naming)."""

    def __init__(self, config, description: DecoderDescription, index: int, rotary_emb: RotaryEmbedding,
                 tp_group: TPGroup, linear_methods: LinearMethodChooser | None, prefix: str):
        super().__init__()
        self.description = description
        self.self_attn = DecoderAttention(config, description, index, rotary_emb, tp_group, linear_methods,
                                          f"{prefix}.self_attn")
        # The MLP under its family's HF name (`mlp`, or a sparse block's own).
        if description.sparse(index):
            self.mlp_name = description.moe.module_name
            mlp = SparseMoeBlock(config, description, tp_group, linear_methods, f"{prefix}.{self.mlp_name}")
        else:
            self.mlp_name = "mlp"
            mlp = DecoderMLP(config, description, tp_group, linear_methods, f"{prefix}.mlp")
        setattr(self, self.mlp_name, mlp)

        def norm() -> RMSNorm:
            return RMSNorm(config.hidden_size, config.rms_norm_eps, description.norm_weight_offset)

        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        if description.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); the next norm adds them."""
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        if self.description.sandwich_norms:
            hidden = self.post_attention_layernorm(hidden)
            hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
            return self.post_feedforward_layernorm(self.feed_forward(hidden)), residual
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.feed_forward(hidden), residual

    @property
    def feed_forward(self) -> nn.Module:
        """The layer's MLP: dense (DecoderMLP) or sparse (SparseMoeBlock)."""
        return getattr(self, self.mlp_name)


class DecoderModel(nn.Module):
    def __init__(self, config, description: DecoderDescription, tp_group: TPGroup,
                 linear_methods: LinearMethodChooser | None, prefix: str):
        super().__init__()
        head_dim = head_dim_of(config)
        # One rotary embedding for each kind of layer (Gemma 3's local and global layers differ).
        kinds = {kind: get_rope(head_dim, config.max_position_embeddings, rope_parameters_from_config(config, kind))
                 for kind in sorted(set(description.layer_types) or {FULL_ATTENTION})}
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_group=tp_group,
                                                   linear_methods=linear_methods, prefix=f"{prefix}.embed_tokens",
                                                   computes_logits=config.tie_word_embeddings)
        # The scale as the model's dtype holds it (HF multiplies by a tensor of that dtype).
        self.embedding_scale = (None if description.embedding_scale is None else
                                torch.tensor(description.embedding_scale, dtype=torch.get_default_dtype()).item())
        self.layers = DecoderLayers(DecoderLayer(config, description, i, kinds[description.layer_type(i)], tp_group,
                                                 linear_methods, f"{prefix}.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, description.norm_weight_offset)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.embedding_scale is not None:
            hidden = hidden * self.embedding_scale
        # The residual stream starts at zero (x + 0 is exactly x), so that every layer runs the
        # same code: one compiled graph serves them all.
        hidden, residual = self.layers(positions, hidden, torch.zeros_like(hidden))
        return self.norm(hidden, residual)[0]


class DecoderForCausalLM(nn.Module):
    """The model of a dense family; a family subclasses it with its `describe` (and its
    `packed_modules_mapping` where its checkpoints pack differently)."""

    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @staticmethod
    def describe(config) -> DecoderDescription:
        raise NotImplementedError

    def __init__(self, config, tp_group: TPGroup, linear_methods: LinearMethodChooser | None = None,
                 with_lm_head: bool = True):
        """Without the LM head (`with_lm_head` False) the model is a pooling model's: it gives final
        hidden states only, and has no compute_logits to call."""
        super().__init__()
        description = self.describe(config)
        self.model = DecoderModel(config, description, tp_group, linear_methods, "model")
        # A tied head is the embedding module itself (see layers/embed_head.py).
        self.lm_head = (None if not with_lm_head else self.model.embed_tokens if config.tie_word_embeddings else
                        ParallelLMHead(config.vocab_size, config.hidden_size, tp_group=tp_group,
                                       linear_methods=linear_methods, prefix="lm_head"))
        self.final_logit_softcap = description.final_logit_softcap

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] long -> final-normed hidden states [T, hidden_size]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [n, hidden_size] -> fp32 logits [n, vocab_size] on rank 0; None on other ranks."""
        logits = self.lm_head.logits(hidden)
        if logits is not None and self.final_logit_softcap is not None:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits
