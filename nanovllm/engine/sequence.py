"""A request and its generation streams (sequences): tokens, how far each stream's KV is
computed, its block table, its stop checker, its grammar state if constrained, and what has been
produced for the caller so far. A pooling model's request (runner="pooling") has one sequence
that samples nothing: it prefills its prompt, is pooled into a vector, and finishes."""

from collections.abc import Callable
from enum import Enum, auto
from itertools import count

import torch

from nanovllm.engine.stop import StopChecker
from nanovllm.engine.structured_output import GrammarState
from nanovllm.outputs import PositionLogprobs
from nanovllm.pooling_params import PoolingParams
from nanovllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams | None,
                 stop_checker: StopChecker | None = None, index: int = 0, parent: "Sequence | None" = None,
                 grammar: GrammarState | None = None, pooling_params: PoolingParams | None = None):
        """A pooling sequence has `pooling_params` and no sampling params (None)."""
        self.seq_id = next(Sequence._ids)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        # Pooling (rank 0 only): what the pooler carries from one chunk of the prompt to the next;
        # whether it reads every prompt position (MEAN, CLS), which a prefix-cache hit would skip.
        self.pooling_state: torch.Tensor | None = None
        self.pools_every_position = False
        # Decides when this sequence ends (by default from its params alone: no EOS, no text).
        self.stop_checker = stop_checker or (StopChecker(sampling_params) if sampling_params is not None else None)
        # Where this stream stands in its structured-output constraint (rank 0 only); it has
        # consumed every generated token, so it survives preemption as it is.
        self.grammar = grammar
        # The n completions of one request: index i > 0 forks the prompt blocks of index 0.
        self.index = index
        self.parent = parent
        self.request_id: str | None = None
        self.status = SequenceStatus.WAITING
        # Tokens whose KV is in the cache. A decode step is simply "1 new token".
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # Hash chain of this sequence's full, written blocks (block_hashes[i] is block i's).
        self.block_hashes: list[int | None] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # Sampling state (rank 0 only): a private random stream for seeded requests.
        self.generator: torch.Generator | None = None
        if sampling_params is not None and sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(hash((sampling_params.seed, index)) & (2**63 - 1))
        self.logprobs: list[PositionLogprobs] = []
        # Speculative decoding (rank 0): the tokens drafted for the next step; after drafts that
        # all failed, how many in a row did, and how many steps still skip drafting.
        self.draft_token_ids: list[int] = []
        self.draft_misses = 0
        self.draft_pause = 0
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[PositionLogprobs | None] = [None]

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs are computed once, by the first stream, while its prompt is prefilled."""
        return (self.index == 0 and self.sampling_params is not None
                and self.sampling_params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens)

    def reset_for_recompute(self):
        """Preemption by recompute: drop all KV; generated tokens are kept and recomputed as prompt."""
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table = []
        self.block_hashes = []


class Request:
    """One prompt submitted by a caller and its `n` sequences."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 sampling_params: SamplingParams | None, make_stop_checker: Callable[[], StopChecker] | None = None,
                 make_grammar: Callable[[], GrammarState] | None = None, pooling_params: PoolingParams | None = None):
        """`make_stop_checker` gives each sequence its own checker (a detokenizer follows one
        stream), `make_grammar` its own grammar state when the request is constrained. A pooling
        request gives `pooling_params` instead of sampling params."""
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        if pooling_params is not None:
            self.seqs = [Sequence(prompt_token_ids, None, pooling_params=pooling_params)]
            self.seqs[0].request_id = request_id
            return
        make = make_stop_checker or (lambda: StopChecker(sampling_params))
        grammar = make_grammar or (lambda: None)
        first = Sequence(prompt_token_ids, sampling_params, make(), grammar=grammar())
        self.seqs = [first] + [Sequence(prompt_token_ids, sampling_params, make(), index=i, parent=first,
                                        grammar=grammar())
                               for i in range(1, sampling_params.n)]
        for seq in self.seqs:
            seq.request_id = request_id

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)
