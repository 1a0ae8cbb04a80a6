"""Tool calls in the model families' own formats: found in generated text (whole, or how much of a
stream is surely plain content), told from a chat template, and written for a template that
cannot render tools itself.

- hermes (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
  block per call.
- llama3_json (Llama 3.1+): a JSON object `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`; several are separated by `;`.
- mistral: `[TOOL_CALLS]` and a JSON array of `{"name": ..., "arguments": {...}}`.

Text that does not parse as calls of its format is plain content, as in vLLM.
"""

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text


def call_from_json(obj, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from a decoded `{"name": ..., <argument key>: {...}}`; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in argument_keys:
        if key in obj:
            arguments = obj[key]
            if isinstance(arguments, str):  # some models write the object as a JSON string
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    return None
            return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False)) \
                if isinstance(arguments, dict) else None
    return ToolCall(obj["name"], "{}")


def json_values(text: str, start: int = 0, separator: str = "") -> tuple[list, int]:
    """The JSON values from `start` on, one after another (separated by `separator` and
    whitespace), as many as decode whole; and where the last of them ends."""
    values, end = [], start
    while True:
        i = _skip_space(text, end)
        if values and separator:
            if not text.startswith(separator, i):
                return values, end
            i = _skip_space(text, i + len(separator))
        try:
            value, end = _DECODER.raw_decode(text, i)
        except json.JSONDecodeError:
            return values, end
        values.append(value)


def decode_json_sequence(text: str, separator: str = "") -> list | None:
    """The JSON values of `text` (see json_values); None unless the whole text is such values."""
    values, end = json_values(text, 0, separator)
    return values if values and not text[end:].strip() else None


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _held_back(text: str, marker: str) -> int:
    """Characters at the end of `text` that could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser(ABC):
    name: ClassVar[str]
    # The format's markers are special tokens, which the text keeps only when they are not skipped.
    needs_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the content outside the calls, None if there is none; the calls, in order)."""

    @abstractmethod
    def content_end(self, text: str) -> int:
        """How many leading characters of a text still being generated are content whatever
        follows: a stream may send them."""

    def complete_calls(self, text: str) -> list[ToolCall]:
        """The calls that are complete in a text still being generated, whatever follows (by
        default none: a format without closing markers is parsed at the end)."""
        return []

    @abstractmethod
    def tools_prompt(self, tools: list[dict]) -> str:
        """A system message's text telling the model its tools and how to call them (for chat
        templates that do not render tools)."""

    @abstractmethod
    def format_calls(self, calls: list[ToolCall]) -> str:
        """Past calls, as the model would have written them (for templates that do not render them)."""


def _tool_lines(tools: list[dict]) -> str:
    return "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text):
        start = text.find(self.START)
        if start < 0:
            return text or None, []
        calls = []
        for match in self._BLOCK.finditer(text, start):
            values = decode_json_sequence(match.group(1))
            call = call_from_json(values[0], ("arguments", "parameters")) if values and len(values) == 1 else None
            if call is None:
                return text or None, []
            calls.append(call)
        return text[:start].strip() or None, calls

    def content_end(self, text):
        start = text.find(self.START)
        return start if start >= 0 else len(text) - _held_back(text, self.START)

    def complete_calls(self, text):
        end = text.rfind(self.END)
        return self.parse(text[:end + len(self.END)])[1] if end >= 0 else []

    def tools_prompt(self, tools):
        return ("You can call functions to help with the user's request. Their signatures, as JSON, are "
                f"within <tools></tools>:\n<tools>\n{_tool_lines(tools)}\n</tools>\n"
                "To call one, answer with a JSON object holding its name and its arguments inside "
                '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function name>, "arguments": '
                "<arguments as a JSON object>}\n</tool_call>")

    def format_calls(self, calls):
        return "\n".join(f'{self.START}\n{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}\n{self.END}'
                         for c in calls)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    needs_special_tokens = True
    TAG = "<|python_tag|>"

    def parse(self, text):
        body = text.strip().removeprefix(self.TAG)
        values = decode_json_sequence(body, separator=";") if body.lstrip().startswith("{") else None
        calls = [call_from_json(v, ("parameters", "arguments")) for v in values or []]
        if not calls or None in calls:
            return text or None, []
        return None, calls

    def content_end(self, text):
        body = text.lstrip()
        # A reply that opens with a JSON object (or the tag) is a call: hold it all back.
        if not body or body.startswith("{") or body.startswith(self.TAG) or self.TAG.startswith(body):
            return 0
        return len(text)

    def tools_prompt(self, tools):
        return ("You can call functions to help with the user's request. Their signatures, as JSON:\n"
                f"{_tool_lines(tools)}\nTo call one, answer with only a JSON object of the form "
                '{"name": <function name>, "parameters": <arguments as a JSON object>}.')

    def format_calls(self, calls):
        return "; ".join(f'{{"name": {json.dumps(c.name)}, "parameters": {c.arguments}}}' for c in calls)


class MistralParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True
    TAG = "[TOOL_CALLS]"

    def parse(self, text):
        start = text.find(self.TAG)
        if start < 0:
            return text or None, []
        values = decode_json_sequence(text[start + len(self.TAG):])
        items = values[0] if values and len(values) == 1 else None
        items = [items] if isinstance(items, dict) else items
        calls = [call_from_json(v, ("arguments", "parameters")) for v in items or []]
        if not calls or None in calls:
            return text or None, []
        return text[:start].strip() or None, calls

    def content_end(self, text):
        start = text.find(self.TAG)
        return start if start >= 0 else len(text) - _held_back(text, self.TAG)

    def tools_prompt(self, tools):
        return ("You can call functions to help with the user's request. Their signatures, as JSON:\n"
                f"{_tool_lines(tools)}\nTo call them, answer with {self.TAG} and a JSON array of objects "
                '{"name": <function name>, "arguments": <arguments as a JSON object>}.')

    def format_calls(self, calls):
        items = ", ".join(f'{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}' for c in calls)
        return f"{self.TAG}[{items}]"


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def parser_for_template(chat_template: str | None) -> ToolParser:
    """The format a chat template's model was trained on, by the markers the template writes;
    hermes when it shows none (its tools are then rendered in that format)."""
    template = chat_template or ""
    if MistralParser.TAG in template:
        return MistralParser()
    if Llama3JsonParser.TAG in template or "ipython" in template:
        return Llama3JsonParser()
    return HermesParser()
