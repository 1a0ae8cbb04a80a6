"""What differs per device, behind one small interface the model runner asks, one platform a
device (cpu.py, cuda.py). While the model is constructed the platform is in force
(layers/build_context.py's `built_for`) and says which forward each elementwise op is built with
(`choose_forward`) and what runs the decoder layers (`layer_runner`: on CPU one fused kernel
call or compiled groups); the layers' LinearMethodChooser asks it for their linear methods
(`dense_linear_method`, and `block_linear_method` for the weight formats it multiplies in their
blocks). It also says the attention backend (`attention_backend`), the sampler's loops over the
vocabulary (`sampling_ops`), where a loaded model's weights lie (`prepare_model`), how much
memory the KV cache gets and where it lives, whether steps replay CUDA graphs (`graph_runner`),
and what to compile or warm up before the first request (`compile`). Modules decide from it only
while they are built; nothing asks it per step.
"""

import os
from collections.abc import Callable

import torch
from torch import nn

from nanovllm.distributed.parallel_state import TPGroup
from nanovllm.layers.custom_op import CustomOp
from nanovllm.layers.quantization import LinearMethod, UnquantizedLinearMethod
from nanovllm.layers.quantization.moe_methods import MoEMethod, UnquantizedMoEMethod
from nanovllm.layers.sampling_ops import SamplingOps


# Share of available RAM that a KV cache in host memory takes when neither kv_cache_memory_gb nor
# num_kvcache_blocks is given (capped, as on CUDA, at what max_num_seqs full-length sequences need).
KV_CACHE_RAM_SHARE = 0.2


def step_buffer_bytes(model: nn.Module, tokens: int) -> int:
    """The most bytes one layer of `model` holds in buffers of its own during a step of `tokens`
    tokens (layers run one after another, so the largest counts)."""
    return max((m.step_buffer_bytes(tokens) for m in model.modules() if hasattr(m, "step_buffer_bytes")), default=0)


class Platform:
    """The defaults: nothing to prepare, an ordinary cache tensor, eager steps."""

    def __init__(self, device: torch.device, dtype: torch.dtype, enforce_eager: bool, tp_group: TPGroup):
        self.device, self.dtype, self.enforce_eager, self.tp_group = device, dtype, enforce_eager, tp_group

    @staticmethod
    def default_dtype() -> str:
        """What dtype="auto" means here."""
        return "float32"

    def choose_forward(self, op: CustomOp) -> Callable:
        """The forward an elementwise op built for this platform runs (its native one here)."""
        return op.forward_native

    def layer_runner(self, layers: list[nn.Module]) -> Callable | None:
        """What runs a decoder stack built of `layers` (layers/decoder_layers.py), asked as the
        stack is built: a callable (positions, hidden, residual) -> (hidden, residual), or None
        to call the layers in turn (here)."""
        return None

    def sampling_ops(self) -> SamplingOps:
        """The sampler's loops over [rows, vocab] logits (portable here)."""
        return SamplingOps()

    def attention_backend(self, head_dim: int, block_size: int) -> str:
        """The attention backend's name (attention/selector.py's BACKENDS) for these shapes, in
        this platform's dtype."""
        return "torch_native"

    def kv_cache_budget_bytes(self, model: nn.Module, attn_layers: list, backend, config) -> int:
        """Bytes the KV cache may take when the user gave no size: here a share of the RAM free now,
        once the largest buffers a layer holds during a full step are set aside (a mixture of experts'
        routing buffers: `step_buffer_bytes`)."""
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return int(max(0, free - step_buffer_bytes(model, config.max_num_batched_tokens)) * KV_CACHE_RAM_SHARE)

    def graph_runner(self, model: nn.Module, backend, config):
        """What replays captured decode steps (platforms/cuda_graph.py), or None: steps run eagerly."""
        return None

    def prepare_model(self, model: nn.Module) -> None:
        """Called once the weights are loaded and processed: where they lie in memory."""

    def dense_linear_method(self, batch_invariant: bool = False) -> LinearMethod:
        """The linear method of a layer that multiplies a dense weight (the plain one here);
        `batch_invariant` asks for one whose rows do not depend on the step's other rows, where the
        platform promises that (the CPU's quantized path)."""
        return UnquantizedLinearMethod()

    def block_linear_method(self, shard_types: dict[object, str], projection: str = "") -> LinearMethod | None:
        """The linear method that multiplies a layer's weight kept in GGML block types, or None where
        this platform does not (the weight is then dequantized at load). `shard_types`: each
        projection's type by shard id (a packed layer's q/k/v or gate/up), {None: type} unpacked;
        `projection`: the layer's name in its block (vLLM's: qkv_proj, o_proj, gate_up_proj,
        down_proj), by which a platform may choose its activations' precision."""
        return None

    def dense_moe_method(self) -> MoEMethod:
        """The MoE method of a mixture of experts whose experts' weights are dense (the plain one here)."""
        return UnquantizedMoEMethod()

    def block_moe_method(self, gate_up_type: str, down_type: str) -> MoEMethod | None:
        """The MoE method that runs experts kept in GGML block types (gate and up in one, down in
        another), or None where this platform does not (they are then dequantized at load)."""
        return None

    def empty_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised cache tensor (for a backend that never reads an unwritten slot)."""
        return torch.empty(shape, dtype=dtype, device=device)

    def compile(self, model: nn.Module, warmup: Callable[[], None]) -> float:
        """Compile what this platform compiles; `warmup` runs a one-token step through the model.
        Returns the seconds it took."""
        return 0.0


def platform_class(device_type: str) -> type[Platform]:
    """The platform of a device type ("cpu", "cuda"; any other gets the defaults)."""
    if device_type == "cpu":
        from nanovllm.platforms.cpu import CPUPlatform
        return CPUPlatform
    if device_type == "cuda":
        from nanovllm.platforms.cuda import CUDAPlatform
        return CUDAPlatform
    return Platform


def get_platform(device: torch.device, dtype: torch.dtype, enforce_eager: bool, tp_group: TPGroup) -> Platform:
    return platform_class(device.type)(device, dtype, enforce_eager, tp_group)
