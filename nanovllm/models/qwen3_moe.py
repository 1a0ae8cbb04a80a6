"""Qwen3-MoE: Qwen3's decoder (q/k norms) whose MLPs are mixtures of experts, softmax top-k routed
(renormalised where `norm_topk_prob`), on the layers `decoder_sparse_step` and `mlp_only_layers`
leave sparse."""

from nanovllm.models.decoder import DecoderDescription, DecoderForCausalLM, MoEDescription, sliding_layers
from nanovllm.models.moe_config import check_router, sparse_layers


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    expert_params_mapping = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    @staticmethod
    def describe(config) -> DecoderDescription:
        check_router(config)
        bias = getattr(config, "attention_bias", False)
        moe = MoEDescription(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                             intermediate_size=config.moe_intermediate_size, renormalize=config.norm_topk_prob,
                             sparse_layers=sparse_layers(config))
        return DecoderDescription(qkv_bias=bias, o_bias=bias, qk_norm=True, activation=config.hidden_act, moe=moe,
                                  **sliding_layers(config))
