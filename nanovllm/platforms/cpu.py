"""The CPU platform: the compiled kernels where the machine runs them, torch.compile of the
decoder layers, and memory settings for steps and the KV cache.

In bf16 on a machine that runs the SIMD kernels (nanovllm/kernels/cpu.py), every dense linear
layer and the LM head are built with the packed CPU method, and RMSNorm and the gated SiLU are built on the
elementwise kernels (their `forward_cpu`, rounding where the eager layers do); decoder layers of the
Llama family then run as one kernel call a step (cpu_fused_layers) instead of compiled. Elsewhere
the plain PyTorch layers run, compiled. The sampler's loops over the vocabulary run on the kernels
wherever they run, in every dtype (KernelSamplingOps).
"""

import ctypes
import gc
import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from nanovllm.distributed.parallel_state import TPGroup
from nanovllm.kernels import cpu as cpu_kernels
from nanovllm.layers.custom_op import CustomOp
from nanovllm.layers.quantization import LinearMethod, UnquantizedLinearMethod
from nanovllm.layers.quantization.cpu_packed_bf16 import CPUPackedBF16LinearMethod
from nanovllm.layers.quantization.moe_methods import MoEMethod
from nanovllm.layers.sampling_ops import SamplingOps
from nanovllm.platforms import Platform
from nanovllm.platforms.cpu_fused_layers import FusedDecoderLayers, unfusable_reason

logger = logging.getLogger(__name__)


