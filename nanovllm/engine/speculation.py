"""Speculative decoding on the engine's side: before each step, drafts for the running
sequences that decode (the proposer's guesses of their next tokens); after it, what was
accepted (the metrics, and a back-off for sequences whose drafts keep failing).

Verification happens inside the step. A sequence's drafts are extra rows after its last token,
counted in the token budget like a prompt chunk; each row is sampled as a decode would be with
the drafts before it in the context (penalties, min_tokens, logit_bias alike), and the drafts are
accepted while each equals the token sampled at the row before it. The first row that differs
gives its sampled token in place of the draft, and a sequence whose drafts all hold gets the last
row's token on top. For a draft that is a single token (probability 1 where it was proposed),
accepting it when a sample of the target's distribution equals it is rejection sampling: it is
accepted with the target's probability of it, and otherwise the token comes from the target's
distribution without it. A constrained sequence's draft is cut at the first token its grammar
rejects, and each of its rows is masked by the grammar as it stands after the drafts before the
row. So the output is distributed exactly as without speculation, greedy output is the same
token for token, and a seeded sequence, whose random stream advances by the
tokens it emits only (model_runner), writes the same text with and without speculation. The KV
slots of rejected drafts are written but not counted as computed: the next step overwrites them,
blocks they alone filled go back to the pool (scheduler), and prefix-cache hashes, which cover
computed tokens only, never include them.

A request may ask for fewer drafted tokens than the engine's config gives, or none
(`SamplingParams.num_speculative_tokens`). Drafts come from a proposer over the sequence's
tokens (ngram, suffix) or from a draft model run for every drafting sequence at once
(engine/draft_model.py).

Drafts are skipped where they would cost more than they save: when more sequences decode than
`disable_by_batch_size` (the step's weights are already shared by many rows), and, after a step
in which none of a sequence's drafts held, for a number of its steps that doubles with each such
step in a row (up to MAX_DRAFT_PAUSE), so text the proposer cannot guess costs little more than
the proposer's search.
"""

from nanovllm.engine.draft_model import DraftModel
from nanovllm.engine.sequence import Sequence
from nanovllm.speculative.config import SpeculativeConfig
from nanovllm.speculative.ngram import NgramProposer
from nanovllm.speculative.suffix import SuffixProposer

MAX_DRAFT_PAUSE = 16


class TokenProposerDrafts:
    """Drafts from a proposer over each sequence's own tokens (ngram, suffix), with the interface
    a draft model has: propose for every drafting sequence of a step, hear of each that ended."""

    def __init__(self, proposer: NgramProposer | SuffixProposer):
        self.proposer = proposer

    def propose(self, wanted: list[tuple[Sequence, int]], running: list[Sequence]) -> list[list[int]]:
        return [self.proposer.propose(seq.token_ids, room) for seq, room in wanted]

    def finished(self, seq: Sequence) -> None:
        self.proposer.finish(seq.completion_token_ids)  # the proposer may learn from it (suffix decoding)


class Speculation:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft_model: DraftModel | None = None):
        """`draft_model`: for method "draft_model", the draft's runner; else the config's proposer drafts."""
        self.config = config
        self.max_model_len = max_model_len
        self.drafter = draft_model if draft_model is not None else TokenProposerDrafts(config.proposer())
        # vLLM's counters: drafts proposed (sequences that drafted in a step), drafted tokens,
        # accepted tokens, and accepted tokens by their place in the draft.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * config.num_speculative_tokens

    def propose(self, running: list[Sequence]) -> None:
        """Set every running sequence's drafts for the next step ([] where it drafts nothing)."""
        decoding = [seq for seq in running if seq.num_computed_tokens == seq.num_tokens - 1]
        speculate = len(decoding) <= self.config.disable_by_batch_size
        for seq in running:
            seq.draft_token_ids = []
        wanted = []  # (sequence, the most tokens it may draft)
        for seq in decoding if speculate else ():
            if seq.draft_pause:
                seq.draft_pause -= 1
                continue
            # Room for the drafts and the token after them, within max_tokens and the context.
            room = min(seq.stop_checker.max_tokens - seq.num_completion_tokens,
                       self.max_model_len - seq.num_tokens) - 1
            asked = seq.sampling_params.num_speculative_tokens
            room = min(room, self.config.num_speculative_tokens if asked is None else asked)
            if room > 0:
                wanted.append((seq, room))
        # A draft model also lets go here of sequences no longer running.
        for (seq, _), drafts in zip(wanted, self.drafter.propose(wanted, running)):
            # A constrained sequence's draft is cut at the first token its grammar rejects.
            seq.draft_token_ids = drafts[:seq.grammar.valid_prefix(drafts)] if seq.grammar is not None else drafts

    def record(self, seq: Sequence, num_drafted: int, num_emitted: int) -> None:
        """After a step in which `seq` drafted `num_drafted` tokens and emitted `num_emitted`."""
        if not num_drafted:
            return
        accepted = num_emitted - 1
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1
        if accepted:
            seq.draft_misses = 0
        else:
            seq.draft_misses += 1
            seq.draft_pause = min(2 ** (seq.draft_misses - 1), MAX_DRAFT_PAUSE)

    def finished(self, seq: Sequence) -> None:
        """A sequence ended: a proposer may learn from its output, a draft model frees its KV."""
        self.drafter.finished(seq)

    def metrics(self) -> dict:
        """vLLM's counters, and what its logs derive from them: the share of drafted tokens
        accepted, and the mean tokens a verifying step emits (accepted drafts and the token after)."""
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position),
                "spec_decode_acceptance_rate": self.num_accepted_tokens / max(self.num_draft_tokens, 1),
                "spec_decode_mean_acceptance_length": 1 + self.num_accepted_tokens / max(self.num_drafts, 1)}
