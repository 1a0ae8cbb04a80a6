"""Anthropic's Messages API: its request bodies (POST /v1/messages and /v1/messages/count_tokens) as
pydantic models on protocol's `_Strict` base, their translation into the chat pipeline's own
`ChatCompletionRequest`, and Anthropic's error shape.

The translation: `system` becomes a system message; an assistant's `tool_use` blocks its
`tool_calls` (the input as JSON arguments); a user's `tool_result` blocks `tool` messages, before
the text of the same turn, as Anthropic orders them; a last assistant turn (a prefill) is continued
(`continue_final_message`); `tool_choice` auto / any / tool / none becomes auto / required / a
named function / none, `disable_parallel_tool_use` the opposite of `parallel_tool_calls`;
`stop_sequences` becomes `stop`; `output_config.format` (a JSON schema) becomes `response_format`.
Blocks that are not text (image, document) are refused: the served models take text only.
`metadata` and `cache_control` are accepted and unused; so are undeclared fields (`thinking`,
`service_tier`...), which are named in one warning line, as protocol's leniency has it.
"""

import json
import logging
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from nanovllm.entrypoints.protocol import APIError, ChatCompletionRequest, Text, _Strict

logger = logging.getLogger(__name__)

# Anthropic's own pattern for a custom tool's name.
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
_TEXT_ONLY = {"image", "document"}


class TextBlock(_Strict):
    type: Literal["text"]
    text: Text
    cache_control: dict | None = None  # prompt caching is automatic here (the prefix cache)


class ToolUseBlock(_Strict):
    """A call the assistant made, in an assistant turn."""

    type: Literal["tool_use"]
    id: Text
    name: Text
    input: dict
    cache_control: dict | None = None


class ToolResultBlock(_Strict):
    """What a call returned, in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock] = ""
    is_error: bool = False
    cache_control: dict | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        return _refuse_non_text(content)

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "\n".join(block.text for block in self.content)
        # The model learns that the call failed only from the text it reads.
        return f"Error: {text}" if self.is_error else text


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


def _refuse_non_text(content: Any) -> Any:
    """A clear refusal of image and document blocks, before pydantic reports them as unknown tags."""
    if isinstance(content, list):
        for i, block in enumerate(content):
            if isinstance(block, dict) and block.get("type") in _TEXT_ONLY:
                raise ValueError(f"block {i} is of type {block['type']!r}, but this model takes text only "
                                 "(blocks allowed: text, tool_use, tool_result)")
    return content


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: Text | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        return _refuse_non_text(content)

    @model_validator(mode="after")
    def _blocks_of_the_role(self):
        misplaced = {"user": "tool_use", "assistant": "tool_result"}[self.role]
        if isinstance(self.content, list) and any(block.type == misplaced for block in self.content):
            raise ValueError(f"a {self.role} message cannot hold {misplaced} blocks (tool_use blocks belong in "
                             "assistant turns, tool_result blocks in user turns)")
        return self

    def chat_messages(self) -> list[dict]:
        """This turn as chat messages: an assistant's text and calls as one, a user's tool results
        as tool messages followed by its text."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        texts = [{"type": "text", "text": block.text} for block in self.content if block.type == "text"]
        if self.role == "assistant":
            calls = [{"id": block.id, "type": "function",
                      "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}}
                     for block in self.content if block.type == "tool_use"]
            return [{"role": "assistant", "content": texts, **({"tool_calls": calls} if calls else {})}]
        results = [{"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()}
                   for block in self.content if block.type == "tool_result"]
        return results + ([{"role": "user", "content": texts}] if texts or not results else [])


class ToolDefinition(_Strict):
    """A custom tool; Anthropic's server tools (web search, code execution, ...) do not run here."""

    type: Literal["custom"] | None = None
    name: Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]
    description: Text | None = None
    input_schema: dict  # a JSON schema of the input object
    cache_control: dict | None = None

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, schema: dict) -> dict:
        if schema.get("type") != "object":
            raise ValueError(f"a tool's input is an object: input_schema.type must be 'object', got "
                             f"{schema.get('type')!r}")
        return schema

    @model_validator(mode="before")
    @classmethod
    def _custom_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in (None, "custom"):
            raise ValueError(f"the tool {data.get('name')!r} is Anthropic's server tool {data['type']!r}, which "
                             "this server does not run; only custom tools ({name, description, input_schema}) "
                             "are supported")
        return data

    def chat_tool(self) -> dict:
        function = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None  # the tool, for type "tool"
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_with_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice.name must be given exactly when tool_choice.type is 'tool'")
        return self

    def chat_tool_choice(self) -> str | dict:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class CountTokensRequest(_Strict):
    """POST /v1/messages/count_tokens: the conversation, without the sampling."""

    model: Text
    messages: list[Message] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: dict | None = None

    @model_validator(mode="after")
    def _prefill_is_text(self):
        last = self.messages[-1]
        if last.role == "assistant" and isinstance(last.content, list) and any(
                block.type != "text" for block in last.content):
            raise ValueError("a last assistant message (a prefill, which the reply continues) may hold text only")
        return self

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self):
        names = [tool.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError(f"tools must have distinct names, got {names}")
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise ValueError(f"tool_choice {choice.type!r} requires tools")
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice names the tool {choice.name!r}, which is not among the tools {names}")
        return self

    def chat_fields(self) -> dict:
        """The fields of the equivalent chat request."""
        messages = []
        if self.system is not None:
            system = self.system if isinstance(self.system, str) else "\n".join(block.text for block in self.system)
            messages.append({"role": "system", "content": system})
        for message in self.messages:
            messages.extend(message.chat_messages())
        fields = {"model": self.model, "messages": messages}
        if self.messages[-1].role == "assistant":  # a prefill: the reply continues it
            fields.update(add_generation_prompt=False, continue_final_message=True)
        if self.tools:
            fields["tools"] = [tool.chat_tool() for tool in self.tools]
        if self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice.chat_tool_choice()
            fields["parallel_tool_calls"] = not self.tool_choice.disable_parallel_tool_use
        return fields

    def chat_request(self) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate(self.chat_fields())


class JSONOutputFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: dict = Field(alias="schema")


class OutputConfig(_Strict):
    format: JSONOutputFormat | None = None  # the reply's text is held to this JSON schema


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)  # required, as in Anthropic's API
    stop_sequences: list[Text] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stream: bool = False
    metadata: dict | None = None  # Anthropic's user_id and such; accepted, unused
    output_config: OutputConfig | None = None

    @model_validator(mode="after")
    def _forced_call_alone(self):
        """A forced call is held to its tool's schema up to its end: no other format may hold it."""
        if self.tool_choice is None or self.tool_choice.type not in ("any", "tool"):
            return self
        if self.output_config is not None and self.output_config.format is not None:
            raise ValueError("output_config.format cannot be combined with a tool_choice that forces a call")
        return self

    def chat_request(self) -> ChatCompletionRequest:
        fields = {**self.chat_fields(), "max_tokens": self.max_tokens, "temperature": self.temperature,
                  "top_p": self.top_p, "top_k": self.top_k, "stream": self.stream}
        if self.stop_sequences:
            fields["stop"] = self.stop_sequences
        if self.output_config is not None and self.output_config.format is not None:
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": self.output_config.format.json_schema}}
        if self.stream:  # the token count of message_delta comes from the usage chunk
            fields["stream_options"] = {"include_usage": True}
        return ChatCompletionRequest.model_validate(fields)


