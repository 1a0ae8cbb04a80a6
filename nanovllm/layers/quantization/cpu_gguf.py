"""The CPU GGUF method: a linear weight kept in its GGUF block format (Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS) and multiplied by the block kernels (kernels/cpu/quantized.cpp) in integer dot
products over activations quantized to blocks of 32 values (8 or 16 bits, by the layer's types
and, for Q4_0, which projection of its block it is: activation_bits): few rows streaming each weight row from its blocks, more rows in tiles over
weight rows decoded a block at a time into cache, every output element the same bits either way
(batch invariance).

The weight parameter holds the file's rows of blocks ([rows, row bytes], uint8); the layer's own
weight loader cuts its shard out of them as out of a dense weight (see loader/quantized.py). Once
loaded, every format's rows are repacked into the kernels' lanes layouts (a group of
eight 32-value chunks' sums in one vector's lanes; the same bytes a row, or for Q4_K, Q5_K and IQ4_XS
148, 180 and 138 bytes a 256-value block instead of 144, 176 and 136): from then on the kernels take the layout's own type id. An
embedding looks up rows of blocks and dequantizes only those.

A packed layer (q/k/v, gate/up) whose projections the file stores in different types (Q4_K_M
keeps some layers' v in Q6_K beside Q4_K's q and k) takes the parts method: each projection's rows
stay in their own type, all in one byte tensor, multiplied in one call (gguf_linear_parts).
"""

import torch
from torch import nn

from nanovllm.layers.quantization.base import LinearMethod, create_bias
from nanovllm.loader.quantized import BLOCK_TYPES, QuantizedTensor, row_bytes

# Rows of x up to which each weight row streams from its blocks once a call; above, blocks of rows
# are decoded into cache and tiled (benchmarks/RESULTS.md). Both give every output element the
# same bits, so this is a matter of speed only.
MAX_STREAMING_ROWS = 10
# Every kept format is repacked into its lanes layout at load, whose type id is 1000 + the GGML
# type's (kernels/cpu/quantized.cpp's Lanes, Q4_KLanes, Q5_KLanes, Q6_KLanes and IQ4_XSLanes).
LANES_TYPE_BASE = 1000
# decoder_layer.cpp's kind for a linear in parts of differing types.
PARTS_KIND = -2
# The types whose layers quantize x to 8 bits: those llama.cpp multiplies with x in 256-value Q8_K
# blocks, coarser than these 32-value ones, so 8 bits stay within llama.cpp's own quality on the
# same file while the kernels' byte tiles take twice the products an instruction. The rest keep 16
# bits: llama.cpp's x for them (Q8_0/Q8_1) has these very blocks, and our bf16 hidden states would
# put 8 bits past its KL (benchmarks/RESULTS.md).
EIGHT_BIT_ACTIVATION_TYPES = frozenset({"Q4_K", "Q5_K", "Q6_K", "IQ4_XS"})
# Q4_0, whose prompts the 16-bit tiles leave short of their floor against llama.cpp, takes 8-bit x
# (the byte tiles' twice the products) on the projections where it stays within llama.cpp's KL
# and top-1 agreement on the shipped text: the MLP's gate/up (the largest product of a layer) and
# attention's output; on q/k/v or the MLP's down as well it does not. Q4_1, Q5_0 and Q5_1 meet
# their floors in 16 bits and keep them: on the default model (Q4_1) 8 bits on gate/up put bf16
# past test_cpu_bf16's bound (benchmarks/RESULTS.md).
EIGHT_BIT_Q4_0_PROJECTIONS = frozenset({"gate_up_proj", "o_proj"})


def activation_bits(qtypes, projection: str = "") -> int:
    """The bits x is quantized to for a layer whose weight comes in `qtypes`; `projection`: the
    layer's name in its block (vLLM's: qkv_proj, o_proj, gate_up_proj, down_proj)."""
    eight_bit = EIGHT_BIT_ACTIVATION_TYPES | ({"Q4_0"} if projection in EIGHT_BIT_Q4_0_PROJECTIONS else set())
    return 8 if set(qtypes) <= eight_bit else 16


def kernel_blocks(blocks: torch.Tensor, qtype: str, in_features: int) -> tuple[torch.Tensor, int]:
    """Rows of `qtype` blocks (rows may be strided) as the kernels take them, repacked into the
    format's lanes layout, and that layout's type id."""
    return (torch.ops.nanovllm_cpu.gguf_repack(blocks, BLOCK_TYPES[qtype], in_features),
            LANES_TYPE_BASE + BLOCK_TYPES[qtype])


def blocks_of(loaded: QuantizedTensor, qtype: str, what: str = "") -> torch.Tensor:
    """The blocks a checkpoint handed a weight loader, which must be `qtype`'s (`what`: for which
    part, in the error)."""
    if not isinstance(loaded, QuantizedTensor) or loaded.qtype != qtype:
        got = loaded.qtype if isinstance(loaded, QuantizedTensor) else f"a dense {loaded.dtype} tensor"
        raise ValueError(f"expected {qtype} blocks{what}, got {got}")
    return loaded.blocks


class _BlocksMethod(LinearMethod):
    """What both block methods share. A layer's bias, when it has one, stays a dense parameter
    (create_bias)."""

    streams_weight = True  # a decode step reads every block


