"""Llama, and Mistral (its sliding window included): the plain decoder (models/decoder.py)."""

from nanovllm.models.decoder import DecoderDescription, DecoderForCausalLM, sliding_layers


class LlamaForCausalLM(DecoderForCausalLM):
    @staticmethod
    def describe(config) -> DecoderDescription:
        bias = getattr(config, "attention_bias", False)
        return DecoderDescription(qkv_bias=bias, o_bias=bias, mlp_bias=getattr(config, "mlp_bias", False),
                                  activation=config.hidden_act, **sliding_layers(config))
