"""Vocab-parallel token embedding and LM head.

Both hold one shard of the vocabulary rows per rank. The vocabulary is padded up to a
multiple of the tensor parallel size so every rank's shard has the same size; padding rows
are zero and their logits are trimmed before anyone sees them.
"""

import torch
from torch import nn

from nanovllm.distributed.parallel_state import TPGroup
from nanovllm.layers.quantization import LinearMethod, UnquantizedLinearMethod


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, *, tp_group: TPGroup):
        super().__init__()
        self.tp_group = tp_group
        self.vocab_size = vocab_size
        self.vocab_per_rank = -(-vocab_size // tp_group.world_size)  # ceil: the last shard carries padding
        self.vocab_start = tp_group.rank * self.vocab_per_rank
        self.weight = nn.Parameter(torch.empty(self.vocab_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        # How the table is stored and read (a weight format may keep it in blocks).
        self.linear_method: LinearMethod = UnquantizedLinearMethod()

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"unpacked parameter got shard {shard_id!r}")
        expected = (self.vocab_size, param.shape[1])
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"expected shape {expected}, got {tuple(loaded_weight.shape)}")
        rows = loaded_weight[self.vocab_start:self.vocab_start + self.vocab_per_rank]
        param.data[:rows.shape[0]].copy_(rows)
        param.data[rows.shape[0]:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group.world_size == 1:
            return self.linear_method.embed(self, input_ids)
        # Ids owned by other ranks look up row 0 and are zeroed, so the all-reduce sums
        # exactly one real row per token.
        local_ids = input_ids - self.vocab_start
        foreign = (local_ids < 0) | (local_ids >= self.vocab_per_rank)
        y = self.linear_method.embed(self, local_ids.masked_fill(foreign, 0))
        y = y.masked_fill(foreign.unsqueeze(-1), 0)
        return self.tp_group.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """logits = hidden @ W^T over this rank's vocab shard, gathered on rank 0.

    A tied head is built the same way and then given the embedding's weight parameter. The
    weight is the embedding's, and so is its linear method (a kernel's method may repack it at
    load time; a weight format may keep it in blocks).
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, tp_group: TPGroup):
        super().__init__(vocab_size, hidden_size, tp_group=tp_group)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [n, hidden_size] -> fp32 logits [n, vocab_size] on rank 0, None elsewhere."""
        logits = self.tp_group.gather(self.linear_method.logits(self, hidden), dim=-1)
        return None if logits is None else logits[:, :self.vocab_size]
