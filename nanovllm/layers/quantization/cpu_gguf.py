"""The CPU GGUF method: a linear weight kept in its GGUF block format (Q8_0, Q4_0, Q4_1, Q4_K,
Q6_K) and multiplied by the block kernels (kernels/cpu/quantized.cpp): few rows as integer dot
products over activations quantized to 16-bit blocks, more rows by an fp32 GEMM over weight rows
dequantized a few at a time into cache.

The weight parameter holds the file's rows of blocks ([rows, row bytes], uint8); the layer's own
weight loader cuts its shard out of them as out of a dense weight (see loader/quantized.py). Once
loaded, Q8_0, Q4_0, Q4_1, Q4_K and Q6_K rows are repacked into the kernels' lanes layouts (a group of
eight 32-value chunks' sums in one vector's lanes; the same bytes a row, or for Q4_K 148 bytes a
256-value block instead of 144): from then on the kernels take the layout's own type id. An
embedding looks up rows of blocks and dequantizes only those.
"""

import torch
from torch import nn

from nanovllm.layers.quantization.base import LinearMethod
from nanovllm.loader.quantized import BLOCK_TYPES, QuantizedTensor, row_bytes

# Rows up to which the integer kernel runs; above, the dequantizing GEMM (benchmarks/RESULTS.md).
MAX_INTEGER_ROWS = 10
# The formats repacked into a lanes layout at load, and its type ids: 1000 + the GGML type's
# (kernels/cpu/quantized.cpp's Lanes, Q4_KLanes and Q6_KLanes).
LANES_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
LANES_TYPE_BASE = 1000


class CPUGGUFLinearMethod(LinearMethod):
    def __init__(self, qtype: str, dtype: torch.dtype):
        self.qtype = qtype
        self.type_id = BLOCK_TYPES[qtype]
        self.kernel_type = self.type_id  # the layout the blocks are in: the file's until repacked
        self.dtype = dtype  # of activations, and of the rows an embedding looks up

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool) -> None:
        """The blocks parameter (a bias, when there is one, stays the layer's dense parameter)."""
        self.in_features = input_size  # a repacked row's bytes may not say it
        blocks = torch.empty(output_size, row_bytes(self.qtype, input_size), dtype=torch.uint8)
        layer.weight = nn.Parameter(blocks, requires_grad=False)
        layer.weight.weight_loader = self._loader(layer)

    def install(self, layer: nn.Module) -> None:
        """Replace a layer's dense weight (not yet loaded) by blocks of the same rows and columns."""
        output_size, input_size = layer.weight.shape
        self.create_weights(layer, input_size, output_size, bias=False)
        layer.linear_method = self

    def _loader(self, layer: nn.Module):
        def load(param: nn.Parameter, loaded: QuantizedTensor, shard_id: object = None) -> None:
            if not isinstance(loaded, QuantizedTensor) or loaded.qtype != self.qtype:
                got = loaded.qtype if isinstance(loaded, QuantizedTensor) else f"a dense {loaded.dtype} tensor"
                raise ValueError(f"expected {self.qtype} blocks, got {got}")
            layer.weight_loader(param, loaded.blocks, shard_id)
        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        # A tied embedding and LM head share this method and their weight: repacked once.
        if self.qtype not in LANES_FORMATS or self.kernel_type != self.type_id:
            return
        layer.weight.data = torch.ops.nanovllm_cpu.gguf_repack(layer.weight, self.type_id, self.in_features)
        self.kernel_type = LANES_TYPE_BASE + self.type_id

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.nanovllm_cpu.gguf_linear(x, layer.weight, self.kernel_type, bias, MAX_INTEGER_ROWS)

    def fused_kernel_args(self, layer: nn.Module) -> tuple[int, list, int]:
        """The linear as one fused layer's kernel takes it (kernels/cpu/decoder_layer.cpp): its
        kind (the blocks' type id), weight tensors (blocks; no packed or oneDNN copy) and the rows
        up to which the integer path runs."""
        return self.kernel_type, [layer.weight, None, None], MAX_INTEGER_ROWS

    def logits(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        # x in fp32 makes the kernel return its fp32 sums (the quantized x is the same).
        return torch.ops.nanovllm_cpu.gguf_linear(hidden.float(), layer.weight, self.kernel_type, None,
                                                  MAX_INTEGER_ROWS)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        rows = layer.weight.index_select(0, ids.reshape(-1))
        values = torch.ops.nanovllm_cpu.gguf_dequantize(rows, self.kernel_type, self.in_features)
        return values.to(self.dtype).view(*ids.shape, -1)
