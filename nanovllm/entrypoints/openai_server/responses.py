"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API on the chat
pipeline. A request, after the stored conversation its previous_response_id names, becomes a
ChatCompletionRequest (instructions a system message, function calls an assistant's tool_calls,
their outputs tool messages, text.format a response_format) and runs through chat's own
generation path (`start_chat`, `ChatChoices`); its chat message, or its chat chunks, come back
as a response object or as the Responses stream's numbered events. `ResponseStore` keeps the
stored responses."""

import copy
import json
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import TypeAdapter

from nanovllm.engine.async_engine import EngineDeadError, RequestStream
from nanovllm.entrypoints.openai_server.chat import start_chat
from nanovllm.entrypoints.openai_server.serving import (Serving, collect_unless_disconnected, raise_if_failed,
                                                        token_usage)
from nanovllm.entrypoints.protocol import APIError, ChatCompletionRequest, parse_request
from nanovllm.entrypoints.responses_protocol import (FunctionCallItem, FunctionCallOutputItem, FunctionToolChoice,
                                                     InputItem, MessageItem, ResponsesRequest)

DEFAULT_STORED_RESPONSES = 1024
_ITEMS = TypeAdapter(list[InputItem])
# The chat request's fields as a Responses client knows them, for the errors the chat path raises.
_RESPONSES_FIELDS = {"messages": "input", "prompt": "input", "max_tokens": "max_output_tokens",
                     "response_format": "text.format", "response_format.json_schema.schema": "text.format.schema"}


class ResponseStore:
    """The stored responses by id, the oldest evicted first beyond `capacity`: each one's response
    object (what GET returns) and its conversation (the input items of its whole chain, then its
    output items), which a request naming it as previous_response_id continues."""

    def __init__(self, capacity: int = DEFAULT_STORED_RESPONSES):
        self.capacity = capacity
        self._entries: OrderedDict[str, tuple[dict, list]] = OrderedDict()

    def put(self, response: dict, conversation: list) -> None:
        self._entries[response["id"]] = (response, conversation)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def response(self, response_id: str) -> dict:
        return self._entry(response_id, f"Response with id '{response_id}' not found.", None)[0]

    def conversation(self, response_id: str) -> list:
        return self._entry(response_id, f"Previous response with id '{response_id}' not found.",
                           "previous_response_id")[1]

    def delete(self, response_id: str) -> dict:
        self.response(response_id)  # 404 if unknown
        del self._entries[response_id]
        return {"id": response_id, "object": "response", "deleted": True}

    def _entry(self, response_id: str, message: str, param: str | None) -> tuple[dict, list]:
        entry = self._entries.get(response_id)
        if entry is None:
            raise APIError(404, message, param=param, code="response_not_found")
        return entry


async def create_response(serving: Serving, store: ResponseStore, body: ResponsesRequest,
                          request: Request) -> Response:
    serving.check_model(body.model)
    history = store.conversation(body.previous_response_id) if body.previous_response_id is not None else []
    conversation = history + body.items()
    response_id = f"resp_{uuid.uuid4().hex}"
    shell = ResponseShell(serving.model_name, body, response_id)
    try:
        stream, choices, prompt_tokens = await start_chat(serving, chat_request(body, conversation), response_id)
    except APIError as e:
        raise _in_responses_terms(e) from None
    if body.stream:
        events = ResponseEvents(shell, store if body.store else None, conversation)
        return _event_stream(stream, events.events(choices.stream_chunks(stream, response_id, prompt_tokens)))
    finals = await collect_unless_disconnected(stream, request)
    if finals is None:
        return Response(status_code=499)
    output = finals[f"{response_id}-0"]
    raise_if_failed(output)
    completion = output.outputs[0]
    status = "completed" if completion.finish_reason == "stop" else "incomplete"
    response = shell.response(status, output_items(choices.whole_choice(completion)["message"], status),
                              token_usage([output]), completion.finish_reason)
    if body.store:
        store.put(response, conversation + _ITEMS.validate_python(response["output"]))
    return JSONResponse(response)


def chat_request(body: ResponsesRequest, conversation: list) -> ChatCompletionRequest:
    """The chat request that generates `body`'s response after `conversation` (items)."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    for item in conversation:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": [{"type": "text", "text": text}
                                                            for text in item.text_parts()]})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":  # the same turn: its text, then its calls
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    chat = {"messages": messages, "max_tokens": body.max_output_tokens, "temperature": body.temperature,
            "top_p": body.top_p, "parallel_tool_calls": body.parallel_tool_calls, "stream": body.stream,
            "stream_options": {"include_usage": True} if body.stream else None}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": tool.model_dump(
            include={"name", "description", "parameters", "strict"}, exclude_none=True)} for tool in body.tools]
    if isinstance(body.tool_choice, FunctionToolChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    else:
        chat["tool_choice"] = body.tool_choice
    # text.format governs the text of messages; a forced call writes none (the Agents SDK sends both).
    text_format = body.text.format if body.text is not None and not body.forces_a_call else None
    if text_format is not None and text_format.type == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": text_format.model_dump(
            include={"name", "description", "json_schema", "strict"}, exclude_none=True, by_alias=True)}
    elif text_format is not None:
        chat["response_format"] = {"type": text_format.type}
    try:
        return parse_request(ChatCompletionRequest, chat, "/v1/responses")
    except APIError as e:
        raise _in_responses_terms(e) from None


