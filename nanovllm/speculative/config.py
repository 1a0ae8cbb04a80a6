"""`speculative_config` (vLLM's names): which method drafts, how many tokens, and each method's
settings, checked when the engine is configured; and the proposer it builds for the methods
without a second model (a draft model runs in the engine: engine/draft_model.py)."""

from dataclasses import dataclass, fields

from nanovllm.speculative.ngram import NgramProposer
from nanovllm.speculative.suffix import SuffixProposer

METHODS = ("ngram", "suffix", "draft_model")
MAX_SPECULATIVE_TOKENS = 64
# Beyond a few decoding sequences a step's weights are already shared by many rows, and extra
# rows to verify cost compute that speculation rarely pays back.
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int | None = None  # ngram: required; suffix: the tree depth by default
    prompt_lookup_min: int | None = None  # ngram: the shortest n-gram matched (default 2, at most max)
    prompt_lookup_max: int | None = None  # ngram: the longest (default 5)
    suffix_decoding_max_tree_depth: int = 24  # the longest suffix matched
    suffix_decoding_max_cached_requests: int = 1000  # finished requests' outputs searched too
    suffix_decoding_max_spec_factor: float = 1.0  # a draft is at most this many times the match's length
    suffix_decoding_min_token_prob: float = 0.1  # a draft stops where its tokens' joint share falls below
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE  # no drafts while more sequences decode
    model: str | None = None  # draft_model: the draft's checkpoint (its tokenizer must be the target's)
    quantization: str | None = None  # draft_model: as the engine's `quantization`, for the draft
    draft_tensor_parallel_size: int = 1  # draft_model: the draft runs unsharded, on the first rank

    @classmethod
    def of(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
        """The config from `LLM(speculative_config=...)` / `--speculative-config`; ValueError on
        any field or value it does not take, naming what is allowed."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        if value.get("model") is not None and value.get("method") is None:
            value = {**value, "method": "draft_model"}  # vLLM infers the method from a model
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown fields {unknown}; it takes {sorted(known)}")
        if value.get("method") not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(map(repr, METHODS))}, "
                             f"got {value.get('method')!r}")
        config = cls(**value)
        config._resolve()
        return config

    def _resolve(self) -> None:
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config.model names the draft model of method 'draft_model' and only "
                             f"that method; got method {self.method!r} with model {self.model!r}")
        if self.method == "draft_model":
            if self.num_speculative_tokens is None:
                raise ValueError("speculative_config.num_speculative_tokens is required for method 'draft_model'")
            if self.draft_tensor_parallel_size != 1:
                raise ValueError("speculative_config.draft_tensor_parallel_size must be 1 (the draft model runs "
                                 f"unsharded), got {self.draft_tensor_parallel_size!r}")
        elif self.quantization is not None:
            raise ValueError("speculative_config.quantization applies to method 'draft_model' only")
        if self.method == "ngram":
            if self.num_speculative_tokens is None:
                raise ValueError("speculative_config.num_speculative_tokens is required for method 'ngram'")
            self.prompt_lookup_max = 5 if self.prompt_lookup_max is None else self.prompt_lookup_max
            self.prompt_lookup_min = (min(2, self.prompt_lookup_max) if self.prompt_lookup_min is None
                                      else self.prompt_lookup_min)
            _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, self.prompt_lookup_max)
            _check_int("prompt_lookup_max", self.prompt_lookup_max, 1, 64)
        elif self.method == "suffix":
            _check_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, 1, 1024)
            if self.num_speculative_tokens is None:
                self.num_speculative_tokens = min(self.suffix_decoding_max_tree_depth, MAX_SPECULATIVE_TOKENS)
            _check_int("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, 0, 1 << 20)
            _check_float("suffix_decoding_max_spec_factor", self.suffix_decoding_max_spec_factor, 0, 1024)
            _check_float("suffix_decoding_min_token_prob", self.suffix_decoding_min_token_prob, 0, 1)
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _check_int("disable_by_batch_size", self.disable_by_batch_size, 0, 1 << 20)

    def proposer(self) -> NgramProposer | SuffixProposer | None:
        """The proposer of a method without a second model; None for 'draft_model'."""
        if self.method == "draft_model":
            return None
        if self.method == "ngram":
            return NgramProposer(self.prompt_lookup_min, self.prompt_lookup_max, self.num_speculative_tokens)
        return SuffixProposer(self.num_speculative_tokens, self.suffix_decoding_max_tree_depth,
                              self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob,
                              self.suffix_decoding_max_cached_requests)


def _check_int(name: str, value, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"speculative_config.{name} must be an integer in [{low}, {high}], got {value!r}")


def _check_float(name: str, value, low: float, high: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"speculative_config.{name} must be a number in [{low}, {high}], got {value!r}")
