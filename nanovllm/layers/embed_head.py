"""Vocab-parallel token embedding and LM head.

Both hold one shard of the vocabulary rows per rank. The vocabulary is padded up to a
multiple of the tensor parallel size so every rank's shard has the same size; padding rows
are zero and their logits are trimmed before anyone sees them.

How the table is stored, looked up and multiplied is the layer's linear method, chosen in the
constructor as a linear layer's is. A model whose head is tied to its embedding uses the one
embedding module for both (built with `computes_logits=True`, so that its method also multiplies
well): one weight and one method, loaded and processed once.
"""

import torch
from torch import nn

from nanovllm.distributed.parallel_state import TPGroup
from nanovllm.layers.quantization import LinearMethod
from nanovllm.layers.quantization.chooser import LinearMethodChooser, choose_linear_method


class VocabParallelEmbedding(nn.Module):
    """`computes_logits`: the table is also the LM head's (tied), so `logits` runs on it."""

    def __init__(self, vocab_size: int, hidden_size: int, *, tp_group: TPGroup,
                 linear_methods: LinearMethodChooser | None = None, prefix: str = "", computes_logits: bool = False):
        super().__init__()
        self.tp_group = tp_group
        self.vocab_size = vocab_size
        self.vocab_per_rank = -(-vocab_size // tp_group.world_size)  # ceil: the last shard carries padding
        self.vocab_start = tp_group.rank * self.vocab_per_rank
        self.linear_method: LinearMethod = choose_linear_method(linear_methods, self, prefix, hidden_size,
                                                                multiplies=computes_logits)
        self.linear_method.create_weights(self, hidden_size, self.vocab_per_rank, bias=False)

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

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [n, hidden_size] -> fp32 logits hidden @ W^T [n, vocab_size] over every rank's
        shard, gathered on rank 0; None elsewhere."""
        logits = self.tp_group.gather(self.linear_method.logits(self, hidden), dim=-1)
        return None if logits is None else logits[:, :self.vocab_size]


class ParallelLMHead(VocabParallelEmbedding):
    """An LM head of its own (untied): a table that only multiplies; calling it gives `logits`."""

    def __init__(self, vocab_size: int, hidden_size: int, *, tp_group: TPGroup,
                 linear_methods: LinearMethodChooser | None = None, prefix: str = ""):
        super().__init__(vocab_size, hidden_size, tp_group=tp_group, linear_methods=linear_methods, prefix=prefix,
                         computes_logits=True)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.logits(hidden)