def _in_responses_terms(error: APIError) -> APIError:
    """A chat-path error naming the Responses field instead of the chat field it was raised about."""
    param = error.param
    if param is None:
        return error
    # A chat message's index ("messages[2].content") is no input item's: the field alone is named.
    field = re.match(r"\w*", param).group()
    renamed = _RESPONSES_FIELDS.get(param) or _RESPONSES_FIELDS.get(field, param)
    if renamed == param:
        return error
    return APIError(error.status, error.message.replace(param, renamed), error.type, renamed, error.code)


class ResponseShell:
    """One response's object around its output: its id, status and usage, and the request's
    settings echoed as OpenAI echoes them."""

    def __init__(self, model_name: str, body: ResponsesRequest, response_id: str):
        self.model_name = model_name
        self.body = body
        self.id = response_id
        self.created_at = int(time.time())

    def response(self, status: str, output: list[dict], usage: dict | None = None,
                 finish_reason: str | None = None) -> dict:
        """`usage`: the chat path's token counts; `finish_reason`: the engine's, for an incomplete one."""
        body = self.body
        text_format = body.text.format if body.text is not None else None
        incomplete = {"reason": "max_output_tokens" if finish_reason == "length" else None}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": None, "incomplete_details": incomplete if status == "incomplete" else None,
            "model": self.model_name, "output": output,
            "usage": _responses_usage(usage) if usage is not None else None,
            "instructions": body.instructions, "previous_response_id": body.previous_response_id,
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "tool_choice": (body.tool_choice.model_dump() if isinstance(body.tool_choice, FunctionToolChoice)
                            else body.tool_choice or "auto"),
            "parallel_tool_calls": body.parallel_tool_calls, "temperature": body.temperature, "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens,
            "text": {"format": text_format.model_dump(exclude_none=True, by_alias=True)
                     if text_format is not None else {"type": "text"}},
            "store": body.store, "metadata": body.metadata or {}, "user": body.user, "truncation": "disabled",
        }


def _responses_usage(usage: dict) -> dict:
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def output_items(message: dict, status: str) -> list[dict]:
    """A chat assistant message as output items: its text as a message (also when it is empty and
    there are no calls), then a function_call for each tool call."""
    calls = message.get("tool_calls") or []
    items = []
    if message["content"] or not calls:
        items.append(_message_item(_item_id("msg"), message["content"] or "", status))
    items += [_call_item(_item_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"],
                         status) for call in calls]
    return items


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str | None, status: str) -> dict:
    """`text` None: the item as it opens, before its content part."""
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [] if text is None else [_text_part(text)]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


