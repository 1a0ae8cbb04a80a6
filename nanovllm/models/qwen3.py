"""Qwen3: the Llama decoder with per-head RMSNorm on q and k before RoPE.

Its head_dim is set in the config and need not equal hidden_size / num_attention_heads.
"""

from nanovllm.models.decoder import DecoderDescription, DecoderForCausalLM, sliding_layers


class Qwen3ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def describe(config) -> DecoderDescription:
        bias = getattr(config, "attention_bias", False)
        return DecoderDescription(qkv_bias=bias, o_bias=bias, qk_norm=True, activation=config.hidden_act,
                                  **sliding_layers(config))
