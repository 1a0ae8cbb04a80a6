"""Gemma 2: (1 + w) RMSNorms, also on the attention's and the MLP's outputs; the embeddings scaled
by sqrt(hidden); a tanh-GELU gate; q.k scaled by query_pre_attn_scalar ** -0.5; attention and
final logits softcapped; a sliding window on alternate layers (`layer_types`)."""

from nanovllm.models.decoder import DecoderDescription, DecoderForCausalLM, sliding_layers


class Gemma2ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def describe(config) -> DecoderDescription:
        bias = getattr(config, "attention_bias", False)
        return DecoderDescription(
            qkv_bias=bias, o_bias=bias, norm_weight_offset=1.0, sandwich_norms=True,
            activation=config.hidden_activation, embedding_scale=config.hidden_size ** 0.5,
            attention_scale=config.query_pre_attn_scalar ** -0.5,
            attn_logit_softcap=config.attn_logit_softcapping, final_logit_softcap=config.final_logit_softcapping,
            **sliding_layers(config))
