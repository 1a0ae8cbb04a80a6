"""Which model class serves which HF architecture name. A new family adds its line here (or a
plugin calls `register_model`)."""

from torch import nn

from nanovllm.models.gemma2 import Gemma2ForCausalLM
from nanovllm.models.gemma3 import Gemma3ForCausalLM
from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.models.mixtral import MixtralForCausalLM
from nanovllm.models.phi3 import Phi3ForCausalLM
from nanovllm.models.qwen2 import Qwen2ForCausalLM
from nanovllm.models.qwen2_moe import Qwen2MoeForCausalLM
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,  # the same decoder, its sliding window included
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}
# Architectures people ask for whose mixture-of-experts router the engine does not run.
_UNSUPPORTED_ROUTERS = {
    "DeepseekV2ForCausalLM": "grouped top-k routing",
    "DeepseekV3ForCausalLM": "grouped top-k routing with sigmoid scores and a bias",
}



def supported_architectures() -> tuple[str, ...]:
    return tuple(_MODELS)


def register_model(architecture: str, model_class: type[nn.Module]) -> None:
    """Serve HF architecture name `architecture` with `model_class` (models/decoder.py's
    DecoderForCausalLM subclass, for a dense decoder)."""
    _MODELS[architecture] = model_class


def _causal_lm_of(arch: str) -> str:
    """The CausalLM architecture whose decoder a base model (transformers' AutoModel: `Qwen3Model`,
    `LlamaModel`, Gemma 3's `Gemma3TextModel`) is; other names stay as they are."""
    if arch.endswith("Model"):
        return arch.removesuffix("TextModel").removesuffix("Model") + "ForCausalLM"
    return arch


def is_base_model(hf_config) -> bool:
    """Whether the checkpoint is a supported family's decoder saved without its LM head: it can
    only pool (runner="pooling")."""
    architectures = getattr(hf_config, "architectures", None) or []
    return any(arch.endswith("Model") and _causal_lm_of(arch) in _MODELS for arch in architectures)


def get_model_class(hf_config) -> type[nn.Module]:
    """The family's class; a base model's is its CausalLM's (built without an LM head to pool)."""
    architectures = getattr(hf_config, "architectures", None) or []
    for arch in map(_causal_lm_of, architectures):
        if arch in _MODELS:
            return _MODELS[arch]
        if arch in _UNSUPPORTED_ROUTERS:
            raise ValueError(f"{arch}: its mixture-of-experts router ({_UNSUPPORTED_ROUTERS[arch]}) is not supported; "
                             f"the router here is softmax top-k; supported: {', '.join(supported_architectures())}")
    raise ValueError(f"unsupported architecture {architectures}; supported: {', '.join(supported_architectures())}")
