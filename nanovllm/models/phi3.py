"""Phi-3 and Phi-4-mini: the Llama decoder whose checkpoints store q/k/v and gate/up packed already
(`qkv_proj`, `gate_up_proj`: nothing to map), with LongRoPE and, for Phi-4-mini, a partial rotary
embedding (both in layers/rotary_embedding.py) and, for some Phi-3 models, a sliding window."""

from nanovllm.models.decoder import DecoderDescription, DecoderForCausalLM, sliding_layers


class Phi3ForCausalLM(DecoderForCausalLM):
    packed_modules_mapping = {}

    @staticmethod
    def describe(config) -> DecoderDescription:
        return DecoderDescription(activation=config.hidden_act, **sliding_layers(config))
