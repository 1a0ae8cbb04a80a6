"""When one sequence ends, and why: every stopping rule of a request in one place.

A `StopChecker` per sequence owns the EOS ids, stop token ids, stop strings (through the
sequence's incremental detokenizer, which it feeds), min_tokens, max_tokens and max_model_len,
and ends a constrained sequence whose grammar is complete.
After each token it says whether the sequence ends (finish_reason, stop_reason); before each
draw it says which ids the sampler must hold back, so min_tokens is enforced here alone. The
scheduler frees what it reports finished; aborts and failed steps end sequences elsewhere.
"""

from collections.abc import Iterable

from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.sampling_params import SamplingParams

# (finish_reason, stop_reason): ("stop", the stop token id, the stop string, or None for EOS or
# a complete grammar), or ("length", None).
Stop = tuple[str, int | str | None]


class StopChecker:
    def __init__(self, params: SamplingParams, max_tokens: int | None = None, max_model_len: int | None = None,
                 eos_token_ids: Iterable[int] = (), detokenizer: IncrementalDetokenizer | None = None):
        """`max_tokens` defaults to the params' (None: no limit but max_model_len). Without a
        detokenizer there is no text, so stop strings are not looked for."""
        self.max_tokens = max_tokens if max_tokens is not None else params.max_tokens
        self.max_model_len = max_model_len
        self.min_tokens = params.min_tokens
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.eos_token_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.detokenizer = detokenizer
        self._ending_ids = sorted(self.stop_token_ids | self.eos_token_ids)

    def _may_stop(self, num_output_tokens: int) -> bool:
        """min_tokens, the one rule: once num_output_tokens reach it, stop ids, EOS and stop
        strings end the sequence; before, they do not, and the next draw may not pick an ending id."""
        return num_output_tokens >= self.min_tokens

    def banned_token_ids(self, num_output_tokens: int) -> list[int]:
        """The ids the next draw must not pick: those that would end the sequence too early."""
        return [] if self._may_stop(num_output_tokens) else self._ending_ids

    def check(self, token: int, num_output_tokens: int, num_tokens: int, grammar_finished: bool = False
              ) -> Stop | None:
        """Take the token just appended (the sequence now holds num_tokens, num_output_tokens of
        them generated; `grammar_finished`: its constraint allows nothing more); returns why the
        sequence ends, or None if it goes on."""
        may_stop = self._may_stop(num_output_tokens)
        stop = None
        if may_stop and token in self.stop_token_ids:
            stop = ("stop", token)
        elif may_stop and token in self.eos_token_ids:
            stop = ("stop", None)
        stop_string = None
        # A stop token's own text is left out, as vLLM does, unless asked for.
        if self.detokenizer is not None and (stop is None or self.include_stop_str_in_output):
            stop_string = self.detokenizer.add_token(token, check_stop=may_stop)
        # A stop string completed by the last token the length limit allows is a stop, as in vLLM.
        if stop is None and stop_string is not None:
            stop = ("stop", stop_string)
        if stop is None and grammar_finished:  # before min_tokens too: no token could follow
            stop = ("stop", None)
        if stop is None and (self._at_limit(self.max_tokens, num_output_tokens)
                             or self._at_limit(self.max_model_len, num_tokens)):
            stop = ("length", None)
        return stop

    @staticmethod
    def _at_limit(limit: int | None, count: int) -> bool:
        return limit is not None and count >= limit
