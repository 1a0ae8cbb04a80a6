"""Mixtral: Mistral's decoder whose every MLP is a mixture of experts (`block_sparse_moe`, experts
w1 = gate, w3 = up, w2 = down), softmax top-k routed and renormalised."""

from nanovllm.models.decoder import DecoderDescription, DecoderForCausalLM, MoEDescription, sliding_layers
from nanovllm.models.moe_config import check_router


class MixtralForCausalLM(DecoderForCausalLM):
    expert_params_mapping = {"w1": "gate", "w3": "up", "w2": "down"}

    @staticmethod
    def describe(config) -> DecoderDescription:
        check_router(config)
        moe = MoEDescription(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                             intermediate_size=config.intermediate_size, renormalize=True,
                             sparse_layers=(True,) * config.num_hidden_layers, module_name="block_sparse_moe")
        return DecoderDescription(activation=config.hidden_act, moe=moe, **sliding_layers(config))