class KernelSamplingOps(SamplingOps):
    """The sampler's loops on the CPU kernels: the same draws without [rows, vocab] temporaries
    (faster: benchmarks/RESULTS.md), the grammar's bits read in place."""

    def draw_unfiltered(self, logits: torch.Tensor, temperatures: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        return torch.ops.nanovllm_cpu.sample_rows(logits, temperatures, uniform)

    def mask_disallowed(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        torch.ops.nanovllm_cpu.mask_disallowed(logits, bitmask)


def keep_freed_memory_mapped() -> None:
    """Stop glibc's malloc from handing freed memory back to the kernel between steps.

    By default every allocation over 128 KB to 32 MB (it adapts) is its own mmap, and the heap's
    free top is trimmed, so each prefill step's activations (MBs each) come back as fresh pages
    that fault in and are zeroed, tens of thousands of faults a large step. A fixed 32 MB mmap
    threshold (glibc's most) and no trimming keep those pages in the heap for the next step; the
    process then holds its peak activations, which max_num_batched_tokens bounds. No-op off glibc.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # glibc only: mallopt's option numbers below are glibc's
    except (OSError, AttributeError):
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    mallopt(M_MMAP_THRESHOLD, 32 << 20)
    mallopt(M_TRIM_THRESHOLD, 1 << 30)


class CPUPlatform(Platform):
    def __init__(self, device: torch.device, dtype: torch.dtype, enforce_eager: bool, tp_group: TPGroup):
        super().__init__(device, dtype, enforce_eager, tp_group)
        keep_freed_memory_mapped()
        # enforce_eager is the exact reference; tensor parallelism runs eager (collectives
        # inside the graph are not worth a compile on CPU).
        self.compiled = not enforce_eager and tp_group.world_size == 1
        self._packed_bf16: CPUPackedBF16LinearMethod | None = None
        self._packed_bf16_every_step: CPUPackedBF16LinearMethod | None = None
        # What layer_runner chose, for the start-up's log line.
        self.layer_path = ("the decoder layers run in turn (enforce_eager)" if enforce_eager else
                           "the decoder layers run in turn (tensor-parallel ranks run eager)")

    @staticmethod
    def default_dtype() -> str:
        # bf16 weights, which decode reads at half fp32's bytes, run faster than fp32 end to end
        # where the kernels run (AVX512-BF16 or AVX2); elsewhere plain PyTorch's fp32 is the faster
        # (benchmarks/RESULTS.md). Deciding builds (or loads) the kernels.
        return "bfloat16" if cpu_kernels.has_simd_kernels() else "float32"

    def _on_kernels(self) -> bool:
        """Whether the model runs on the packed and elementwise kernels."""
        return self.dtype == torch.bfloat16 and cpu_kernels.has_simd_kernels()

    def choose_forward(self, op: CustomOp) -> Callable:
        return op.forward_cpu if self._on_kernels() else op.forward_native

    def attention_backend(self, head_dim: int, block_size: int) -> str:
        from nanovllm.attention.cpu import cpu_backend_supports  # builds the kernels
        return "cpu" if cpu_backend_supports(head_dim, block_size) else "torch_native"

    def sampling_ops(self) -> SamplingOps:
        # Every dtype: the sampler works on fp32 logits.
        return KernelSamplingOps() if cpu_kernels.has_simd_kernels() else SamplingOps()

    def prepare_model(self, model: nn.Module) -> None:
        streamed = [m.weight for m in model.modules()
                    if getattr(getattr(m, "linear_method", None), "streams_weight", False)]
        streamed += [w for m in model.modules() if getattr(getattr(m, "moe_method", None), "streams_weight", False)
                     for w in (m.w13_weight, m.w2_weight)]
        cpu_kernels.move_to_huge_pages(streamed)

    def dense_linear_method(self, batch_invariant: bool = False) -> LinearMethod:
        if not self._on_kernels():
            return UnquantizedLinearMethod()
        # One for the whole model: its layers' packed copies share one arena. The packed kernel
        # computes an output element alike for any number of rows, oneDNN's GEMM does not: a layer
        # that must be batch-invariant (a router: a small weight) runs the packed kernel at every step.
        if batch_invariant:
            if self._packed_bf16_every_step is None:
                self._packed_bf16_every_step = CPUPackedBF16LinearMethod(every_step_packed=True)
            return self._packed_bf16_every_step
        if self._packed_bf16 is None:
            self._packed_bf16 = CPUPackedBF16LinearMethod()
        return self._packed_bf16

    def block_linear_method(self, shard_types: dict[object, str], projection: str = "") -> LinearMethod | None:
        # Imported here: the block formats' tables come from gguf-py, which only block weights need.
        from nanovllm.layers.quantization.cpu_gguf import CPUGGUFLinearMethod, CPUGGUFPartsLinearMethod
        # Every kernel variant runs the block formats (`none` in plain C++: correct if slow).
        if not cpu_kernels.available():
            return None
        qtypes = set(shard_types.values())
        if len(qtypes) == 1:
            return CPUGGUFLinearMethod(qtypes.pop(), self.dtype, projection)
        return CPUGGUFPartsLinearMethod(shard_types, self.dtype, projection)

    def dense_moe_method(self) -> MoEMethod:
        if not self._on_kernels():
            return super().dense_moe_method()
        from nanovllm.layers.quantization.cpu_packed_bf16_moe import CPUPackedBF16MoEMethod
        return CPUPackedBF16MoEMethod()

    def block_moe_method(self, gate_up_type: str, down_type: str) -> MoEMethod | None:
        from nanovllm.layers.quantization.cpu_gguf_moe import CPUGGUFMoEMethod
        return CPUGGUFMoEMethod(gate_up_type, down_type) if cpu_kernels.available() else None

    def empty_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # Costs nothing until a page is first written; in ordinary pages, as a step writes a
        # few KB of every layer's and head's region: 2 MB pages zeroed 2 MB for each at the
        # first token and decoded no faster (figures in benchmarks/RESULTS.md).
        return cpu_kernels.empty_mapped(shape, dtype, huge_pages=False)

    def layer_runner(self, layers: list[nn.Module]) -> Callable | None:
        """The decoder layers fused where every part runs on the kernels (see cpu_fused_layers),
        else compiled in groups (see cpu_compile); eager (None) under enforce_eager or tensor
        parallelism."""
        if not self.compiled:
            return None
        # Which path runs and why, in the start-up's log line: never a silent fallback.
        reason = unfusable_reason(layers) if self._on_kernels() else "the model is not on the bf16 kernels"
        if reason is None:
            self.layer_path = "fused the decoder layers (one kernel call a step)"
            return FusedDecoderLayers(layers)
        # Imported here: it imports Inductor and Dynamo, about a second a start that fused
        # layers do without.
        from nanovllm.platforms.cpu_compile import CompiledDecoderLayers

        self.layer_path = f"compiled (or loaded) the decoder layers (not fused: {reason})"
        return CompiledDecoderLayers(layers)

    def compile(self, model: nn.Module, warmup: Callable[[], None]) -> float:
        """Compile (or load) the layers' graphs now rather than in the first request: `warmup`
        runs a step's kind of inputs through them, and steps then call the compiled code
        directly."""
        if not self.compiled:
            logger.info("%s on CPU", self.layer_path)
            return 0.0
        start = time.perf_counter()
        # Earlier engines' garbage is collected now rather than mid-trace, where a finalizer that
        # changes global state (a tensor-parallel executor's restores the thread count) makes
        # Dynamo abort the trace; fused layers trace nothing.
        gc.collect()
        warmup()
        seconds = time.perf_counter() - start
        logger.info("%s for CPU in %.1f s", self.layer_path, seconds)
        return seconds
