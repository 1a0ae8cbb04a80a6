"""Tool calling in chat completions: the tools and past calls into the chat template, tool_choice
into a constraint, and the generated text into OpenAI's `tool_calls`, whole or as stream deltas.

- `auto` (the default with tools): the model writes freely; its model family's parser
  (entrypoints/tool_parsers.py) finds the calls.
- `required`: the output is held by a JSON schema to an array of `{"name", "parameters"}`
  objects, one of them unless parallel_tool_calls, each name one of the tools and its
  parameters that tool's schema, as vLLM does.
- a named function: the output is that function's arguments, held by its parameters' schema.
- `none`: the tools are not shown to the model and nothing is parsed.

A tool's `"parameters": {}` (or none) means a function without arguments: its arguments are an
empty object. One rule for a reply cut by max_tokens while writing a call, streamed or not: the
calls completed before the cut are returned as `tool_calls`, nothing of the partial one is
returned (as a call or as content), and finish_reason stays "length". So a forced call's
arguments go out when complete, not as they are written.

A chat template that renders tools gets them (and past calls, their arguments as objects)
through transformers' `apply_chat_template(tools=...)`; for one that does not, the parser's
format describes them in a system message and writes past calls into the assistant's content.
"""

import json
import uuid

from nanovllm.entrypoints.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice
from nanovllm.entrypoints.tool_parsers import ToolCall, ToolParser, call_from_json, decode_json_sequence, json_values
from nanovllm.sampling_params import StructuredOutputsParams

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _openai_call(call: ToolCall) -> dict:
    return {"id": _call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class ToolCalling:
    """One chat request's tools, its tool_choice, and the parser of the served model's format."""

    def __init__(self, body: ChatCompletionRequest, parser: ToolParser):
        self.tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
        self.choice = body.tool_choice or ("auto" if self.tools else "none")
        self.parser = parser
        self.parallel = body.parallel_tool_calls
        self.function = body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    def constraint(self) -> StructuredOutputsParams | None:
        """What `required` or a named function holds the output to; None for auto and none."""
        schemas = {tool["function"]["name"]: tool["function"].get("parameters") or NO_ARGUMENTS for tool in self.tools}
        if self.function is not None:
            return StructuredOutputsParams(json=schemas[self.function])
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in schemas.items()]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=array)

    def template_inputs(self, messages: list[ChatMessage], template: str) -> tuple[list[dict], dict]:
        """(the conversation as the template takes it, its extra arguments)."""
        renders_tools = "tools" in template
        conversation = []
        for message in messages:
            entry = {"role": message.role, "content": message.text()}
            if message.tool_calls:
                calls = [ToolCall(c.function.name, c.function.arguments) for c in message.tool_calls]
                if renders_tools:
                    entry["tool_calls"] = [{"id": c.id, "type": "function",
                                            "function": {"name": c.function.name,
                                                         "arguments": _arguments_object(c.function.arguments)}}
                                           for c in message.tool_calls]
                else:
                    entry["content"] = "\n".join(filter(None, [entry["content"], self.parser.format_calls(calls)]))
            if message.tool_call_id is not None:
                entry["tool_call_id"] = message.tool_call_id
            if message.name is not None:
                entry["name"] = message.name
            conversation.append(entry)
        if not self.active:
            return conversation, {}
        if renders_tools:
            return conversation, {"tools": self.tools}
        prompt = self.parser.tools_prompt(self.tools)
        if conversation and conversation[0]["role"] == "system":
            conversation[0] = {**conversation[0], "content": f"{conversation[0]['content']}\n\n{prompt}"}
        else:
            conversation.insert(0, {"role": "system", "content": prompt})
        return conversation, {}

    def calls(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole generated text; `cut`: it ended at max_tokens, so a call
        may be partial (the module's rule)."""
        if self.function is not None:
            return None, [ToolCall(self.function, text)] if not cut or _is_object(text) else []
        if self.choice == "required":
            calls = _required_calls(text)
            if calls is None and cut:
                return None, _complete_items(text)
            return (None, calls) if calls is not None else (text or None, [])
        content, calls = self.parser.parse(text)
        end = self.parser.content_end(text)
        if cut and not calls and end < len(text):  # a call was begun: what precedes it is content
            return text[:end].strip() or None, self.kept(self.parser.complete_calls(text))
        return content, self.kept(calls)

    def kept(self, calls: list[ToolCall]) -> list[ToolCall]:
        """The calls a reply may make: the first alone unless parallel_tool_calls."""
        return calls if self.parallel else calls[:1]

    def message(self, text: str, cut: bool = False) -> dict:
        """The assistant message of a whole choice; `cut`: it ended at max_tokens."""
        if not self.active:
            return {"role": "assistant", "content": text}
        content, calls = self.calls(text, cut)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [_openai_call(call) for call in calls]
        return message

    def stream(self) -> "ToolCallStream":
        """The deltas of one streamed choice (for an active request)."""
        return ToolCallStream(self)


def _arguments_object(arguments: str):
    """Templates index a past call's arguments as an object; text that is not one stays text."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return value if isinstance(value, dict) else arguments


def _is_object(text: str) -> bool:
    values = decode_json_sequence(text)
    return values is not None and len(values) == 1 and isinstance(values[0], dict)


def _required_call(item) -> ToolCall | None:
    """One item of the array `required` holds the output to: `{"name", "parameters"}`."""
    return call_from_json(item, ("parameters",)) if isinstance(item, dict) and "parameters" in item else None


def _required_calls(text: str) -> list[ToolCall] | None:
    values = decode_json_sequence(text)
    if not values or len(values) != 1 or not isinstance(values[0], list):
        return None
    calls = [_required_call(item) for item in values[0]]
    return calls if calls and None not in calls else None


class ToolCallStream:
    """One streamed choice's text turned into content and tool-call deltas as it grows. Each call
    goes out whole as it completes (a required array's items, a hermes block), or at the end (a
    named function's arguments, formats without closing markers)."""

    def __init__(self, tools: ToolCalling):
        self.tools = tools
        self.sent_content = 0  # characters of the text sent as content
        self.sent_calls = 0
        self.ids: list[str] = []

    def advance(self, text: str, finished: bool, cut: bool = False) -> tuple[str, list[dict]]:
        """(content to send now, tool-call deltas to send now) for the choice's whole text so far;
        `cut`: it finished at max_tokens."""
        tools = self.tools
        if tools.function is not None:
            return "", self._new_calls(tools.calls(text, cut)[1]) if finished else []
        if tools.choice == "required":
            return "", self._new_calls(_complete_items(text))
        parser = tools.parser
        if not finished:
            calls = tools.kept(parser.complete_calls(text))
            return self._content(text, parser.content_end(text)), self._new_calls(calls)
        content, calls = tools.calls(text, cut)
        if not calls and content == (text or None):  # all of it is content
            return self._content(text, len(text)), []
        return self._content(text, parser.content_end(text)), self._new_calls(calls)

    def _content(self, text: str, end: int) -> str:
        delta = text[self.sent_content:end] if end > self.sent_content else ""
        self.sent_content = max(self.sent_content, end)
        return delta

    def _new_calls(self, calls: list[ToolCall]) -> list[dict]:
        deltas = []
        for index, call in enumerate(calls[self.sent_calls:], start=self.sent_calls):
            self.ids.append(_call_id())
            deltas.append({"index": index, "id": self.ids[-1], "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}})
        self.sent_calls = max(self.sent_calls, len(calls))
        return deltas


def _complete_items(text: str) -> list[ToolCall]:
    """The calls of a required array's items that are complete in a partial `[{...}, {...`."""
    start = text.find("[")
    if start < 0:
        return []
    calls = []
    for item in json_values(text, start + 1, separator=",")[0]:
        call = _required_call(item)
        if call is None:
            break
        calls.append(call)
    return calls
