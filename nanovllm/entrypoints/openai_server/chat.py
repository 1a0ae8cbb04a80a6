"""POST /v1/chat/completions: the messages (and tools) through the model's chat template into one
engine request, its n choices whole or streamed (role first, then content and tool-call deltas),
with chat logprobs."""

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import NamedTuple

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from nanovllm.engine.async_engine import RequestStream
from nanovllm.entrypoints.openai_server.serving import (Serving, collect_unless_disconnected, finite_logprob,
                                                        raise_if_failed, sampling_params, sse_response,
                                                        token_usage)
from nanovllm.entrypoints.openai_server.streaming import StreamedChoices, StreamedUsage
from nanovllm.entrypoints.openai_server.tools import ToolCalling
from nanovllm.entrypoints.protocol import ChatCompletionRequest
from nanovllm.outputs import CompletionOutput, PositionLogprobs


async def create_chat_completion(serving: Serving, body: ChatCompletionRequest, request: Request) -> Response:
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    stream, builder, prompt_tokens = await start_chat(serving, body, response_id)
    if body.stream:
        return sse_response(stream, builder.stream_chunks(stream, response_id, prompt_tokens))
    finals = await collect_unless_disconnected(stream, request)
    if finals is None:
        return Response(status_code=499)
    output = finals[f"{response_id}-0"]
    raise_if_failed(output)
    return JSONResponse({"id": response_id, "object": "chat.completion", "created": int(time.time()),
                         "model": serving.model_name,
                         "choices": [builder.whole_choice(c) for c in output.outputs],
                         "usage": token_usage([output])})


class ChatGeneration(NamedTuple):
    """A chat request queued on the engine, and what its choices are built with."""

    stream: RequestStream
    choices: "ChatChoices"
    prompt_tokens: int


async def start_chat(serving: Serving, body: ChatCompletionRequest, response_id: str) -> ChatGeneration:
    """The generation path up to the engine, which /v1/responses shares: the checks, the sampling
    settings, tool_choice's constraint, the chat template, and the queued request."""
    serving.check_model(body.model)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, max_tokens, top_logprobs)
    tools = ToolCalling(body, serving.tool_parser)
    constraint_field = body.constraint_field
    forced_call = tools.constraint()  # required, or a named function
    if forced_call is not None:
        params = dataclasses.replace(params, structured_outputs=forced_call)
        constraint_field = "tools"
    elif tools.active and tools.parser.needs_special_tokens:  # the format's markers are special tokens
        params = dataclasses.replace(params, skip_special_tokens=False)
    prompt = serving.apply_chat_template(body, tools)
    stream = await serving.submit(response_id, [prompt], params, constraint_field)
    return ChatGeneration(stream, ChatChoices(serving, body, tools), len(prompt["prompt_token_ids"]))


class ChatChoices:
    """Choices of one /v1/chat/completions response: index = completion index."""

    def __init__(self, serving: Serving, body: ChatCompletionRequest, tools: ToolCalling):
        self.serving = serving
        self.body = body
        self.tools = tools

    def whole_choice(self, completion: CompletionOutput) -> dict:
        message = self.tools.message(completion.text, cut=ended_early(completion))
        return {"index": completion.index, "message": message,
                "logprobs": self._logprobs(completion.token_ids, completion.logprobs) if self.body.logprobs else None,
                "finish_reason": _finish_reason(completion, bool(message.get("tool_calls"))),
                "stop_reason": completion.stop_reason}

    async def stream_chunks(self, stream: RequestStream, response_id: str, prompt_tokens: int) -> AsyncIterator[dict]:
        body = self.body
        usage = StreamedUsage(body, prompt_tokens)

        def chunk(choice: dict) -> dict:
            return self.serving.chunk(response_id, "chat.completion.chunk", [choice], **usage.on_chunk())

        # OpenAI opens every choice with the role, before any content.
        for index in range(body.n):
            yield chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None})
        choices = StreamedChoices(with_logprobs=bool(body.logprobs))
        tool_streams = {index: self.tools.stream() for index in range(body.n)} if self.tools.active else None
        final = None
        async for output in stream:
            usage.advance([output])
            raise_if_failed(output)
            for completion in output.outputs:
                index = completion.index
                step = choices.advance(index, completion)
                if step is None:
                    continue
                if tool_streams is not None:
                    content, calls = tool_streams[index].advance(completion.text, step.finishes,
                                                                  ended_early(completion))
                    if content:
                        yield chunk({"index": index, "delta": {"content": content}, "logprobs": None,
                                     "finish_reason": None})
                    if calls:
                        yield chunk({"index": index, "delta": {"tool_calls": calls}, "logprobs": None,
                                     "finish_reason": None})
                elif step.sends_delta:
                    logprobs = self._logprobs(step.token_ids, step.logprobs) if body.logprobs else None
                    yield chunk({"index": index, "delta": {"content": step.text}, "logprobs": logprobs,
                                 "finish_reason": None})
                if step.finishes:
                    called = tool_streams is not None and bool(tool_streams[index].ids)
                    yield chunk({"index": index, "delta": {}, "logprobs": None,
                                 "finish_reason": _finish_reason(completion, called),
                                 "stop_reason": completion.stop_reason})
            final = output
        if body.include_usage:
            yield self.serving.chunk(response_id, "chat.completion.chunk", [], usage=token_usage([final]))

    def _logprobs(self, token_ids: list[int], positions: list[PositionLogprobs]) -> dict:
        top_n = self.body.top_logprobs or 0
        content = []
        for token_id, position in zip(token_ids, positions):
            # The engine's dict lists the top-N by rank, then the chosen token if it is not among them.
            top = [_chat_logprob(entry.decoded_token, entry.logprob) for entry in list(position.values())[:top_n]]
            chosen = position[token_id]
            content.append({**_chat_logprob(chosen.decoded_token, chosen.logprob), "top_logprobs": top})
        return {"content": content}


def ended_early(completion: CompletionOutput) -> bool:
    """Whether a reply was cut before the model ended it: by max_tokens, or by one of the request's
    stop strings or stop token ids (EOS leaves stop_reason None); a call it was writing may be partial."""
    return completion.finish_reason == "length" or completion.stop_reason is not None


def _finish_reason(completion: CompletionOutput, called_tools: bool) -> str | None:
    """OpenAI's "tool_calls" for a reply that ended by calling tools (not cut off by length)."""
    return "tool_calls" if called_tools and completion.finish_reason == "stop" else completion.finish_reason


def _chat_logprob(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": finite_logprob(logprob), "bytes": list(token.encode("utf-8"))}
