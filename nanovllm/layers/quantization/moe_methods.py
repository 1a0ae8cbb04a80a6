"""The interface every mixture-of-experts method implements, and the plain one.

An MoE method stores and runs a FusedMoE layer's experts (layers/fused_moe.py): every expert's
gate and up projections in `w13_weight` and its down projection in `w2_weight`, however the
method lays them out. As a linear method does for a linear layer, it is chosen once, when the
layer is built (quantization/chooser.py's `moe_method_for`, from the platform), and kept.

The plain method holds dense weights, w13 [experts, 2 x intermediate, hidden] (gate rows, then
up rows) and w2 [experts, hidden, intermediate], and runs each expert the step selected on the
rows that chose it with torch's ops: the portable reference, and the path of dense experts. Which
experts run depends on the data, so the loop is one opaque op (`nanovllm::dense_moe`) that a
compiled graph calls as a whole.
"""

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.activation import GATED_ACTIVATIONS



class MoEMethod(ABC):
    """Stores a FusedMoE layer's experts and computes sum_j weights[t, j] * expert_{ids[t, j]}(x[t]).

    `create_weights` gives the layer `w13_weight` and `w2_weight`; `expert_rows` is where one
    expert's projection loads (a 2-D view: rows of the output, the input along dim 1), and
    `checkpoint_rows` what it loads from a checkpoint tensor (checked); `apply` runs the experts.
    """

    # Whether a step streams the loaded weights from memory (the platform lays them out for it).
    streams_weight: bool = False
    # Whether a step's launches are fixed whatever the routing, so that a CUDA graph can replay them.
    graph_capturable: bool = False

    @abstractmethod
    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        """`intermediate_size`: this rank's share of an expert's intermediate dimension."""

    @abstractmethod
    def expert_rows(self, layer: nn.Module, param: nn.Parameter, expert: int, projection: str) -> torch.Tensor: ...

    def checkpoint_rows(self, loaded: torch.Tensor, projection: str) -> torch.Tensor:
        return loaded

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
              ) -> torch.Tensor:
        """x [tokens, hidden]; topk_weights fp32 and topk_ids int64 [tokens, k] -> [tokens, hidden]
        (this rank's partial sum under tensor parallelism)."""


class UnquantizedMoEMethod(MoEMethod):
    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        dtype = torch.get_default_dtype()
        layer.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype),
                                        requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype),
                                       requires_grad=False)

    def expert_rows(self, layer: nn.Module, param: nn.Parameter, expert: int, projection: str) -> torch.Tensor:
        rows = param.data[expert]
        if projection == "down":
            return rows
        half = rows.shape[0] // 2
        return rows[:half] if projection == "gate" else rows[half:]

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
              ) -> torch.Tensor:
        return dense_moe(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, layer.activation)


@torch.library.custom_op("nanovllm::dense_moe", mutates_args=())
def dense_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str) -> torch.Tensor:
    """Each selected expert on the rows that chose it, weighted and summed in fp32."""
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    act = GATED_ACTIVATIONS[activation]().forward_native  # [gate | up] -> act(gate) * up
    first = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[first:first + count]
        first += count
        tokens = pairs // k
        y = F.linear(act(F.linear(x[tokens], w13[expert])), w2[expert])
        out.index_add_(0, tokens, y.float() * topk_weights.reshape(-1)[pairs, None])
    return out.to(x.dtype)


@dense_moe.register_fake
def _(x, w13, w2, topk_weights, topk_ids, activation):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
