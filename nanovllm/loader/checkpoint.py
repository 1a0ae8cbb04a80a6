"""The one entry to a checkpoint: `open_checkpoint` decides its format once (a Hugging Face model
directory, a .gguf file, or the default model's alias) and returns an object that gives its
config, tokenizer, EOS ids and weights. Every problem is reported as a ValueError (or
FileNotFoundError) naming the file and what is wrong.

The objects are plain records of a path, so they travel to tensor-parallel workers with the
engine config. The GGUF reader and the block quantizer (both on gguf-py) are imported only for
a GGUF file or a quantization at load: a machine without gguf-py runs Hugging Face checkpoints.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from nanovllm.loader.default_model import DEFAULT_MODEL_ALIAS, default_model_path
from nanovllm.loader.safetensors import iter_safetensors, matrix_names

if TYPE_CHECKING:
    from nanovllm.loader.quantized import QuantizedTensor

# What an HF checkpoint may be quantized to at load (`quantization=`), as GGML types; gguf-py
# quantizes these.
LOAD_TIME_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0"}

# The matrices with a row per vocabulary token (HF names).
_VOCABULARY_MATRICES = ("model.embed_tokens.", "lm_head.")
# Files that hold a vocabulary; without one, transformers builds an empty tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


@dataclass(frozen=True)
class HFCheckpoint:
    """A model directory: config.json, *.safetensors, tokenizer files."""

    path: str

    def config(self) -> PretrainedConfig:
        if not os.path.isfile(os.path.join(self.path, "config.json")):
            raise ValueError(f"model directory {self.path!r} has no config.json")
        from transformers import AutoConfig  # its registry of every model: a GGUF start does without it

        try:
            return AutoConfig.from_pretrained(self.path)
        except (ValueError, OSError, TypeError, StrictDataclassError) as e:  # a wrongly typed value too
            raise ValueError(f"model directory {self.path!r} has a malformed config.json: {_one_line(e)}") from e

    def tokenizer(self) -> PreTrainedTokenizerBase:
        if not any(os.path.isfile(os.path.join(self.path, name)) for name in TOKENIZER_FILES):
            raise ValueError(f"model directory {self.path!r} has no tokenizer (none of "
                             f"{', '.join(TOKENIZER_FILES)}); copy the tokenizer files of the model into it")
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.path)
        except (ValueError, OSError, TypeError, KeyError) as e:  # a corrupt tokenizer.json, a bad tokenizer_config
            files = sorted(n for n in os.listdir(self.path) if n.startswith(("tokenizer", "vocab", "special")))
            raise ValueError(f"model directory {self.path!r} has a tokenizer that cannot be loaded (from "
                             f"{', '.join(files)}): {type(e).__name__}: {_one_line(e)}") from e

    def check_quantization(self, quantization: str | None) -> None:
        """Every value of EngineConfig.quantization applies to a Hugging Face checkpoint."""

    def eos_token_ids(self, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> set[int]:
        """Every EOS id the model declares: config, generation_config.json and tokenizer."""
        ids = set(_as_list(getattr(config, "eos_token_id", None)))
        gen_file = os.path.join(self.path, "generation_config.json")
        if os.path.isfile(gen_file):
            with open(gen_file) as f:
                ids.update(_as_list(json.load(f).get("eos_token_id")))
        ids.update(_as_list(tokenizer.eos_token_id))
        return ids

    def block_types(self, quantization: str | None) -> dict[str, str]:
        """Tensor name -> GGML type for the tensors to quantize at load (`quantization` q8_0 or
        q4_0: every matrix; the layers that cannot take blocks load them dense). As in llama.cpp's
        Q4_0 files, the embedding and LM head keep 8 bits (Q8_0): at 4 bits they cost the most
        quality (eval-kl figures in benchmarks/RESULTS.md)."""
        if quantization not in LOAD_TIME_TYPES:
            return {}
        qtype = LOAD_TIME_TYPES[quantization]
        return {name: "Q8_0" if name.startswith(_VOCABULARY_MATRICES) else qtype for name in matrix_names(self.path)}

    def weights(self, dtype: torch.dtype, blocks: dict[str, str] | None = None
                ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """(name, tensor) in the file's dtype (the weight loaders convert), those named in
        `blocks` quantized to its type."""
        blocks = blocks or {}
        for name, tensor in iter_safetensors(self.path):
            yield name, _quantized().QuantizedTensor.quantize(tensor, blocks[name]) if name in blocks else tensor


@dataclass(frozen=True)
class GGUFCheckpoint:
    """A .gguf file: metadata, tensors and the tokenizer in one file."""

    path: str

    def config(self) -> PretrainedConfig:
        return _gguf().load_gguf_config(self.path)

    def tokenizer(self) -> PreTrainedTokenizerBase:
        return _gguf().load_gguf_tokenizer(self.path)

    def eos_token_ids(self, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> set[int]:
        return set(_gguf().gguf_eos_token_ids(self.path, tokenizer))

    def check_quantization(self, quantization: str | None) -> None:
        if quantization in LOAD_TIME_TYPES:
            raise ValueError(f"quantization={quantization!r} quantizes a Hugging Face checkpoint at load; "
                             f"{self.path} is a GGUF file, already quantized: leave quantization unset")

    def block_types(self, quantization: str | None) -> dict[str, str]:
        """Tensor name -> GGML type of the matrices the file stores in blocks the engine can keep
        (all of them unless `quantization` is "dense")."""
        return {} if quantization == "dense" else _gguf().gguf_block_types(self.path)

    def weights(self, dtype: torch.dtype, blocks: dict[str, str] | None = None
                ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        return _gguf().iter_gguf_weights(self.path, dtype, blocks)


Checkpoint = HFCheckpoint | GGUFCheckpoint


def open_checkpoint(model: str | None) -> Checkpoint:
    """`model`: a model directory, a .gguf file, or None / the alias for the default model."""
    if model is None or model == DEFAULT_MODEL_ALIAS:
        model = default_model_path()
    path = os.path.expanduser(str(model))
    if not os.path.exists(path):
        raise FileNotFoundError(f"model not found: {path!r} (expected a Hugging Face model directory, "
                                f"a .gguf file, or the alias {DEFAULT_MODEL_ALIAS!r})")
    if os.path.isfile(path) and path.endswith(".gguf"):
        return GGUFCheckpoint(path)
    if not os.path.isdir(path):
        raise ValueError(f"model {path!r} is neither a directory nor a .gguf file")
    return HFCheckpoint(path)


def _gguf():
    from nanovllm.loader import gguf
    return gguf


def _quantized():
    from nanovllm.loader import quantized
    return quantized


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
