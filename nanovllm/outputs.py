"""What the engine returns, shaped as vLLM's RequestOutput / CompletionOutput / Logprob, and a
pooling model's EmbeddingRequestOutput / EmbeddingOutput.

Logprobs are log_softmax of the model's raw logits, before temperature, penalties and
top-k/top-p/min-p (vLLM's default): they describe the model, not the sampling settings.
"""

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One dict per position: the top-N tokens and the chosen (sampled or prompt) token.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error" (its step failed) or None while running
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # first entry is None


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # empty when the request did not finish normally (finish_reason)


@dataclass
class EmbeddingRequestOutput:
    """A pooling model's answer to one prompt (vLLM's EmbeddingRequestOutput)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    finish_reason: str | None = None  # "stop" (pooled), "abort" or "error" (its step failed)
