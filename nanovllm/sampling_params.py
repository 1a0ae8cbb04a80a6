"""Per-request sampling settings with vLLM's names and meanings, validated on construction."""

from dataclasses import dataclass


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

    def __post_init__(self):
        _check_int("n", self.n, 1)
        _check_number("temperature", self.temperature, ">= 0 (0 means greedy)", lambda v: v >= 0)
        _check_number("top_p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 1, or 0 / -1 to disable it; got {self.top_k!r}")
        _check_number("min_p", self.min_p, "in [0, 1]", lambda v: 0 <= v <= 1)
        _check_number("repetition_penalty", self.repetition_penalty, "> 0 (1 disables it)", lambda v: v > 0)
        _check_number("presence_penalty", self.presence_penalty, "in [-2, 2]", lambda v: -2 <= v <= 2)
        _check_number("frequency_penalty", self.frequency_penalty, "in [-2, 2]", lambda v: -2 <= v <= 2)
        if self.seed is not None:
            _check_int("seed", self.seed, None)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = stop
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        self.temperature = float(self.temperature)
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_int(name: str, value, minimum: int | None):
    if not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum):
        allowed = "an integer" if minimum is None else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _check_number(name: str, value, allowed: str, ok):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ValueError(f"{name} must be a number {allowed}, got {value!r}")
