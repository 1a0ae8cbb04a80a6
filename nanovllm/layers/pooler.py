"""Pooling: a prompt's final-normed hidden states (what the model's forward returns) into one
vector, as its PoolerConfig says (LAST, MEAN or CLS), then cut to a request's `dimensions` and
L2-normalised where asked. In float32, whatever the model's dtype.

A prompt may be prefilled in chunks over several steps: `accumulate` carries what the pooler
needs from one chunk to the next (MEAN: the running sum; CLS: the first position's row) and
`finish` makes the vector at the chunk that ends the prompt.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanovllm.pooling_params import PoolerConfig, PoolingParams


@dataclass
class PoolerOutput:
    """One pooling step's vectors: one per sequence whose prompt ended, in batch order (none on
    tensor-parallel ranks other than 0)."""

    embeddings: list[list[float]]


class Pooler:
    def __init__(self, config: PoolerConfig):
        self.pooling_type = config.pooling_type
        self.normalize = config.normalize

    def accumulate(self, state: torch.Tensor | None, rows: torch.Tensor, first_position: int) -> torch.Tensor | None:
        """The state after a chunk: `rows` are the hidden states of positions first_position... (a
        chunk at position 0 starts afresh, as a prompt recomputed after preemption does)."""
        if self.pooling_type == "MEAN":
            chunk_sum = rows.float().sum(dim=0)
            return chunk_sum if first_position == 0 else state + chunk_sum
        if self.pooling_type == "CLS" and first_position == 0:
            return rows[0].float()
        return state

    def finish(self, state: torch.Tensor | None, last_rows: torch.Tensor, num_tokens: int,
               params: PoolingParams) -> torch.Tensor:
        """The prompt's vector, from the state after its last chunk (`last_rows`)."""
        if self.pooling_type == "MEAN":
            vector = state / num_tokens
        elif self.pooling_type == "CLS":
            vector = state
        else:
            vector = last_rows[-1].float()
        if params.dimensions is not None:
            vector = vector[:params.dimensions]
        normalize = self.normalize if params.normalize is None else params.normalize
        return F.normalize(vector, dim=-1) if normalize else vector
