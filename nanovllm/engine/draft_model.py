"""Speculative decoding's draft model (method "draft_model"): a smaller model with the target's
tokenizer, run greedily for k steps to draft each sequence's next k tokens, which the target
then verifies in one step like any other drafts (engine/speculation.py).

The draft has its own model runner, KV cache and block manager (with its own prefix cache).
Each target sequence that drafts has a shadow sequence here that shares its token list (the
target appends, the shadow sees it) and keeps the draft's own count of tokens whose KV is
written and its own block table. A proposal first brings the shadow's KV up to the sequence's
last token (the tokens accepted since its last proposal; a fresh shadow's whole context, in
chunks of the token budget) and takes the draft's first token from that step, then runs one
decode step per further token; a constrained sequence's drafts are chosen among the tokens
its grammar allows after the drafts before them. The KV the draft wrote for its own drafts
counts as computed once the target accepts the same tokens there, so a step in which all drafts
held recomputes two tokens (the last draft and the target's token after it).
A shadow is dropped, its blocks freed, once its sequence is no longer running (finished,
aborted, preempted); one that comes back catches up again, from the draft's prefix cache.
"""

from nanovllm.config import EngineConfig
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.structured_output import grammar_bitmask


def check_same_tokenizer(target, draft, draft_model: str) -> None:
    """A draft's tokens are the target's token ids: both must map text to ids alike."""
    if target.get_vocab() != draft.get_vocab():
        raise ValueError(f"speculative_config.model {draft_model!r} has another tokenizer than the target model "
                         f"(vocabularies of {len(draft.get_vocab())} and {len(target.get_vocab())} tokens that "
                         "differ); a draft model must share the target's tokenizer")


class DraftShadow(Sequence):
    """The draft's view of one target sequence: the same token list, its own KV bookkeeping."""

    def __init__(self, target: Sequence):
        super().__init__([], None)
        self.token_ids = target.token_ids  # shared: the target's accepted tokens appear here as they come
        # The drafts whose KV the draft wrote after its last proposal, from num_computed_tokens on.
        self.drafted_kv: list[int] = []


