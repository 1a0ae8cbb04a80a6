"""Turns the logits of sampled positions into tokens, applying each row's sampling settings
in one vectorised pass (no per-request loop over the vocabulary).

Order, as in vLLM: logprobs of the raw logits; penalties (repetition on prompt and output
tokens, presence and frequency on output tokens) and each row's logit_bias; masking of each
row's banned ids (what its stop checker holds back until min_tokens) and of what its grammar
does not allow (a bitmask over the batch, engine/structured_output.py); greedy rows take the
argmax; the others are scaled by temperature, filtered by min-p, top-k and top-p, and drawn
by inverse transform sampling:
one uniform number per row, looked up in the row's cumulative probabilities (the Gumbel-max
trick would need a random number per vocabulary entry, many times slower on CPU).
Rows with no top-k, top-p or min-p filter, and the grammar's mask, go through the platform's
sampling ops (layers/sampling_ops.py; on CPU compiled kernels that need no [rows, vocab]
temporaries), given when the sampler is built. Seeded rows draw from their own generator, so their
tokens do not depend on the batch.

Everything but the logits is built on the host and copied without waiting (transfer.py); the
sampled ids are the step's one copy back, so a GPU step syncs once.

The sampler sees rows, not sequences: the model runner hands it each row's settings and
tokens. Logprobs leave it as `TokenLogprobs`, the record the engine turns into the public
`PositionLogprobs` (prompt spans, computed by the runner, as `PromptLogprobs`).
"""

from dataclasses import dataclass, field

import torch
from torch import nn

from nanovllm.engine.transfer import to_device
from nanovllm.layers.sampling_ops import SamplingOps, draw_by_inverse_transform
from nanovllm.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling tensors for the rows that sample this step."""

    temperatures: torch.Tensor  # [n] fp32, 0 = greedy
    all_greedy: bool  # known on the host, so deciding the path reads nothing back from the device
    any_greedy: bool
    top_k: torch.Tensor | None  # [n] int64, vocab size = off
    top_p: torch.Tensor | None  # [n] fp32
    min_p: torch.Tensor | None  # [n] fp32
    repetition_penalty: torch.Tensor | None  # [n] fp32
    presence_penalty: torch.Tensor | None
    frequency_penalty: torch.Tensor | None
    prompt_mask: torch.Tensor | None  # [n, vocab] bool: token occurs in the prompt
    output_counts: torch.Tensor | None  # [n, vocab] fp32: occurrences in the output
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, ids) that must not be drawn
    generators: list[torch.Generator | None]
    num_logprobs: list[int | None]
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, ids, biases)
    allowed: torch.Tensor | None = None  # [n, ceil(vocab / 32)] int32 bitmask of the grammars' tokens

    @classmethod
    def build(cls, params: list[SamplingParams], token_ids: list[list[int]], num_prompt_tokens: list[int],
              banned_token_ids: list[list[int]], generators: list[torch.Generator | None], vocab_size: int,
              device, allowed: torch.Tensor | None = None) -> "SamplingBatch":
        """One entry per row in each list: its settings, all its tokens (the first num_prompt_tokens
        are the prompt), the ids it must not draw, and its own random stream if seeded; `allowed`
        is the bitmask of the constrained rows' grammars (grammar_bitmask), if any."""

        def column(name, dtype, default):
            values = [getattr(p, name) for p in params]
            if all(v == default for v in values):
                return None
            return to_device(values, dtype, device)

        top_k = column("top_k", torch.long, 0)
        if top_k is not None:
            top_k = torch.where(top_k > 0, top_k, vocab_size)
        repetition = column("repetition_penalty", torch.float32, 1.0)
        presence = column("presence_penalty", torch.float32, 0.0)
        frequency = column("frequency_penalty", torch.float32, 0.0)
        prompt_mask = output_counts = None
        if repetition is not None:
            prompts = [tokens[:n] for tokens, n in zip(token_ids, num_prompt_tokens)]
            prompt_mask = _token_counts(prompts, vocab_size, device) > 0
        if repetition is not None or presence is not None or frequency is not None:
            outputs = [tokens[n:] for tokens, n in zip(token_ids, num_prompt_tokens)]
            output_counts = _token_counts(outputs, vocab_size, device)
        logit_bias = None
        if any(p.logit_bias for p in params):
            entries = [(row, token, bias) for row, p in enumerate(params)
                       for token, bias in (p.logit_bias or {}).items()]
            rows, ids, biases = zip(*entries)
            logit_bias = (to_device(rows, torch.long, device), to_device(ids, torch.long, device),
                          to_device(biases, torch.float32, device))
        banned = None
        if any(banned_token_ids):
            rows = [row for row, ids in enumerate(banned_token_ids) for _ in ids]
            banned = (to_device(rows, torch.long, device),
                      to_device([t for ids in banned_token_ids for t in ids], torch.long, device))
        temperatures = [p.temperature for p in params]
        return cls(
            temperatures=to_device(temperatures, torch.float32, device),
            all_greedy=all(t == 0 for t in temperatures), any_greedy=any(t == 0 for t in temperatures),
            top_k=top_k, top_p=column("top_p", torch.float32, 1.0), min_p=column("min_p", torch.float32, 0.0),
            repetition_penalty=repetition, presence_penalty=presence, frequency_penalty=frequency,
            prompt_mask=prompt_mask, output_counts=output_counts,
            banned=banned, generators=generators, num_logprobs=[p.logprobs for p in params],
            logit_bias=logit_bias, allowed=None if allowed is None else to_device(allowed, torch.int32, device),
        )


