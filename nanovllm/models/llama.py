"""The Llama decoder family (Llama, Mistral; Qwen2 and Qwen3 subclass it) on parallel layers.

Parameter names mirror HF's, except that q/k/v and gate/up are packed (`qkv_proj`,
`gate_up_proj`); `packed_modules_mapping` tells the loader how HF names map onto them. Every
module that holds a weight is built with its prefix (its name in the model), by which the
LinearMethodChooser gives it its linear method.
Family differences are a `LlamaVariant` chosen per class from the config.
"""

from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.distributed.parallel_state import TPGroup
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.decoder_layers import DecoderLayers
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear, divide
from nanovllm.layers.quantization.chooser import LinearMethodChooser
from nanovllm.layers.rotary_embedding import RotaryEmbedding, get_rope, rope_parameters_from_config


@dataclass(frozen=True)
class LlamaVariant:
    qkv_bias: bool  # bias on q/k/v projections
    o_bias: bool  # bias on the output projection
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)


class LlamaAttention(nn.Module):
    def __init__(self, config, variant: LlamaVariant, rotary_emb: RotaryEmbedding, tp_group: TPGroup,
                 linear_methods: LinearMethodChooser | None, prefix: str):
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, tp_group=tp_group, bias=variant.qkv_bias,
                                          linear_methods=linear_methods, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size,
                                        tp_group=tp_group, bias=variant.o_bias, linear_methods=linear_methods,
                                        prefix=f"{prefix}.o_proj")
        self.rotary_emb = rotary_emb  # one module shared by all layers: its cache is large
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.head_dim = head_dim
        if variant.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.qk_norm = variant.qk_norm
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim, head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            q = self.q_norm(q.unflatten(-1, (-1, self.head_dim))).flatten(-2)
            k = self.k_norm(k.unflatten(-1, (-1, self.head_dim))).flatten(-2)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, config, tp_group: TPGroup, linear_methods: LinearMethodChooser | None, prefix: str):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (only 'silu')")
        divide(config.intermediate_size, tp_group.world_size, "intermediate_size")
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2,
                                                       tp_group=tp_group, bias=bias, linear_methods=linear_methods,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, tp_group=tp_group, bias=bias,
                                           linear_methods=linear_methods, prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, variant: LlamaVariant, rotary_emb: RotaryEmbedding, tp_group: TPGroup,
                 linear_methods: LinearMethodChooser | None, prefix: str):
        super().__init__()
        self.self_attn = LlamaAttention(config, variant, rotary_emb, tp_group, linear_methods, f"{prefix}.self_attn")
        self.mlp = LlamaMLP(config, tp_group, linear_methods, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); the next norm adds them."""
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config, variant: LlamaVariant, tp_group: TPGroup, linear_methods: LinearMethodChooser | None,
                 prefix: str):
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary_emb = get_rope(head_dim, config.max_position_embeddings, rope_parameters_from_config(config))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_group=tp_group,
                                                   linear_methods=linear_methods, prefix=f"{prefix}.embed_tokens",
                                                   computes_logits=config.tie_word_embeddings)
        self.layers = DecoderLayers(LlamaDecoderLayer(config, variant, rotary_emb, tp_group, linear_methods,
                                                      f"{prefix}.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # The residual stream starts at zero (x + 0 is exactly x), so that every layer runs the
        # same code: one compiled graph serves them all.
        hidden = self.embed_tokens(input_ids)
        hidden, residual = self.layers(positions, hidden, torch.zeros_like(hidden))
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @staticmethod
    def variant(config) -> LlamaVariant:
        bias = getattr(config, "attention_bias", False)
        return LlamaVariant(qkv_bias=bias, o_bias=bias, qk_norm=False)

    def __init__(self, config, tp_group: TPGroup, linear_methods: LinearMethodChooser | None = None):
        super().__init__()
        window = getattr(config, "sliding_window", None)
        # A window at least as long as any position the model accepts never slides.
        if window is not None and window < config.max_position_embeddings:
            raise ValueError(f"sliding_window={window} is not supported (only full attention)")
        self.model = LlamaModel(config, self.variant(config), tp_group, linear_methods, "model")
        # A tied head is the embedding module itself (see layers/embed_head.py).
        self.lm_head = (self.model.embed_tokens if config.tie_word_embeddings else
                        ParallelLMHead(config.vocab_size, config.hidden_size, tp_group=tp_group,
                                       linear_methods=linear_methods, prefix="lm_head"))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] long -> final-normed hidden states [T, hidden_size]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [n, hidden_size] -> fp32 logits [n, vocab_size] on rank 0; None on other ranks."""
        return self.lm_head.logits(hidden)