class CPUGGUFLinearMethod(_BlocksMethod):
    def __init__(self, qtype: str, dtype: torch.dtype, projection: str = ""):
        self.qtype = qtype
        self.kernel_type = BLOCK_TYPES[qtype]  # the layout the blocks are in: the file's until repacked
        self.dtype = dtype  # of activations, and of the rows an embedding looks up
        self.activation_bits = activation_bits([qtype], projection)

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool) -> None:
        self.in_features = input_size  # a repacked row's bytes may not say it
        blocks = torch.empty(output_size, row_bytes(self.qtype, input_size), dtype=torch.uint8)
        layer.weight = nn.Parameter(blocks, requires_grad=False)
        layer.weight.weight_loader = self._loader(layer)
        create_bias(layer, output_size, bias)

    def _loader(self, layer: nn.Module):
        def load(param: nn.Parameter, loaded: QuantizedTensor, shard_id: object = None) -> None:
            layer.weight_loader(param, blocks_of(loaded, self.qtype), shard_id)
        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.weight.data, self.kernel_type = kernel_blocks(layer.weight.data, self.qtype, self.in_features)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.nanovllm_cpu.gguf_linear(x, layer.weight, self.kernel_type, bias, MAX_STREAMING_ROWS,
                                                  self.activation_bits)

    def fused_kernel_args(self, layer: nn.Module) -> tuple[int, list, int, int]:
        """The linear as one fused layer's kernel takes it (kernels/cpu/decoder_layer.cpp): its
        kind (the blocks' type id), weight tensors (blocks; no packed or oneDNN copy), the rows
        up to which the streaming kernel runs and the activation bits."""
        return self.kernel_type, [layer.weight, None, None], MAX_STREAMING_ROWS, self.activation_bits

    def logits(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        # x in fp32 makes the kernel return its fp32 sums (the quantized x is the same).
        return torch.ops.nanovllm_cpu.gguf_linear(hidden.float(), layer.weight, self.kernel_type, None,
                                                  MAX_STREAMING_ROWS, self.activation_bits)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        rows = layer.weight.index_select(0, ids.reshape(-1))
        values = torch.ops.nanovllm_cpu.gguf_dequantize(rows, self.kernel_type, self.in_features)
        return values.to(self.dtype).view(*ids.shape, -1)


class CPUGGUFPartsLinearMethod(_BlocksMethod):
    """A packed layer whose projections come in different block types (`shard_types`: shard id ->
    GGML type), each kept in its own. While loading, the weight is [rows, widest row's bytes], each
    projection's rows filling their own type's bytes of it; once loaded, each run of rows of one
    type is put in the kernels' layout and the runs laid one after another in one byte tensor,
    which `parts` ((rows, type id) a run, in output order) describes."""

    def __init__(self, shard_types: dict[object, str], dtype: torch.dtype, projection: str = ""):
        self.shard_types = dict(shard_types)
        self.dtype = dtype
        self.activation_bits = activation_bits(self.shard_types.values(), projection)

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool) -> None:
        """The loading buffer of blocks, for a packed layer (one with `output_slice`)."""
        self.out_features, self.in_features = output_size, input_size
        slices = sorted((*layer.output_slice(shard), qtype) for shard, qtype in self.shard_types.items())
        self.runs: list[tuple[int, int, str]] = []  # (first row, rows, type): adjacent shards of one type merged
        for offset, size, qtype in slices:
            if self.runs and self.runs[-1][2] == qtype and sum(self.runs[-1][:2]) == offset:
                self.runs[-1] = (self.runs[-1][0], self.runs[-1][1] + size, qtype)
            else:
                self.runs.append((offset, size, qtype))
        widest = max(row_bytes(qtype, self.in_features) for qtype in self.shard_types.values())
        layer.weight = nn.Parameter(torch.empty(self.out_features, widest, dtype=torch.uint8), requires_grad=False)
        layer.weight.weight_loader = self._loader(layer)
        create_bias(layer, output_size, bias)

    def _loader(self, layer: nn.Module):
        def load(param: nn.Parameter, loaded: QuantizedTensor, shard_id: object = None) -> None:
            qtype = self.shard_types.get(shard_id)
            blocks = blocks_of(loaded, qtype, f" for shard {shard_id!r}")
            # The layer cuts its rows as from a dense weight: give it this type's bytes of each row.
            layer.weight_loader(param.data[:, :row_bytes(qtype, self.in_features)], blocks, shard_id)
        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        blocks, parts = [], []
        for first, rows, qtype in self.runs:
            run = layer.weight.data[first:first + rows, :row_bytes(qtype, self.in_features)]
            kernel_rows, kernel_type = kernel_blocks(run, qtype, self.in_features)
            blocks.append(kernel_rows.view(-1))
            parts.append((rows, kernel_type))
        layer.weight.data = torch.cat(blocks)
        self.parts = torch.tensor(parts, dtype=torch.int64)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.nanovllm_cpu.gguf_linear_parts(x, layer.weight, self.parts, self.out_features, bias,
                                                        MAX_STREAMING_ROWS, self.activation_bits)

    def fused_kernel_args(self, layer: nn.Module) -> tuple[int, list, int, int]:
        """As CPUGGUFLinearMethod's, the parts table in the packed copy's place."""
        return PARTS_KIND, [layer.weight, self.parts, None], MAX_STREAMING_ROWS, self.activation_bits