class DraftModel:
    def __init__(self, config: EngineConfig, target_kvcache_blocks: int, target_vocab_size: int):
        """`config`: the draft's engine config; its KV cache takes what memory allows, up to the
        target's `target_kvcache_blocks` (the draft never holds more tokens than the target does,
        drafts aside; with fewer, some sequences go without drafts while the pool is short).
        `target_vocab_size`: the target's logits' width, which a draft's tokens stay within."""
        self.target_vocab_size = target_vocab_size
        self.max_model_len = config.max_model_len
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.runner = ModelRunner(config, max_kvcache_blocks=target_kvcache_blocks)
        self.vocab_size = config.hf_config.vocab_size
        self.block_manager = BlockManager(self.runner.num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching, self.runner.kv_sliding_window)
        self.shadows: dict[int, DraftShadow] = {}

    def propose(self, wanted: list[tuple[Sequence, int]], running: list[Sequence]) -> list[list[int]]:
        """Drafts of up to `room` tokens for each (sequence, room) in `wanted`; [] for a sequence
        the draft's context or KV cache has no room for. Shadows of sequences not `running` go."""
        self._retain(running)
        shadows, rooms, drafts = [], [], [[] for _ in wanted]
        for i, (seq, room) in enumerate(wanted):
            room = min(room, self.max_model_len - seq.num_tokens)
            shadow = self._shadow(seq)
            if room > 0 and self._allocate(shadow, room):
                shadows.append((i, shadow))
                rooms.append(room)
        if not shadows:
            return drafts
        grammars = [wanted[i][0].grammar for i, _ in shadows]
        self._catch_up([shadow for _, shadow in shadows], [drafts[i] for i, _ in shadows], grammars)
        # Each constrained sequence's grammar after its drafts so far (a copy: the sequence's own
        # moves with accepted tokens only), advanced a token a step; None once a draft left it
        # (past the grammar's end), which ends that sequence's drafting.
        states = [grammar.after(drafts[i]) if grammar is not None and grammar.valid_prefix(drafts[i]) else None
                  for (i, _), grammar in zip(shadows, grammars)]
        for step in range(1, max(rooms)):
            active = [k for k, room in enumerate(rooms)
                      if room > step and (grammars[k] is None or states[k] is not None)]
            if not active:
                break
            batch = ScheduledBatch([shadows[k][1] for k in active], [1] * len(active),
                                   [drafts[shadows[k][0]] for k in active])
            allowed = grammar_bitmask([states[k] for k in active], self.vocab_size)
            for k, token in zip(active, self.runner.greedy_next(batch, allowed)):
                i, shadow = shadows[k]
                shadow.num_computed_tokens += 1
                drafts[i].append(token)
                if states[k] is not None:
                    if states[k].valid_prefix([token]):
                        states[k].advance(token)
                    else:
                        states[k] = None
        for i, shadow in shadows:
            # KV at the drafts' positions counts once the target accepts the same tokens there.
            shadow.num_computed_tokens, shadow.drafted_kv = shadow.num_tokens, drafts[i][:-1]
            self.block_manager.cache_full_blocks(shadow)
        # The draft's vocabulary may be padded past the target's: such a token ends the draft.
        return [d[:next((j for j, t in enumerate(d) if t >= self.target_vocab_size), len(d))] for d in drafts]

    def finished(self, seq: Sequence) -> None:
        """`seq` ended: its shadow's blocks go back."""
        shadow = self.shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.block_manager.free(shadow)

    def _retain(self, running: list[Sequence]) -> None:
        if not self.shadows:
            return
        keep = {seq.seq_id for seq in running}
        for seq_id in [i for i in self.shadows if i not in keep]:
            self.block_manager.free(self.shadows.pop(seq_id))

    def _shadow(self, seq: Sequence) -> DraftShadow:
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = self.shadows[seq.seq_id] = DraftShadow(seq)
        elif shadow.drafted_kv:
            # The target's tokens that equal the draft's own drafts, where the draft wrote their KV;
            # the last token is always computed again (its row gives the first draft).
            start, accepted = shadow.num_computed_tokens, 0
            for token in shadow.drafted_kv:
                if start + accepted >= shadow.num_tokens - 1 or shadow.token_ids[start + accepted] != token:
                    break
                accepted += 1
            shadow.num_computed_tokens += accepted
            shadow.drafted_kv = []
        return shadow

    def _allocate(self, shadow: DraftShadow, room: int) -> bool:
        """Blocks for the shadow's context and the KV of `room` - 1 drafts (the last draft's KV is
        never written); a fresh shadow first takes the draft's prefix-cache hit."""
        cached = self.block_manager.find_cached_prefix(shadow) if not shadow.block_table else []
        uncached = shadow.num_tokens - shadow.num_computed_tokens - len(cached) * self.block_manager.block_size
        return self.block_manager.allocate(shadow, uncached + room - 1, cached)

    def _catch_up(self, shadows: list[DraftShadow], drafts: list[list[int]], grammars: list) -> None:
        """Compute each shadow's KV up to its sequence's last token, in steps of at most the token
        budget; the step that reaches a sequence's last token gives its first draft (within its
        grammar, if constrained)."""
        pending = list(zip(shadows, drafts, grammars))
        while pending:
            budget, batch, chunks = self.max_num_batched_tokens, [], []
            for shadow, draft, grammar in pending:
                n = min(shadow.num_tokens - shadow.num_computed_tokens, budget)
                if n == 0:
                    break
                batch.append((shadow, draft, grammar))
                chunks.append(n)
                budget -= n
            allowed = grammar_bitmask([grammar for *_, grammar in batch], self.vocab_size)
            tokens = self.runner.greedy_next(ScheduledBatch([shadow for shadow, *_ in batch], chunks), allowed)
            for (shadow, draft, _), n, token in zip(batch, chunks, tokens):
                shadow.num_computed_tokens += n
                if shadow.num_computed_tokens == shadow.num_tokens:
                    draft.append(token)
            pending = [entry for entry in pending if not entry[1]]
