"""What the mixture-of-experts families read alike from an HF config: which layers are sparse, and
whether the router is one the engine runs (softmax over every expert, then top-k)."""

# Config fields of routers the engine does not run, and what they mean.
_OTHER_ROUTERS = {
    "n_group": "grouped top-k routing (DeepSeek's: experts chosen within the best groups)",
    "topk_group": "grouped top-k routing (DeepSeek's: experts chosen within the best groups)",
    "scoring_func": "a router scoring function other than softmax",
    "routed_scaling_factor": "a scaled router (DeepSeek's routed_scaling_factor)",
}


def check_router(config) -> None:
    """Refuse a config whose router is not softmax top-k, naming what it asks for."""
    for field, meaning in _OTHER_ROUTERS.items():
        value = getattr(config, field, None)
        if value is None or (field == "scoring_func" and value == "softmax") or (field != "scoring_func" and value == 1):
            continue
        raise ValueError(f"{field}={value!r}: {meaning} is not supported; the mixture-of-experts router here is "
                         "softmax top-k (Qwen3-MoE, Qwen2-MoE, Mixtral)")


def sparse_layers(config) -> tuple[bool, ...]:
    """Qwen-MoE's rule: layer i is sparse unless listed in mlp_only_layers, every
    decoder_sparse_step-th layer counting from 1."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    return tuple(config.num_experts > 0 and i not in dense and (i + 1) % step == 0
                 for i in range(config.num_hidden_layers))
