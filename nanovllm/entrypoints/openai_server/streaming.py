"""The bookkeeping both streamed endpoints share: per choice index, how much of its completion has
been sent and whether its finish chunk has gone, so that each engine output turns into at most
one delta chunk and one finish chunk for each choice; and the usage each chunk carries. The
chunks' shapes are the endpoints' own."""

import dataclasses

from nanovllm.outputs import CompletionOutput, PositionLogprobs, RequestOutput


@dataclasses.dataclass(frozen=True)
class ChoiceStep:
    """What one engine output adds to one streamed choice."""

    opens: bool  # the first output this choice appears in
    text: str  # the text not sent yet
    token_ids: list[int]  # the tokens not sent yet
    logprobs: list[PositionLogprobs] | None  # their logprobs, if the client asked for them
    text_offset: int  # characters of the completion sent before `text`
    sends_delta: bool  # new text, or new tokens whose logprobs the client asked for
    finishes: bool  # the finish chunk is due


class StreamedChoices:
    """The progress of every choice of one streamed response, by choice index."""

    def __init__(self, with_logprobs: bool):
        self.with_logprobs = with_logprobs
        self._sent_text: dict[int, int] = {}  # characters of the completion sent so far
        self._sent_tokens: dict[int, int] = {}
        self._finished: set[int] = set()

    def advance(self, index: int, completion: CompletionOutput) -> ChoiceStep | None:
        """The step `completion` (the choice's whole completion so far) makes; None after the step
        that finished the choice. What a step holds counts as sent once it is returned."""
        if index in self._finished:
            return None
        opens = index not in self._sent_text
        sent_text = self._sent_text.setdefault(index, 0)
        sent_tokens = self._sent_tokens.setdefault(index, 0)
        text, token_ids = completion.text[sent_text:], completion.token_ids[sent_tokens:]
        logprobs = completion.logprobs[sent_tokens:] if self.with_logprobs else None
        sends_delta = bool(text or (token_ids and self.with_logprobs))
        if sends_delta:
            self._sent_text[index] += len(text)
            self._sent_tokens[index] = len(completion.token_ids)
        finishes = completion.finish_reason is not None
        if finishes:
            self._finished.add(index)
        return ChoiceStep(opens, text, token_ids, logprobs, sent_text, sends_delta, finishes)


class StreamedUsage:
    """The `usage` of a streamed response's chunks: null on each (OpenAI's include_usage, whose
    totals come in a last chunk of their own), or with vLLM's continuous_usage_stats the counts
    so far on every chunk."""

    def __init__(self, body, prompt_tokens: int):
        """`body`: a request with include_usage / include_continuous_usage; `prompt_tokens`: the
        prompt's length where it is known before the first output."""
        self.body = body
        self._prompts: dict[str, int] = {}  # by request id: a completions request has several
        self._completions: dict[str, int] = {}
        self._initial_prompt_tokens = prompt_tokens

    def advance(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self._prompts[output.request_id] = len(output.prompt_token_ids)
            self._completions[output.request_id] = sum(len(c.token_ids) for c in output.outputs)

    def on_chunk(self) -> dict:
        """The chunk's extra fields."""
        if not self.body.include_usage:
            return {}
        if not self.body.include_continuous_usage:
            return {"usage": None}
        prompt = sum(self._prompts.values()) if self._prompts else self._initial_prompt_tokens
        completion = sum(self._completions.values())
        return {"usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}}
