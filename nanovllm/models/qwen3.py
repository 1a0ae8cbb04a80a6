"""Qwen3: the Llama architecture with per-head RMSNorm on q and k before RoPE.

Its head_dim is set in the config and need not equal hidden_size / num_attention_heads.
"""

from nanovllm.models.llama import LlamaForCausalLM, LlamaVariant


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def variant(config) -> LlamaVariant:
        bias = getattr(config, "attention_bias", False)
        return LlamaVariant(qkv_bias=bias, o_bias=bias, qk_norm=True)
