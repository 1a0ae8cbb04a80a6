"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the chat pipeline.

A request, translated into a chat request (entrypoints/anthropic_protocol.py), takes chat's one
generation path (`start_chat`: the chat template, tools and their constraints, the engine), and
its choice comes back as an Anthropic message of text and tool_use blocks: whole, or as
Anthropic's server-sent events (message_start, ping, then per block content_block_start,
content_block_delta (text_delta or input_json_delta) and content_block_stop, then
message_delta with the stop reason and the output tokens, and message_stop), which the chat
choice's own stream chunks are translated into. An error after the status line went out is an
`error` event."""

import json
import re
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanovllm.engine.async_engine import EngineDeadError, RequestStream
from nanovllm.entrypoints.anthropic_protocol import CountTokensRequest, MessagesRequest, anthropic_error_body
from nanovllm.entrypoints.openai_server.chat import ChatGeneration, start_chat
from nanovllm.entrypoints.openai_server.serving import Serving, collect_unless_disconnected, raise_if_failed
from nanovllm.entrypoints.openai_server.tools import ToolCalling
from nanovllm.entrypoints.protocol import APIError

Event = tuple[str, dict]  # an SSE event's name and data
# Fields the chat request names otherwise: errors about them name the field the client sent.
_NAMES_SENT = {"response_format.json_schema.schema": "output_config.format.schema", "stop": "stop_sequences"}


async def create_message(serving: Serving, body: MessagesRequest, request: Request) -> Response:
    message_id = f"msg_{uuid.uuid4().hex}"
    try:
        generation = await start_chat(serving, body.chat_request(), message_id)
    except APIError as e:
        raise _named_as_sent(e) from None
    if body.stream:
        return _sse_response(generation.stream, _stream_events(generation, message_id, serving.model_name))
    finals = await collect_unless_disconnected(generation.stream, request)
    if finals is None:
        return Response(status_code=499)
    output = finals[f"{message_id}-0"]
    raise_if_failed(output)
    [completion] = output.outputs
    choice = generation.choices.whole_choice(completion)
    message = choice["message"]
    content = [{"type": "text", "text": message["content"]}] if message["content"] else []
    # A call's arguments are a whole JSON object: a call cut short (max_tokens, a stop sequence) is not returned.
    content += [_tool_use_block(call["id"], call["function"]["name"], json.loads(call["function"]["arguments"]))
                for call in message.get("tool_calls", [])]
    usage = {"input_tokens": len(output.prompt_token_ids), "output_tokens": len(completion.token_ids)}
    return JSONResponse(_message(message_id, serving.model_name, content, *_stop(choice), usage))


def _named_as_sent(error: APIError) -> APIError:
    """`error` with the chat request's name for a field, which starts its message, replaced by
    the name this request gave it ("stop[1] must be ..." -> "stop_sequences[1] must be ...")."""
    for chat_name, name in _NAMES_SENT.items():
        if re.match(rf"{re.escape(chat_name)}[\[. ]", error.message):
            return APIError(error.status, name + error.message[len(chat_name):], error.type)
    return error


def count_message_tokens(serving: Serving, body: CountTokensRequest) -> dict:
    """The prompt's length as the model would read it: the chat template with the tools."""
    chat = body.chat_request()
    serving.check_model(chat.model)
    prompt = serving.apply_chat_template(chat, ToolCalling(chat, serving.tool_parser))
    return {"input_tokens": len(prompt["prompt_token_ids"])}


def _message(message_id: str, model: str, content: list[dict], stop_reason: str | None, stop_sequence: str | None,
             usage: dict) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}


def _tool_use_block(call_id: str, name: str, tool_input: dict) -> dict:
    # Anthropic's ids start with toolu_; the chat pipeline's call ids (call_...) keep their suffix.
    return {"type": "tool_use", "id": f"toolu_{call_id.removeprefix('call_')}", "name": name, "input": tool_input}


def _stop(choice: dict) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat choice's finish."""
    if choice["finish_reason"] == "abort":
        raise APIError(503, "The server aborted this request: it is shutting down.", type="server_error")
    if choice["finish_reason"] == "tool_calls":
        return "tool_use", None
    if choice["finish_reason"] == "length":
        return "max_tokens", None
    if isinstance(choice["stop_reason"], str):  # one of stop_sequences (a token id would be an int)
        return "stop_sequence", choice["stop_reason"]
    return "end_turn", None


class _Blocks:
    """The content blocks of one streamed message: which is open, and the events that open,
    fill and close them. Blocks are numbered in order; one is open at a time."""

    def __init__(self):
        self.started = 0
        self.open_type: str | None = None

    def text(self, text: str) -> list[Event]:
        events = [] if self.open_type == "text" else self._start({"type": "text", "text": ""})
        return events + [self._delta({"type": "text_delta", "text": text})]

    def tool_call(self, call: dict) -> list[Event]:
        """A chat tool-call delta: a new call carries its id and name, then arguments follow."""
        events = []
        if "id" in call:
            events = self._start(_tool_use_block(call["id"], call["function"]["name"], {}))
        if call["function"].get("arguments"):
            events.append(self._delta({"type": "input_json_delta", "partial_json": call["function"]["arguments"]}))
        return events

    def close(self) -> list[Event]:
        if self.open_type is None:
            return []
        self.open_type = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.started - 1})]

    def _start(self, block: dict) -> list[Event]:
        events = self.close()
        self.open_type = block["type"]
        self.started += 1
        return events + [("content_block_start", {"type": "content_block_start", "index": self.started - 1,
                                                  "content_block": block})]

    def _delta(self, delta: dict) -> Event:
        return "content_block_delta", {"type": "content_block_delta", "index": self.started - 1, "delta": delta}


async def _stream_events(generation: ChatGeneration, message_id: str, model: str) -> AsyncIterator[Event]:
    usage = {"input_tokens": generation.prompt_tokens, "output_tokens": 0}
    yield "message_start", {"type": "message_start", "message": _message(message_id, model, [], None, None, usage)}
    yield "ping", {"type": "ping"}
    blocks = _Blocks()
    stop_reason = stop_sequence = None
    # The chat request asked for usage: its chunk, after the finish, comes last.
    async for chunk in generation.choices.stream_chunks(generation.stream, message_id, generation.prompt_tokens):
        if not chunk["choices"]:
            yield "message_delta", {"type": "message_delta",
                                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                    "usage": {"output_tokens": chunk["usage"]["completion_tokens"]}}
            yield "message_stop", {"type": "message_stop"}
            continue
        choice = chunk["choices"][0]
        events = blocks.text(choice["delta"]["content"]) if choice["delta"].get("content") else []
        for call in choice["delta"].get("tool_calls", []):
            events += blocks.tool_call(call)
        if choice["finish_reason"] is not None:
            events += blocks.close()
            stop_reason, stop_sequence = _stop(choice)
        for event in events:
            yield event


def _sse_response(stream: RequestStream, events: AsyncIterator[Event]) -> StreamingResponse:
    """Server-sent events as Anthropic sends them: an `event:` line naming each `data:` line."""

    def sse(name: str, data: dict) -> str:
        return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    async def body() -> AsyncIterator[str]:
        try:
            async for name, data in events:
                yield sse(name, data)
        except EngineDeadError as e:  # the status line is long gone: the error travels as an event
            yield sse("error", anthropic_error_body(APIError(503, str(e), type="server_error")))
        except APIError as e:
            yield sse("error", anthropic_error_body(e))
        finally:
            # Runs also when the client disconnects (Starlette cancels this generator).
            stream.abort()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