class ResponseEvents:
    """One streamed response: its chat chunks turned into OpenAI's Responses events, each with its
    sequence_number. Text opens a message item; each tool call opens a function_call item (a
    named function's arguments stream as deltas); an item is done when the next one opens or the
    response ends. The finished response is stored (`store` not None) before its last event."""

    def __init__(self, shell: ResponseShell, store: ResponseStore | None, conversation: list):
        self.shell = shell
        self.store = store
        self.conversation = conversation
        self.sequence_number = 0
        self.output: list[dict] = []  # the items opened so far; the last may still be open
        self.open = False
        self.calls: dict[int, int] = {}  # a chat tool call's index -> its item's output index

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
        in_progress = self.shell.response("in_progress", [])
        yield self._event("response.created", response=in_progress)
        yield self._event("response.in_progress", response=in_progress)
        usage, finish_reason = None, None
        try:
            async for chunk in chunks:
                if not chunk["choices"]:  # the last chunk: usage only
                    usage = chunk["usage"]
                    continue
                choice = chunk["choices"][0]
                if choice["delta"].get("content"):
                    for event in self._text(choice["delta"]["content"]):
                        yield event
                for call in choice["delta"].get("tool_calls") or []:
                    for event in self._call(call):
                        yield event
                finish_reason = choice["finish_reason"] or finish_reason
        except EngineDeadError as e:  # the status line is long gone: errors travel as events
            yield self._error(APIError(503, str(e), type="server_error"))
            return
        except APIError as e:
            yield self._error(_in_responses_terms(e))
            return
        status = "completed" if finish_reason in ("stop", "tool_calls") else "incomplete"
        if not self.output:  # no text and no calls: an empty message, as a whole response has
            for event in self._text(""):
                yield event
        for event in self._close(status):
            yield event
        response = self.shell.response(status, self.output, usage, finish_reason)
        if self.store is not None:
            self.store.put(response, self.conversation + _ITEMS.validate_python(response["output"]))
        yield self._event(f"response.{status}", response=response)

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def _error(self, error: APIError) -> dict:
        return self._event("error", code=error.code or error.type, message=error.message, param=error.param)

    def _text(self, delta: str) -> list[dict]:
        events = []
        item = self.output[-1] if self.open else None
        if item is None or item["type"] != "message":
            events += self._close("completed")
            item = _message_item(_item_id("msg"), None, "in_progress")
            events += self._open(item)
            item["content"].append(_text_part(""))
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=len(self.output) - 1, content_index=0,
                                      part=_text_part("")))
        if delta:
            item["content"][0]["text"] += delta
            events.append(self._event("response.output_text.delta", item_id=item["id"],
                                      output_index=len(self.output) - 1, content_index=0, delta=delta, logprobs=[]))
        return events

    def _call(self, call: dict) -> list[dict]:
        """A chat tool-call delta: a new call (it has an id), or more of a named function's arguments."""
        events = []
        if "id" in call:
            events += self._close("completed")
            events += self._open(_call_item(_item_id("fc"), call["id"], call["function"]["name"], "", "in_progress"))
            self.calls[call["index"]] = len(self.output) - 1
        index = self.calls[call["index"]]
        item, delta = self.output[index], call["function"].get("arguments", "")
        if delta:
            item["arguments"] += delta
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=index, delta=delta))
        return events

    def _open(self, item: dict) -> list[dict]:
        self.output.append(item)
        self.open = True
        return [self._event("response.output_item.added", output_index=len(self.output) - 1,
                            item=copy.deepcopy(item))]  # as it is now, not as it grows

    def _close(self, status: str) -> list[dict]:
        """The events that finish the open item, if any, with `status`."""
        if not self.open:
            return []
        self.open = False
        index, item = len(self.output) - 1, self.output[-1]
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            events = [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"], logprobs=[]),
                      self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=dict(part))]
        else:
            events = [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"])]
        return events + [self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]


def _event_stream(stream: RequestStream, events: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events as the Responses API sends them: `event: <type>` and `data: {json}`."""

    async def lines() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
        finally:
            # Runs also when the client disconnects (Starlette cancels this generator).
            stream.abort()

    return StreamingResponse(lines(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
