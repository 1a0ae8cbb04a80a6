"""Continuous batching: decides, each step, which sequences run and how many tokens each.

One token budget (`max_num_batched_tokens`) per step is shared by running sequences
first (a decode is one token; an unfinished prompt continues with a chunk) and then by
waiting prompts, chunked to fit, so a long prompt never stalls running sequences. When
blocks run out, the newest running sequence is preempted by recompute. A decoding sequence
with drafted tokens (speculative decoding) computes them too, as many as the budget leaves
room for; after the step it keeps the accepted ones' KV and gives back blocks that only
rejected drafts filled. Whether a sequence
ends is its stop checker's call (a pooling model's ends with its prompt); the scheduler frees
what ended. Pure Python: no tensors here.
"""

from collections import deque
from dataclasses import dataclass, field

from nanovllm.engine.block_manager import FREED, BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step's plan: sequences in batch order and how many new tokens each computes."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    drafts: list[list[int]] = field(default_factory=list)  # per sequence: the drafted tokens it verifies

    def __post_init__(self):
        if not self.drafts:  # a batch made without drafts: none for any sequence
            self.drafts = [[] for _ in self.seqs]

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, i: int) -> bool:
        """Whether sequence i reaches its last token this step, so a token is sampled for it."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens + len(self.drafts[i])


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first: preemption takes from the end
        self.num_preemptions = 0
        self.prefix_cache_hit_tokens = 0

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [])
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = seq.num_tokens - seq.num_computed_tokens
            num_new = min(remaining + len(seq.draft_token_ids), budget)
            while not self.block_manager.allocate(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                batch.drafts.append(seq.draft_token_ids[:max(0, num_new - remaining)])
                budget -= num_new
                i += 1
        # Admitting new work right after a preemption would only thrash the pool.
        if not preempted:
            self._admit(batch, budget)
        return batch

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        """Move waiting sequences into the batch, in order, while the budget, max_num_seqs and
        the block pool allow.

        The later streams of an n > 1 request share the first stream's full prompt blocks, and
        may join in the very step that computes the last of them: every attention backend writes
        a step's new KV into the cache before any query of the step reads it, so a stream may
        attend to blocks another writes in the same step."""
        bs = self.block_manager.block_size
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            parent = seq.parent
            shares_parent = parent is not None and parent.status == SequenceStatus.RUNNING
            # A running first stream was scheduled before this point and, with budget left, took
            # all of its prompt that remained: its prompt blocks are computed by the end of this
            # step at the latest (unless some already left its sliding window).
            shares_parent = shares_parent and FREED not in parent.block_table[:(seq.num_tokens - 1) // bs]
            if shares_parent:
                cached = parent.block_table[:(seq.num_tokens - 1) // bs]
            else:
                cached = self.block_manager.find_cached_prefix(seq)
            num_new = min(seq.num_tokens - len(cached) * bs, budget)
            if not self.block_manager.allocate(seq, num_new, cached):
                break
            self.waiting.popleft()
            if not shares_parent:  # counted once admitted: a sequence that waits is looked up again
                self.prefix_cache_hit_tokens += len(cached) * bs
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            batch.drafts.append([])
            budget -= num_new

    def _preempt(self, seq: Sequence):
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, batch: ScheduledBatch, sampled: list[int],
                    num_sampled: list[int] | None = None) -> list[tuple[Sequence, int]]:
        """Advance the batch after its step ran; `sampled` holds the tokens of the sampling
        sequences in batch order, `num_sampled` how many each has (None: one each; more where
        drafts were accepted: the accepted drafts, then the token sampled after them).

        Returns (sequence, tokens appended) for the sequences that received tokens (fewer than
        sampled where a stop came first; finished ones have status FINISHED)."""
        advanced = []
        tokens = iter(sampled)
        counts = iter(num_sampled) if num_sampled is not None else None
        for i, seq in enumerate(batch.seqs):
            if not batch.samples(i):
                self._advance(seq, batch.num_new_tokens[i])
                continue
            emitted = [next(tokens) for _ in range(next(counts) if counts is not None else 1)]
            # Token j was sampled at the row of the token before it: its KV is written, so each is
            # counted as computed just before the token after it is appended (and hashed with it).
            num_new = batch.num_new_tokens[i] - len(batch.drafts[i])
            appended = 0
            for token in emitted:
                self._advance(seq, num_new)
                num_new = 1
                appended += 1
                if self._append(seq, token):
                    break
            advanced.append((seq, appended))
            if not seq.is_finished and batch.drafts[i]:
                self.block_manager.free_tail(seq)
        return advanced

    def _append(self, seq: Sequence, token: int) -> bool:
        """Append a sampled token; True if it ended the sequence."""
        seq.token_ids.append(token)
        if seq.grammar is not None:
            seq.grammar.advance(token)
        stop = seq.stop_checker.check(token, seq.num_completion_tokens, seq.num_tokens,
                                      seq.grammar is not None and seq.grammar.finished)
        if stop is not None:
            self.finish(seq, *stop)
        return stop is not None

    def postprocess_pooled(self, batch: ScheduledBatch) -> list[Sequence]:
        """Advance a pooling model's batch after its step ran: a sequence whose prompt ended was
        pooled, and finishes (its blocks return to the pool). Returns those, in batch order."""
        pooled = []
        for i, seq in enumerate(batch.seqs):
            ends = batch.samples(i)
            self._advance(seq, batch.num_new_tokens[i])
            if ends:
                self.finish(seq, "stop")
                pooled.append(seq)
        return pooled

    def _advance(self, seq: Sequence, num_new_tokens: int):
        seq.num_computed_tokens += num_new_tokens
        # The step has run, so these blocks' KV is written: their hashes may be published.
        self.block_manager.cache_full_blocks(seq)
        self.block_manager.free_out_of_window(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None):
        """End seq (as its stop checker decided, or on an abort or a failed step) and free its blocks."""
        if seq.is_finished:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.block_manager.free(seq)
