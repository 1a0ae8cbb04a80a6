"""Suffix decoding (vLLM's `suffix` method, after the SuffixDecoding paper): drafts from the
continuations of the context's longest suffix that occurred before, in the request's own prompt
and output or in a bounded cache of recent requests' outputs, chosen by frequency.

What a suffix tree with counts answers is computed here on demand over flat token arrays: the
occurrences of the longest matching suffix (up to `max_depth` tokens) are found by narrowing
the positions of its last token one token back at a time; the draft then follows the most
frequent next token among those occurrences, token by token, while the product of the chosen
tokens' shares stays at or above `min_token_prob`. The draft's length adapts to the match: at
most `max_spec_factor` times the match's length, and at most `num_tokens`. Of the two sources,
the draft with the larger expected number of accepted tokens (the sum of those products) wins.

Storage is what the engine holds anyway (the request's tokens) plus the cache: the outputs of
the last `max_cached_requests` finished requests, one array with -1 between outputs (so no match
crosses two), and for each token id the positions where it occurs there (OutputCache).
"""

from collections import deque

import numpy as np

_SEPARATOR = -1


class SuffixProposer:
    def __init__(self, num_tokens: int, max_depth: int, max_spec_factor: float, min_token_prob: float,
                 max_cached_requests: int):
        self.num_tokens = num_tokens
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.cache = OutputCache(max_cached_requests)

    def propose(self, token_ids: list[int] | np.ndarray, max_tokens: int | None = None) -> list[int]:
        """Up to min(num_tokens, max_tokens) draft tokens to follow `token_ids`."""
        budget = self.num_tokens if max_tokens is None else min(self.num_tokens, max_tokens)
        context = np.asarray(token_ids, dtype=np.int64)
        if budget < 1 or len(context) < 1:
            return []
        own = self._draft(context, context, _positions_of(context[:-1], context[-1]), budget)
        shared = self._draft(self.cache.tokens, context, self.cache.positions_of(int(context[-1])), budget)
        return max(own, shared, key=lambda draft: draft[1])[0]

    def finish(self, output_token_ids: list[int]) -> None:
        """A request finished: its output joins the cache of recent outputs."""
        self.cache.add(output_token_ids)

    def _draft(self, tokens: np.ndarray, context: np.ndarray, ends: np.ndarray, budget: int) -> tuple[list[int], float]:
        """(draft, expected accepted tokens) from `tokens`, where `ends` are the positions of
        the context's last token that have a token after them."""
        ends = ends[ends + 1 < len(tokens)]
        match = 1
        while len(ends) and match < min(self.max_depth, len(context)):
            before = ends - match
            keep = (before >= 0) & (tokens[np.maximum(before, 0)] == context[-1 - match])
            if not keep.any():
                break
            ends, match = ends[keep], match + 1
        if not len(ends):
            return [], 0.0
        limit = min(budget, max(1, int(self.max_spec_factor * match)))
        draft, probability, expected = [], 1.0, 0.0
        following = ends + 1
        while len(draft) < limit and len(following):
            nexts = tokens[following]
            values, counts = np.unique(nexts[nexts != _SEPARATOR], return_counts=True)
            if not len(values):
                break
            best = int(counts.argmax())
            # Occurrences that end here (at a separator) count against the continuation.
            probability *= counts[best] / len(following)
            if probability < self.min_token_prob:
                break
            draft.append(int(values[best]))
            expected += probability
            following = following[nexts == values[best]] + 1
            following = following[following < len(tokens)]
        return draft, expected


def _positions_of(tokens: np.ndarray, token: int) -> np.ndarray:
    return np.flatnonzero(tokens == token)


class OutputCache:
    """The outputs of the last `max_requests` finished requests, searchable by token: one array
    (each output followed by a separator) and, per token id, the positions where it occurs.

    Adding an output appends it and its positions (its own length of work); evicting one only
    moves `start` past it, and positions before `start` are left out of searches. Once the
    evicted prefix is as long as what is kept, the arrays are rebuilt without it, so the work
    and memory stay proportional to the outputs kept."""

    def __init__(self, max_requests: int):
        self.max_requests = max_requests
        self._lengths: deque[int] = deque()  # of the kept outputs, separators included
        self._buffer = np.empty(1024, dtype=np.int64)  # tokens[:size]; grows by doubling
        self._size = 0
        self._positions: dict[int, list[int]] = {}
        self.start = 0  # the first kept position of `tokens`

    def add(self, output_token_ids: list[int]) -> None:
        if self.max_requests < 1 or not output_token_ids:
            return
        offset, length = self._size, len(output_token_ids) + 1
        for i, token in enumerate(output_token_ids):
            self._positions.setdefault(token, []).append(offset + i)
        if offset + length > len(self._buffer):
            self._buffer = np.resize(self._buffer, max(2 * len(self._buffer), offset + length))
        self._buffer[offset:offset + length - 1] = output_token_ids
        self._buffer[offset + length - 1] = _SEPARATOR
        self._size += length
        self._lengths.append(length)
        while len(self._lengths) > self.max_requests:
            self.start += self._lengths.popleft()
        if self.start >= self._size - self.start:
            self._compact()

    @property
    def tokens(self) -> np.ndarray:
        """The cache's tokens (evicted ones included before `start`: searches skip them; a match
        cannot run back into them, a separator stands between)."""
        return self._buffer[:self._size]

    def positions_of(self, token: int) -> np.ndarray:
        positions = np.asarray(self._positions.get(token, ()), dtype=np.int64)
        return positions[positions >= self.start]

    def _compact(self) -> None:
        kept = self._buffer[self.start:self._size].copy()
        self._positions = {}
        for position, token in enumerate(kept.tolist()):
            if token != _SEPARATOR:
                self._positions.setdefault(token, []).append(position)
        self._buffer, self._size, self.start = kept, len(kept), 0
