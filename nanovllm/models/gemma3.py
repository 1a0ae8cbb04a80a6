"""Gemma 3 (text): Gemma 2's decoder with (1 + w) RMSNorms on q and k before RoPE and no
softcaps; local (sliding window) and global layers in its pattern (`layer_types`), each kind with
its own RoPE base and scaling (`rope_parameters` per kind)."""

from nanovllm.models.decoder import DecoderDescription, DecoderForCausalLM, sliding_layers


class Gemma3ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def describe(config) -> DecoderDescription:
        bias = getattr(config, "attention_bias", False)
        return DecoderDescription(
            qkv_bias=bias, o_bias=bias, qk_norm=True, norm_weight_offset=1.0, sandwich_norms=True,
            activation=config.hidden_activation, embedding_scale=config.hidden_size ** 0.5,
            attention_scale=config.query_pre_attn_scalar ** -0.5,
            attn_logit_softcap=getattr(config, "attn_logit_softcapping", None),
            final_logit_softcap=getattr(config, "final_logit_softcapping", None), **sliding_layers(config))
