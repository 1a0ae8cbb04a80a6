"""Per-request sampling settings with vLLM's names and meanings, validated on construction.

The one source of truth for what a request may ask for: the OpenAI server builds these too,
and every message starts with the field's name (the server reports it as the error's
`param`). Values are checked as they will be stored: floats finite in float32, integers
within int64. What depends on the model (token ids and top_k within the vocabulary) is
checked by `check_against_vocabulary` when the engine admits the request, and a constraint's
schema, regex or grammar when the engine compiles it (engine/structured_output.py).
"""

import json
import math
from dataclasses import dataclass

MAX_LOGPROBS = 20  # top-N log-probabilities per token, at most (vLLM's default max_logprobs)
FLOAT32_MAX = 3.4028234663852886e38
INT64_MAX = 2**63 - 1
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: [-100, 100]


@dataclass
class StructuredOutputsParams:
    """A constraint on what a request may generate, with vLLM's names: exactly one of a JSON
    schema (a dict or its JSON text), any JSON object, a regular expression, a choice among
    strings, or a context-free grammar (Lark, or GBNF as llama.cpp writes it)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self):
        given = [kind for kind in self.KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(self.KINDS)}, "
                             f"got {', '.join(given) or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json must be a JSON schema; its text is not JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {self.json!r}")
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None:
                if not isinstance(value, str) or not value:
                    raise ValueError(f"structured_outputs.{kind} must be a non-empty string, got {value!r}")
                check_text(f"structured_outputs.{kind}", value)
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")
            for i, c in enumerate(self.choice):
                check_text(f"structured_outputs.choice[{i}]", c)
            self.choice = list(self.choice)
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be true, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        return next(kind for kind in self.KINDS if getattr(self, kind) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints compile once."""
        value = getattr(self, self.kind)
        return self.kind, value if isinstance(value, str) else json.dumps(value, sort_keys=True)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in prompt or output
    presence_penalty: float = 0.0  # subtracted once from tokens already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    seed: int | None = None  # per-request stream; None draws from the engine's seeded stream
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None = up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-N log-probabilities per generated token (plus the sampled one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    structured_outputs: StructuredOutputsParams | None = None
    # An engine that speculates drafts at most this many tokens a step for this request (0: none);
    # None: as many as the engine's speculative_config says. No effect on an engine that does not.
    num_speculative_tokens: int | None = None

    def __post_init__(self):
        _check_int("n", self.n, 1)
        if self.num_speculative_tokens is not None:
            _check_int("num_speculative_tokens", self.num_speculative_tokens, 0)
        _check_float("temperature", self.temperature, ">= 0 (0 means greedy)", lambda v: v >= 0)
        _check_float("top_p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1)
        if _is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0
        _check_int("top_k", self.top_k, 0, "an integer >= 1, or 0 / -1 to disable it")
        _check_float("min_p", self.min_p, "in [0, 1]", lambda v: 0 <= v <= 1)
        _check_float("repetition_penalty", self.repetition_penalty, "> 0 (1 disables it)", lambda v: v > 0)
        _check_float("presence_penalty", self.presence_penalty, "in [-2, 2]", lambda v: -2 <= v <= 2)
        _check_float("frequency_penalty", self.frequency_penalty, "in [-2, 2]", lambda v: -2 <= v <= 2)
        if self.seed is not None:
            _check_int("seed", self.seed, -INT64_MAX - 1, "a 64-bit integer")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, f"an integer in [0, {MAX_LOGPROBS}]", MAX_LOGPROBS)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, "
                             f"got {type(self.structured_outputs).__name__}")
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _stop_token_ids(self.stop_token_ids)
        self.temperature = float(self.temperature)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_against_vocabulary(self, vocab_size: int) -> None:
        """Raise ValueError for a token id, top_k or number of logprobs that the model's vocabulary
        cannot hold."""
        outside = [t for t in self.stop_token_ids if t >= vocab_size]
        if outside:
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab_size}), got {outside[:5]}")
        outside = [t for t in self.logit_bias or {} if t >= vocab_size]
        if outside:
            raise ValueError(f"logit_bias must map token ids in [0, {vocab_size}) to biases, got ids {outside[:5]}")
        if self.top_k > vocab_size:
            raise ValueError(f"top_k must be at most the vocabulary size {vocab_size} (or 0 / -1 to disable "
                             f"it), got {self.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(self, name) or 0) > vocab_size:
                raise ValueError(f"{name} must be at most the vocabulary size {vocab_size}, "
                                 f"got {getattr(self, name)}")


def check_text(name: str, text: str) -> None:
    """Raise ValueError if `text` is not valid Unicode (a lone surrogate, from JSON's "\\ud800"
    or a Python literal, cannot be encoded, tokenized or sent back)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} must be valid Unicode text; it holds a lone surrogate "
                         f"{text[e.start]!r} at index {e.start}") from None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value, minimum: int, allowed: str | None = None, maximum: int = INT64_MAX):
    if not _is_int(value) or not minimum <= value <= maximum:
        allowed = allowed or f"an integer >= {minimum} that fits in 64 bits"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _check_float(name: str, value, allowed: str, ok):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number {allowed}, got {value!r}")
    if not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):  # stored as float32, where it would be inf
        raise ValueError(f"{name} must be a finite number {allowed} that fits in float32, got {value!r}")
    if not ok(value):
        raise ValueError(f"{name} must be a number {allowed}, got {value!r}")


def _stop_strings(stop) -> list[str]:
    strings = [stop] if isinstance(stop, str) else stop
    if strings is None:
        return []
    if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) and s for s in strings):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    for i, s in enumerate(strings):
        check_text(f"stop[{i}]", s)
    return list(strings)


def _logit_bias(bias) -> dict[int, float]:
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must map token ids to biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                         f"got {bias!r}")
    for token, value in bias.items():
        if not _is_int(token) or not 0 <= token <= INT64_MAX:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
        _check_float(f"logit_bias[{token}]", value, f"in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
                     lambda v: -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS)
    return {token: float(value) for token, value in bias.items()}


def _stop_token_ids(ids) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and 0 <= t <= INT64_MAX for t in ids):
        raise ValueError(f"stop_token_ids must be a list of non-negative token ids, got {ids!r}")
    return list(ids)
