"""Qwen2: the Llama decoder with bias on q/k/v (none on the output projection)."""

from nanovllm.models.decoder import DecoderDescription, DecoderForCausalLM, sliding_layers


class Qwen2ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def describe(config) -> DecoderDescription:
        return DecoderDescription(qkv_bias=True, activation=config.hidden_act, **sliding_layers(config))
