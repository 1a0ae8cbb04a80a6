"""The attention backends by name, and the user's override of the platform's choice.

Which backend runs is the platform's decision (Platform.attention_backend: on CPU the compiled
kernels, or the portable PyTorch backend where they cannot be built or the head or block size is
odd; on CUDA flash-attn where it takes the dtype, head size and block size, else Triton).
NANOVLLM_ATTENTION_BACKEND=cpu|torch_native|triton|flash_attn overrides it (as vLLM's
VLLM_ATTENTION_BACKEND does); Triton on CPU tensors needs TRITON_INTERPRET=1, for tests.
"""

import importlib
import os

from nanovllm.attention.base import AttentionBackend

BACKEND_ENV = "NANOVLLM_ATTENTION_BACKEND"
# Each backend's module and class, imported only when chosen (flash_attn and triton need their packages).
BACKENDS = {"cpu": ("nanovllm.attention.cpu", "CPUBackend"),
            "torch_native": ("nanovllm.attention.torch_native", "TorchNativeBackend"),
            "triton": ("nanovllm.attention.triton", "TritonBackend"),
            "flash_attn": ("nanovllm.attention.flash_attn", "FlashAttnBackend")}


def forced_backend() -> str | None:
    """The backend NANOVLLM_ATTENTION_BACKEND names, or None where it is unset."""
    forced = os.environ.get(BACKEND_ENV)
    if forced and forced not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={forced!r}; expected one of {', '.join(BACKENDS)}")
    return forced or None


def make_attention_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int,
                           block_size: int) -> AttentionBackend:
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(module), cls)(num_heads, num_kv_heads, head_dim, block_size)
