"""Chooses the attention backend for the engine's device.

CPU: the compiled CPU kernels (built on first use), or the portable PyTorch backend where
they cannot be built or the head or block size is odd. CUDA: flash-attn when it is installed and supports the
dtype, head size and KV block size (its paged cache needs blocks of a multiple of 256
tokens, so the default block size of 16 runs Triton); otherwise the Triton kernels.
NANOVLLM_ATTENTION_BACKEND=cpu|torch_native|triton|flash_attn overrides the choice (as vLLM's
VLLM_ATTENTION_BACKEND does); Triton on CPU tensors needs TRITON_INTERPRET=1, for tests.
"""

import os

import torch

from nanovllm.attention.base import AttentionBackend

BACKEND_ENV = "NANOVLLM_ATTENTION_BACKEND"
BACKENDS = ("cpu", "torch_native", "triton", "flash_attn")


def select_backend(device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int) -> str:
    forced = os.environ.get(BACKEND_ENV)
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV}={forced!r}; expected one of {', '.join(BACKENDS)}")
        return forced
    if device.type == "cpu":
        from nanovllm.attention.cpu import cpu_backend_supports
        return "cpu" if cpu_backend_supports(head_dim, block_size) else "torch_native"
    if device.type != "cuda":
        return "torch_native"
    try:
        from nanovllm.attention.flash_attn import flash_attn_supports
    except ImportError:  # flash-attn is not installed
        return "triton"
    return "flash_attn" if flash_attn_supports(dtype, head_dim, block_size) else "triton"


def make_attention_backend(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                           head_dim: int, block_size: int) -> AttentionBackend:
    name = select_backend(device, dtype, head_dim, block_size)
    if name == "flash_attn":
        from nanovllm.attention.flash_attn import FlashAttnBackend as backend_cls
    elif name == "triton":
        from nanovllm.attention.triton import TritonBackend as backend_cls
    elif name == "cpu":
        from nanovllm.attention.cpu import CPUBackend as backend_cls
    else:
        from nanovllm.attention.torch_native import TorchNativeBackend as backend_cls
    return backend_cls(num_heads, num_kv_heads, head_dim, block_size)
