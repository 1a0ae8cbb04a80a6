"""Qwen2-MoE: Qwen2's decoder (q/k/v biases) whose MLPs are mixtures of experts beside a shared
expert that every token takes, scaled by sigmoid of its own gate."""

from nanovllm.models.decoder import DecoderDescription, DecoderForCausalLM, MoEDescription, sliding_layers
from nanovllm.models.moe_config import check_router, sparse_layers


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    expert_params_mapping = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    @staticmethod
    def describe(config) -> DecoderDescription:
        check_router(config)
        moe = MoEDescription(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                             intermediate_size=config.moe_intermediate_size, renormalize=config.norm_topk_prob,
                             sparse_layers=sparse_layers(config),
                             shared_expert_intermediate_size=config.shared_expert_intermediate_size)
        # Its configs carry sliding_window even where use_sliding_window leaves every layer full.
        windows = sliding_layers(config) if getattr(config, "use_sliding_window", False) else {}
        return DecoderDescription(qkv_bias=getattr(config, "qkv_bias", True), activation=config.hidden_act, moe=moe,
                                  **windows)
