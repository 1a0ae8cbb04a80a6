"""The CUDA platform: a decoder layer's elementwise ops (RMSNorm with its residual add, the gated
SiLU, rotary embedding) built on single Triton kernels (their `forward_cuda`, which calls
kernels/triton_elementwise.py) where Triton is installed; a mixture of experts' experts on the
grouped Triton kernels (kernels/triton_moe.py); flash-attn where it takes the shapes, else the
Triton attention kernels; the KV cache sized by a measured warm-up step (gpu_memory.py); decode
steps replayed from CUDA graphs (cuda_graph.py) unless enforce_eager, or unless a layer's launches
depend on its routing (experts without Triton)."""

import importlib.util
import logging
from collections.abc import Callable

import torch
from torch import nn

from nanovllm.distributed.parallel_state import TPGroup
from nanovllm.layers.custom_op import CustomOp
from nanovllm.layers.quantization.moe_methods import MoEMethod, UnquantizedMoEMethod
from nanovllm.platforms import Platform

logger = logging.getLogger(__name__)


class CUDAPlatform(Platform):
    def __init__(self, device: torch.device, dtype: torch.dtype, enforce_eager: bool, tp_group: TPGroup):
        super().__init__(device, dtype, enforce_eager, tp_group)
        self.has_triton = importlib.util.find_spec("triton") is not None

    @staticmethod
    def default_dtype() -> str:
        return "bfloat16"

    def choose_forward(self, op: CustomOp) -> Callable:
        return op.forward_cuda if self.has_triton else op.forward_native

    def attention_backend(self, head_dim: int, block_size: int) -> str:
        # flash-attn's paged cache needs blocks of a multiple of 256 tokens: the default 16 runs Triton.
        try:
            from nanovllm.attention.flash_attn import flash_attn_supports
        except ImportError:  # flash-attn is not installed
            flash_attn_supports = None
        if flash_attn_supports is not None and flash_attn_supports(self.dtype, head_dim, block_size):
            return "flash_attn"
        return "triton" if self.has_triton else "torch_native"

    def dense_moe_method(self) -> MoEMethod:
        if not self.has_triton:
            return UnquantizedMoEMethod()
        from nanovllm.layers.quantization.triton_moe import TritonMoEMethod
        return TritonMoEMethod()

    def kv_cache_budget_bytes(self, model: nn.Module, attn_layers: list, backend, config) -> int:
        from nanovllm.platforms.gpu_memory import profile_kv_cache_bytes
        return profile_kv_cache_bytes(model, attn_layers, backend, config, self.device)

    def graph_runner(self, model: nn.Module, backend, config):
        if self.enforce_eager or not backend.supports_cuda_graphs:
            return None
        if any(not m.moe_method.graph_capturable for m in model.modules() if hasattr(m, "moe_method")):
            logger.info("decode steps run eager: the experts' launches depend on their routing (install triton)")
            return None
        from nanovllm.platforms.cuda_graph import CUDAGraphRunner
        graphs = CUDAGraphRunner(model, backend, config.max_num_seqs, config.max_model_len, config.kvcache_block_size,
                                 self.device)
        total = torch.cuda.mem_get_info(self.device)[1]
        graphs.capture(headroom_bytes=int(total * (1 - config.gpu_memory_utilization)))
        return graphs
