"""The request body of OpenAI's Responses API (POST /v1/responses) as pydantic models on
protocol.py's `_Strict` base: text input as a string or as items (messages, function calls and
their outputs), function tools, `tool_choice`, `text.format`, and the sampling settings the chat
pipeline honours. Fields OpenAI defines that change nothing here (`reasoning`, `include`,
`truncation`, `service_tier`, ...) are accepted and ignored, as any undeclared field is (`_Strict`);
those that would change the answer if ignored (`background`, `conversation`...) are refused.

Inputs this server cannot take are refused by name: an item or a tool of another type, and
image, file or audio parts (the served models take text only).
"""

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from nanovllm.entrypoints.protocol import FunctionDefinition, Text, _false, _never, _Strict, add_field_names

ITEM_TYPES = ("message", "function_call", "function_call_output")
TEXT_PART_TYPES = ("input_text", "output_text", "refusal")
NON_TEXT_PART_TYPES = ("input_image", "input_file", "input_audio")


class TextPart(_Strict):
    """Text in a message: a user's `input_text`, or an `output_text` of an earlier reply sent back."""

    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list | None = None  # of output_text; none are made here
    logprobs: list | None = None  # of output_text


class RefusalPart(_Strict):
    type: Literal["refusal"]
    refusal: Text


ContentPart = Annotated[TextPart | RefusalPart, Field(discriminator="type")]


def _part_text(part: TextPart | RefusalPart) -> str:
    return part.text if isinstance(part, TextPart) else part.refusal


class MessageItem(_Strict):
    type: Literal["message"] = "message"  # an "easy" message may leave it out
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[ContentPart]
    id: Text | None = None  # an output message sent back
    status: Text | None = None

    def text_parts(self) -> list[str]:
        return [self.content] if isinstance(self.content, str) else [_part_text(part) for part in self.content]


class FunctionCallItem(_Strict):
    """A call the model made (an earlier response's output, sent back)."""

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text
    id: Text | None = None
    status: Text | None = None


class FunctionCallOutputItem(_Strict):
    """The caller's result of a function call."""

    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[TextPart]
    id: Text | None = None
    status: Text | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(part.text for part in self.output)


def _zero(value: Any, _: dict) -> bool:
    return value == 0


def _item_type(item: Any) -> str:
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", "message")


def _item_tag(item: Any) -> str:
    # Tags unlike any field name: pydantic puts them into error locations, which name fields.
    return f"{_item_type(item)} item"


InputItem = Annotated[Annotated[MessageItem, Tag("message item")]
                      | Annotated[FunctionCallItem, Tag("function_call item")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output item")], Discriminator(_item_tag)]


class FunctionTool(FunctionDefinition):
    """A function tool: chat's function definition, with its type beside its fields."""

    type: Literal["function"]


class FunctionToolChoice(_Strict):
    type: Literal["function"]
    name: Text


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    description: Text | None = None
    json_schema: dict | None = Field(None, alias="schema")
    strict: bool | None = None  # honoured either way: the output always matches the schema

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if self.type == "json_schema" and (self.name is None or self.json_schema is None):
            raise ValueError("a json_schema format needs its name and schema")
        return self


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, changes nothing


class ResponsesRequest(_Strict):
    refused = {
        "background": (_false, "responses run while the request waits; send background false"),
        "conversation": (_never, "conversations are not stored here; chain responses with previous_response_id"),
        "prompt": (_never, "stored prompt templates are not kept here; send the input itself"),
        "top_logprobs": (_zero, "output_text carries no logprobs on this server"),
    }
    # Fields of OpenAI's that change nothing here (as protocol.py's `harmless`): accepted, logged.
    harmless: ClassVar[frozenset[str]] = frozenset({
        "include", "reasoning", "truncation", "service_tier", "prompt_cache_key", "prompt_cache_options",
        "prompt_cache_retention", "safety_identifier", "max_tool_calls", "stream_options", "moderation",
        "context_management", "background_options", "access_programs", "image"})

    model: Text | None = None  # None: the served model
    input: Text | list[InputItem]
    instructions: Text | None = None  # a system message first; not carried over by previous_response_id
    previous_response_id: Text | None = None
    store: bool = True
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = None  # None: up to the model's context
    temperature: float = 1.0
    top_p: float = 1.0
    metadata: dict[str, Text] | None = None  # echoed and stored
    user: Text | None = None  # echoed, used for nothing

    @field_validator("input", mode="before")
    @classmethod
    def _text_items_only(cls, items: Any) -> Any:
        """Items and parts of other types get a message naming them, not pydantic's union report."""
        if not isinstance(items, list):
            return items
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                continue  # pydantic says what is wrong with it
            kind = _item_type(item)
            if kind not in ITEM_TYPES:
                raise ValueError(f"input[{i}] is an item of type {kind!r}, which this server does not take; "
                                 f"the types it takes are {', '.join(ITEM_TYPES)}")
            parts = item.get("content") if kind == "message" else item.get("output")
            for j, part in enumerate(parts if isinstance(parts, list) else []):
                part_type = part.get("type") if isinstance(part, dict) else None
                where = f"input[{i}].{'content' if kind == 'message' else 'output'}[{j}]"
                if part_type in NON_TEXT_PART_TYPES:
                    raise ValueError(f"{where} is an {part_type} part, but this model takes text only")
                if part_type not in TEXT_PART_TYPES:
                    raise ValueError(f"{where} has type {part_type!r}; the part types are "
                                     f"{', '.join(TEXT_PART_TYPES)}")
        return items

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools: Any) -> Any:
        for i, tool in enumerate(tools if isinstance(tools, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tools[{i}] has type {kind!r}; this server takes function tools only "
                                 "(type \"function\")")
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, choice: Any) -> Any:
        if isinstance(choice, dict) and choice.get("type") != "function":
            raise ValueError(f"a tool_choice of type {choice.get('type')!r} is not supported; it may be \"none\", "
                             "\"auto\", \"required\" or {\"type\": \"function\", \"name\": ...}")
        return choice

    @field_validator("input")
    @classmethod
    def _some_input(cls, items: str | list) -> str | list:
        if isinstance(items, list) and not items:
            raise ValueError("input must be a string or a non-empty list of items")
        return items

    @field_validator("tools")
    @classmethod
    def _distinct_tool_names(cls, tools: list[FunctionTool]) -> list[FunctionTool]:
        names = [tool.name for tool in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tools must have distinct names, got {names}")
        return tools

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self):
        choice = self.tool_choice
        if self.forces_a_call:
            names = [tool.name for tool in self.tools or []]
            if not names:
                raise ValueError("tool_choice requires tools")
            if isinstance(choice, FunctionToolChoice) and choice.name not in names:
                raise ValueError(f"tool_choice names the function {choice.name!r}, which is not among the "
                                 f"tools {names}")
        return self

    @property
    def forces_a_call(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, FunctionToolChoice)

    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem]:
        """The input as items: a string is one user message."""
        return [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else list(self.input)


add_field_names(TextPart, RefusalPart, MessageItem, FunctionCallItem, FunctionCallOutputItem, FunctionTool,
                FunctionToolChoice, TextFormat, TextConfig, ResponsesRequest)
