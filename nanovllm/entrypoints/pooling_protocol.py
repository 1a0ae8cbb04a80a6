"""The request body of /v1/embeddings (OpenAI's shape, with vLLM's extras), on protocol's `_Strict`
base: its strict types, null-means-absent and error messages that name the field.

`input` is a string, a list of strings, a list of token ids or a list of such lists; each is
one prompt. `encoding_format` "base64" sends each vector as its little-endian float32 bytes
in base64 (what OpenAI's clients decode); `dimensions` keeps the first N values (Matryoshka).
"""

from typing import Any, Literal

from pydantic import field_validator

from nanovllm.entrypoints.protocol import Text, _Strict, add_field_names, as_prompt_list, check_prompts
from nanovllm.pooling_params import PoolingParams


class EmbeddingRequest(_Strict):
    model: Text | None = None  # None: the served model, as in vLLM
    input: Any  # checked below
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: Text | None = None  # informational in OpenAI's API; accepted, used for nothing
    # vLLM's extras
    add_special_tokens: bool = True  # the tokenizer's BOS etc. around a text input
    normalize: bool | None = None  # None: the model's pooler config decides

    @field_validator("input")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        return check_prompts("input", value)

    def inputs(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        return as_prompt_list(self.input)

    def pooling_params(self) -> PoolingParams:
        """Raises ValueError naming the field when a value is out of range."""
        return PoolingParams(dimensions=self.dimensions, normalize=self.normalize)


add_field_names(EmbeddingRequest)
