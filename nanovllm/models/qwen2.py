"""Qwen2: the Llama architecture with bias on q/k/v (none on the output projection)."""

from nanovllm.models.llama import LlamaForCausalLM, LlamaVariant


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def variant(config) -> LlamaVariant:
        return LlamaVariant(qkv_bias=True, o_bias=False, qk_norm=False)