def _token_counts(token_lists: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    counts = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.float32, device=device)
    width = max(map(len, token_lists), default=0)
    if width:
        # Pad with an extra column id (vocab_size) that is dropped afterwards.
        ids = torch.full((len(token_lists), width), vocab_size, dtype=torch.long)
        for row, tokens in enumerate(token_lists):
            ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        counts.scatter_add_(1, to_device(ids, torch.long, device), torch.ones(ids.shape, device=device))
    return counts[:, :vocab_size]


@dataclass
class TokenLogprobs:
    """One position's logprobs: the chosen (sampled or prompt) token's, and the top-N."""

    chosen_logprob: float
    rank: int  # of the chosen token; 1 = the most likely
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class PromptLogprobs:
    """Logprobs of the prompt positions one step computed for one sequence."""

    batch_index: int  # the sequence's index in the step's batch
    first_position: int  # logprobs[i] is of the prompt token at first_position + i
    logprobs: list[TokenLogprobs]


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per sampling row (from the model runner: per sampling sequence, its tokens)
    logprobs: list[TokenLogprobs | None]  # per token; None where the row asked for none
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    num_tokens: list[int] | None = None  # tokens per sampling sequence, where drafts were verified


def token_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, nums: list[int]) -> list[TokenLogprobs]:
    """For each row of `logprobs`: the chosen token's logprob and rank, and the row's
    `nums[row]` most likely tokens."""
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen_lp.unsqueeze(1)).sum(1) + 1
    most = max(nums, default=0)
    if most:
        top = logprobs.topk(most, dim=-1)
        top_ids, top_lps = top.indices.tolist(), top.values.tolist()
    else:
        top_ids = top_lps = [[]] * len(nums)
    return [TokenLogprobs(lp, rank, list(zip(ids[:num], lps[:num])))
            for lp, rank, ids, lps, num in zip(chosen_lp.tolist(), ranks.tolist(), top_ids, top_lps, nums)]


class Sampler(nn.Module):
    def __init__(self, ops: SamplingOps | None = None):
        """`ops`: the platform's sampling ops (Platform.sampling_ops); the portable ones by default."""
        super().__init__()
        self.ops = ops or SamplingOps()

    def forward(self, logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator) -> SamplerOutput:
        """logits: [n, vocab] raw model output; `generator` serves rows without their own seed."""
        logits = logits.float()
        wants_logprobs = any(n is not None for n in batch.num_logprobs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if wants_logprobs else None
        logits = self._penalize(logits, batch)
        if batch.logit_bias is not None:
            logits.index_put_(batch.logit_bias[:2], batch.logit_bias[2], accumulate=True)
        if batch.banned is not None:
            logits.index_put_(batch.banned, torch.full((), float("-inf"), device=logits.device))
        if batch.allowed is not None:
            self.ops.mask_disallowed(logits, batch.allowed)
        if batch.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._draw(logits, batch, generator)
            if batch.any_greedy:
                tokens = torch.where(batch.temperatures == 0, logits.argmax(dim=-1), tokens)
        token_ids = tokens.tolist()
        vocab_size = logits.shape[1]
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
            # NaN logits: fail this step rather than the next one that would embed the id.
            outside = [row for row, t in enumerate(token_ids) if not 0 <= t < vocab_size]
            raise RuntimeError(f"sampling rows {outside} drew no token of the vocabulary (NaN logits?)")
        if not wants_logprobs:
            return SamplerOutput(token_ids, [None] * len(token_ids))
        entries = token_logprobs(raw_logprobs, tokens, [num or 0 for num in batch.num_logprobs])
        return SamplerOutput(token_ids, [entry if num is not None else None
                                         for entry, num in zip(entries, batch.num_logprobs)])

    @staticmethod
    def _penalize(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.repetition_penalty is not None:
            seen = batch.prompt_mask | (batch.output_counts > 0)
            penalty = batch.repetition_penalty.unsqueeze(1)
            penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, penalized, logits)
        if batch.frequency_penalty is not None:
            logits = logits - batch.frequency_penalty.unsqueeze(1) * batch.output_counts
        if batch.presence_penalty is not None:
            logits = logits - batch.presence_penalty.unsqueeze(1) * (batch.output_counts > 0)
        return logits

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator) -> torch.Tensor:
        # Unseeded rows draw from the engine's stream on the device; seeded rows from their own
        # (host) streams, copied over in one go.
        uniform = torch.rand(len(logits), generator=generator, device=logits.device)
        seeded = [row for row, g in enumerate(batch.generators) if g is not None]
        if seeded:
            values = torch.cat([torch.rand(1, generator=batch.generators[row]) for row in seeded])
            uniform.index_copy_(0, to_device(seeded, torch.long, logits.device),
                                to_device(values, torch.float32, logits.device))
        temperatures = batch.temperatures.clamp(min=1e-5)
        if batch.min_p is None and batch.top_k is None and batch.top_p is None:
            return self.ops.draw_unfiltered(logits, temperatures, uniform)
        logits = logits / temperatures.unsqueeze(1)
        if batch.min_p is not None:
            probs = torch.softmax(logits, dim=-1)
            threshold = batch.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if batch.top_k is not None or batch.top_p is not None:
            logits = _top_k_top_p(logits, batch.top_k, batch.top_p)
        return draw_by_inverse_transform(logits, uniform)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep each row's top_k tokens, then the smallest set of those whose mass reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device)
    if top_k is not None:
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # The most likely token always stays, so a row never ends up empty.
        drop = (mass_before >= top_p.unsqueeze(1)) & (ranks > 0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
