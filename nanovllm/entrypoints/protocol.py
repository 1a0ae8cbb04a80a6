"""The OpenAI API's request bodies as strict pydantic models, and its error shape.

Every field a model declares is honoured; any other field is rejected by name (OpenAI's own
"Unrecognized request argument supplied: X"), except that a null value means "not given" for
every field, known or not, as in OpenAI's API. Types are strict: "5" is not an integer and
true is not 1. Values are range-checked by SamplingParams, whose messages name the field.
Besides OpenAI's fields, vLLM's sampling extras are accepted (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, skip_special_tokens,
include_stop_str_in_output) and its `structured_outputs` (json, regex, choice, grammar,
json_object), with vLLM's meanings; `response_format` maps onto the same constraints.
"""

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from nanovllm.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams, check_text


def _valid_text(text: str) -> str:
    check_text("the string", text)
    return text


# A string that can be tokenized and sent back: no lone surrogates (JSON's "\ud800").
Text = Annotated[str, AfterValidator(_valid_text)]


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        # Messages may quote the request; a lone surrogate in it could not be encoded as JSON.
        message = _encodable(message)
        param = None if param is None else _encodable(param)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _encodable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class _Strict(BaseModel):
    # populate_by_name: a field named by an alias (`schema`, `json`) is set by that name too.
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_absent(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Strict):
    include_usage: bool = False


class JSONSchemaFormat(_Strict):
    name: Text
    description: Text | None = None
    json_schema: dict = Field(default_factory=dict, alias="schema")  # none given: any JSON value
    strict: bool | None = None  # honoured either way: the output always matches the schema


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema must be given exactly when type is 'json_schema'")
        return self


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs` field: one constraint (StructuredOutputsParams' names)."""

    json_: dict | Text | None = Field(None, alias="json")  # `json` would shadow BaseModel.json
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None


class SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Text | None = None  # None: the served model, as in vLLM
    n: int = Field(1, le=128)
    temperature: float = 1.0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None  # informational in OpenAI's API; accepted, used for nothing
    # vLLM's extras
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None  # OpenAI's: token ids, as JSON keys, to biases
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM's

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _one_constraint(self):
        if self.structured_outputs is not None and self._constrains_format:
            raise ValueError("response_format and structured_outputs cannot both be given")
        return self

    @property
    def _constrains_format(self) -> bool:
        return self.response_format is not None and self.response_format.type != "text"

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float]) -> dict[str, float]:
        for key in bias:
            if not re.fullmatch(r"[0-9]{1,19}", key):
                raise ValueError(f"logit_bias keys must be token ids (integers, as JSON object keys), got {key!r}")
        return bias

    def constraint(self) -> StructuredOutputsParams | None:
        """The request's output constraint, from structured_outputs or response_format."""
        if self.structured_outputs is not None:
            return StructuredOutputsParams(**self.structured_outputs.model_dump(exclude_none=True, by_alias=True))
        if not self._constrains_format:
            return None
        if self.response_format.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        return StructuredOutputsParams(json=self.response_format.json_schema.json_schema)

    @property
    def constraint_field(self) -> str:
        """The field a rejected constraint is reported under."""
        if self.structured_outputs is not None:
            return "structured_outputs"
        schema_given = self.response_format is not None and self.response_format.type == "json_schema"
        return "response_format.json_schema.schema" if schema_given else "response_format"

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """Raises ValueError naming the field when a value is out of range."""
        logit_bias = {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias is not None else None
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens, logit_bias=logit_bias,
            structured_outputs=self.constraint(),
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    prompt: Any  # a string, token ids, or a list of either; checked below
    max_tokens: int = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> Any:
        def is_ids(p):
            return isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)

        if isinstance(prompt, str):
            check_text("prompt", prompt)
            return prompt
        if is_ids(prompt) and prompt:
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
            for i, p in enumerate(prompt):
                if isinstance(p, str):
                    check_text(f"prompt[{i}]", p)
            return prompt
        raise ValueError("prompt must be a string, a list of token ids, or a non-empty list of either")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class FunctionCall(_Strict):
    name: Text
    arguments: Text  # a JSON object's text, as OpenAI sends it


class ToolCallItem(_Strict):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallItem] | None = None  # an assistant's past calls
    tool_call_id: Text | None = None  # the call a tool message answers

    @model_validator(mode="after")
    def _role_fields(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls may omit it)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages may hold tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)  # as vLLM joins text parts


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object; none: no arguments
    strict: bool | None = None  # honoured either way when tool_choice forces a call


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: Text


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the model's context, as in OpenAI's chat API
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @field_validator("tools")
    @classmethod
    def _distinct_tool_names(cls, tools: list[Tool]) -> list[Tool]:
        names = [tool.function.name for tool in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tools must have distinct function names, got {names}")
        return tools

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self):
        choice = self.tool_choice
        if choice == "required" or isinstance(choice, NamedToolChoice):
            if not self.tools:
                raise ValueError("tool_choice requires tools")
            names = [tool.function.name for tool in self.tools]
            if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
                raise ValueError(f"tool_choice names the function {choice.function.name!r}, which is not "
                                 f"among the tools {names}")
            if self._constrains_format or self.structured_outputs is not None:
                raise ValueError("tool_choice that forces a call cannot be combined with response_format "
                                 "or structured_outputs")
        return self


def parse_request(model: type[_Strict], data: Any) -> Any:
    """Validate a decoded JSON body; any problem becomes a 400 naming the field."""
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _as_api_error(e) from None


def _as_api_error(e: ValidationError) -> APIError:
    errors = e.errors(include_url=False)
    unknown = [err for err in errors if err["type"] == "extra_forbidden"]
    if unknown:
        names = [_location(err["loc"], keep_last=True) for err in unknown]
        return APIError(400, f"Unrecognized request argument supplied: {', '.join(names)}", param=names[0])
    # Within a union pydantic reports every member's failure: the deepest is the most telling.
    err = max(errors, key=lambda err: len(err["loc"]))
    message = err["msg"].removeprefix("Value error, ")
    param = _location(err["loc"])
    if param:
        return APIError(400, f"Invalid value for '{param}': {message}", param=param)
    # A check across fields (the request's own validator) has no location; its message starts
    # with the field it is about.
    first_word = message.split(" ", 1)[0]
    return APIError(400, message, param=first_word if first_word in _FIELD_NAMES else None)


def _location(loc: tuple, keep_last: bool = False) -> str:
    """`messages[0].content` from pydantic's ('messages', 0, 'content', 'list[TextPart]', ...):
    the union members' names pydantic inserts are not part of the request's shape."""
    text = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            text += f"[{part}]"
        elif part in _FIELD_NAMES or (keep_last and i == len(loc) - 1):
            text += f".{part}" if text else part
    return text


_FIELD_NAMES = {name for model in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, StreamOptions,
                                   ResponseFormat, JSONSchemaFormat, StructuredOutputsRequest, FunctionCall,
                                   ToolCallItem, FunctionDefinition, Tool, FunctionName, NamedToolChoice)
                for name in model.model_fields} | {"schema", "json"}  # the aliases
