"""Prompt-lookup n-gram drafts (vLLM's `ngram` method): the tokens that followed the most recent
earlier occurrence of the context's last n tokens (that has a whole draft after it), for the
longest n in [min_n, max_n] that occurs earlier. Text that copies from its prompt or repeats
itself (edits, extraction, quoting) is drafted well; anything else gets no draft, at the cost of
one vectorised search a step."""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int, max_n: int, num_tokens: int):
        self.min_n, self.max_n, self.num_tokens = min_n, max_n, num_tokens

    def propose(self, token_ids: list[int] | np.ndarray, max_tokens: int | None = None) -> list[int]:
        """Up to min(num_tokens, max_tokens) draft tokens to follow `token_ids`; [] if its last
        min_n tokens never occurred before."""
        budget = self.num_tokens if max_tokens is None else min(self.num_tokens, max_tokens)
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        if budget < 1 or length <= self.min_n:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            pattern = tokens[length - n:]
            # Windows that start before the pattern itself: each is followed by at least one token.
            windows = sliding_window_view(tokens[:length - 1], n)
            starts = np.flatnonzero((windows == pattern).all(axis=1))
            if len(starts):
                # The most recent occurrence continues likeliest alike; one too close to the end
                # to give a whole draft (a run of repeats) yields to the latest that does.
                whole = starts[starts + n + budget <= length]
                follow = int(whole[-1] if len(whole) else starts[-1]) + n
                return tokens[follow:follow + budget].tolist()
        return []

    def finish(self, output_token_ids: list[int]) -> None:
        """A request finished: n-gram drafts come from each request's own tokens alone."""
