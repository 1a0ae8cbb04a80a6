"""A weight that stays in a GGUF block format: what a checkpoint yields for a tensor the engine
multiplies without dequantizing it, and how dense weights are quantized into one at load.

Rows stay whole: a row of blocks is a row of the weight, so row slices (column-parallel shards,
llama's q/k row order) cut the blocks exactly as they cut a dense weight, and column slices
(row-parallel shards) cut whole blocks when the shard's width is a multiple of the block.
"""

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

# The formats kept in blocks, by GGML name, and their type ids (the kernels' `type`).
BLOCK_TYPES = {name: int(GGMLQuantizationType[name]) for name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K",
                                                                          "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")}


def block_values(qtype: str) -> int:
    return GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][0]


def row_bytes(qtype: str, in_features: int) -> int:
    values, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    return in_features // values * nbytes


def row_values(qtype: str, row_bytes: int) -> int:
    """The in_features a row of `row_bytes` bytes of blocks holds."""
    values, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    return row_bytes // nbytes * values


@dataclass
class QuantizedTensor:
    """A [rows, in_features] weight as uint8 blocks [rows, row_bytes(qtype, in_features)]."""

    blocks: torch.Tensor
    qtype: str
    in_features: int

    @classmethod
    def quantize(cls, weight: torch.Tensor, qtype: str) -> "QuantizedTensor":
        """A dense [rows, in_features] weight quantized (gguf-py's reference quantizer)."""
        array = weight.detach().to(torch.float32).numpy()
        blocks = quantize(np.ascontiguousarray(array), GGMLQuantizationType[qtype])
        return cls(torch.from_numpy(np.ascontiguousarray(blocks)), qtype, weight.shape[1])
