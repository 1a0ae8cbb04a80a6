"""A checkpoint as a pooling model (a decoder built without its LM head) loads it.

A base model's checkpoint (transformers' AutoModel: `Qwen3Model`, and sentence-transformers
directories such as Qwen3-Embedding's) names its tensors without the `model.` prefix and has no
LM head; a CausalLM's names them with it, and its LM head's tensors are of no use to pooling.
Both become the pooling model's names here; the loader stays strict about every other tensor.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from nanovllm.loader.checkpoint import Checkpoint

_PREFIX = "model."


def pooling_model_name(name: str) -> str | None:
    """A checkpoint tensor's name in the pooling model; None for the LM head's tensors."""
    if name.startswith("lm_head."):
        return None
    return name if name.startswith(_PREFIX) else _PREFIX + name


@dataclass(frozen=True)
class PoolingModelView:
    """`checkpoint`'s block types and weights under the pooling model's names."""

    checkpoint: Checkpoint

    def block_types(self, quantization: str | None) -> dict[str, str]:
        return {model_name: qtype for name, qtype in self.checkpoint.block_types(quantization).items()
                if (model_name := pooling_model_name(name)) is not None}

    def weights(self, dtype: torch.dtype, blocks: dict[str, str] | None = None) -> Iterator[tuple[str, object]]:
        # `blocks` names tensors as the model does; a checkpoint spells each name one way (with
        # the prefix or without it), never both, so the other spelling matches nothing.
        blocks = {name: qtype for model_name, qtype in (blocks or {}).items()
                  for name in (model_name, model_name.removeprefix(_PREFIX))}
        for name, tensor in self.checkpoint.weights(dtype, blocks):
            model_name = pooling_model_name(name)
            if model_name is not None:
                yield model_name, tensor
