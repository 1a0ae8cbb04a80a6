"""A mixture-of-experts block's experts as one layer (vLLM's FusedMoE), and the softmax top-k router
that picks them.

Each token goes to the `top_k` experts whose router logits are highest, weighted by their softmax
probabilities (renormalised over the chosen experts where the family does so); the layer sums the
chosen experts' gated MLPs (down(act(gate x) * up x)) with those weights. Under tensor parallelism
every expert's intermediate dimension is sharded across ranks, as a dense MLP's is: each rank
holds every expert's share of gate/up rows and of down columns and computes a partial sum, which
the block all-reduces once (with its shared expert's, where it has one).

How the experts are stored and run is the layer's MoE method (layers/quantization/moe_methods.py),
asked of the model's LinearMethodChooser in the constructor by the layer's prefix, and kept.
Checkpoint tensors arrive one expert and projection at a time (shard id (expert, "gate" | "up" |
"down"), loader/weights.py); the weight loader cuts this rank's share out of each.
"""

import torch
from torch import nn

from nanovllm.distributed.parallel_state import TPGroup
from nanovllm.layers.linear import copy_chunk, divide
from nanovllm.layers.quantization.chooser import LinearMethodChooser
from nanovllm.layers.activation import GATED_ACTIVATIONS
from nanovllm.layers.quantization.moe_methods import MoEMethod, UnquantizedMoEMethod

PROJECTIONS = ("gate", "up", "down")


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32, expert ids int64), each [tokens, top_k], from router logits [tokens, experts]:
    the softmax over every expert in fp32, its top_k, renormalised to sum to 1 if asked."""
    probabilities = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probabilities, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 tp_group: TPGroup, renormalize: bool, activation: str = "silu", linear_methods: LinearMethodChooser | None = None,
                 prefix: str = ""):
        super().__init__()
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"experts' activation {activation!r} is not supported; supported: "
                             f"{', '.join(GATED_ACTIVATIONS)}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and the number of experts {num_experts}")
        self.num_experts, self.top_k, self.renormalize, self.activation = num_experts, top_k, renormalize, activation
        self.tp_group = tp_group
        self.hidden_size = hidden_size
        self.activation_bytes = torch.get_default_dtype().itemsize  # the model's dtype, as it is built
        self.intermediate_per_rank = divide(intermediate_size, tp_group.world_size, "the experts' intermediate size")
        self.moe_method: MoEMethod = (UnquantizedMoEMethod() if linear_methods is None else
                                      linear_methods.moe_method_for(self, prefix, hidden_size,
                                                                    self.intermediate_per_rank))
        self.moe_method.create_weights(self, num_experts, hidden_size, self.intermediate_per_rank)
        shard_ids = {(e, projection) for e in range(num_experts) for projection in PROJECTIONS}
        self.w13_weight.shard_ids = {s for s in shard_ids if s[1] != "down"}
        self.w2_weight.shard_ids = {s for s in shard_ids if s[1] == "down"}
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id[1] in PROJECTIONS
                and 0 <= shard_id[0] < self.num_experts):
            raise ValueError(f"an expert's tensor needs shard id (expert in 0..{self.num_experts - 1}, one of "
                             f"{PROJECTIONS}), got {shard_id!r}")
        expert, projection = shard_id
        target = self.moe_method.expert_rows(self, param, expert, projection)
        loaded = self.moe_method.checkpoint_rows(loaded_weight, projection)
        # gate and up are split by rows (column-parallel), down by its input columns (row-parallel).
        copy_chunk(target, loaded, 1 if projection == "down" else 0, self.tp_group.rank, self.tp_group.world_size)

    def step_buffer_bytes(self, tokens: int) -> int:
        """The routing buffers of a step of `tokens` tokens, at their largest (the CPU kernel's and
        the Triton kernels' alike): each (token, expert) pair's row of x, its gate/up and activation
        in the model dtype, its down projection in fp32, and the step's indices."""
        width = self.activation_bytes
        row = self.hidden_size * (width + 4) + 3 * self.intermediate_per_rank * width + 4 * 8
        return tokens * self.top_k * row

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [tokens, hidden], router_logits [tokens, experts] -> this rank's partial sum [tokens, hidden]
        (the caller all-reduces)."""
        weights, ids = route(router_logits, self.top_k, self.renormalize)
        return self.moe_method.apply(self, x, weights, ids)