def parse_anthropic_request(model: type[CountTokensRequest], data: Any, endpoint: str) -> CountTokensRequest:
    """Validate a decoded JSON body; a problem becomes a 400 whose message starts with the field's
    path, as Anthropic's do ("max_tokens: Field required"). Fields the server ignores are named
    in one warning line."""
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        request = model.model_validate(data)
    except ValidationError as e:
        # Within a union pydantic reports every member's failure: the deepest is the most telling.
        error = max(e.errors(include_url=False), key=lambda err: len(err["loc"]))
        message = error["msg"].removeprefix("Value error, ")
        path = _path(error["loc"])
        raise APIError(400, f"{path}: {message}" if path else message) from None
    ignored = request.ignored_fields()
    if ignored:
        logger.warning("%s: fields ignored (they change nothing here): %s", endpoint, ", ".join(ignored))
    return request


def _path(loc: tuple) -> str:
    """`messages.0.content.1.tool_use.input` from pydantic's location, without the union members'
    names pydantic inserts (`str`, `list[...]`); a block's type stays, as in Anthropic's paths."""
    return ".".join(str(part) for part in loc if isinstance(part, int) or part in _PATH_NAMES)


_MODELS = (TextBlock, ToolUseBlock, ToolResultBlock, Message, ToolDefinition, ToolChoice, JSONOutputFormat,
           OutputConfig, MessagesRequest)
# The fields, the block types (pydantic's tags) and the alias.
_PATH_NAMES = {name for model in _MODELS for name in model.model_fields} | {"text", "tool_use", "tool_result", "schema"}

# Anthropic's error types by HTTP status; other 4xx are invalid requests, other 5xx api errors.
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_body(error: APIError) -> dict:
    """`error` in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    fallback = "api_error" if error.status >= 500 else "invalid_request_error"
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(error.status, fallback), "message": error.message}}
