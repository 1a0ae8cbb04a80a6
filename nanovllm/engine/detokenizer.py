"""Incremental detokenization of one sequence, with stop-string detection.

Text grows through the tokenizer's own streaming decoder (`tokenizers.decoders.DecodeStream`),
which emits nothing until a multi-byte character is complete, so no broken UTF-8 ever
reaches a caller. Stop strings are searched only in the tail that new text could complete,
and while a sequence runs, the last (longest stop - 1) characters are held back, since they
might turn out to be the start of a stop string.
"""

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

from nanovllm.sampling_params import SamplingParams

# Prompt tokens the decoder is primed with, so the first generated token renders as it would
# mid-text (e.g. its leading space).
PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], params: SamplingParams):
        self.backend = tokenizer.backend_tokenizer
        self.stream = DecodeStream(ids=prompt_token_ids[-PROMPT_CONTEXT_TOKENS:],
                                   skip_special_tokens=params.skip_special_tokens)
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.holdback = max(map(len, self.stop)) - 1 if self.stop and not self.include_stop else 0
        self.text = ""

    def add_token(self, token_id: int, check_stop: bool) -> str | None:
        """Append one token's text; returns the stop string it completed, if any (the text is
        then cut before it, or after it with include_stop_str_in_output)."""
        chunk = self.stream.step(self.backend, token_id)
        if not chunk:
            return None
        start = len(self.text)
        self.text += chunk
        if not check_stop:
            return None
        hits = [(at, stop) for stop in self.stop
                if (at := self.text.find(stop, max(0, start - len(stop) + 1))) != -1]
        if not hits:
            return None
        at, stop = min(hits)  # the earliest stop string in the text wins
        self.text = self.text[:at + (len(stop) if self.include_stop else 0)]
        return stop

    def output_text(self, finished: bool) -> str:
        if finished or not self.holdback:
            return self.text
        return self.text[:max(0, len(self.text) - self.holdback)]
