"""The OpenAI API's request bodies as pydantic models, and its error shape.

Every field a model declares is honoured, with strict types: "5" is not an integer and true is
not 1; a null value means "not given" for every field, as in OpenAI's API. Values are
range-checked by SamplingParams, whose messages name the field. Besides OpenAI's fields, vLLM's
sampling extras are accepted (top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, skip_special_tokens, include_stop_str_in_output), its chat-template options and
its `structured_outputs` (json, regex, choice, grammar, json_object), with vLLM's meanings;
`response_format` maps onto the same constraints.

Leniency as vLLM has it: a field no model declares is accepted and ignored, and
`parse_request` names every such field of a request in one warning line (a client written for
another server keeps working). A field whose request this server cannot honour, so that
ignoring it would silently change the answer (`suffix`, `best_of` > n, beam search, the
deprecated `functions`...), is refused with a 400 that says so (`REFUSED`).
"""

import logging
import re
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from nanovllm.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams, check_text

logger = logging.getLogger(__name__)


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
    """A request body or a part of one: strict types, undeclared fields kept aside (`model_extra`)
    for parse_request to name, and the fields in `refused` turned away unless harmless."""

    # populate_by_name: a field named by an alias (`schema`, `json`) is set by that name too.
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)
    # Field name -> (whether a given value is harmless to ignore, what to tell the client).
    refused: ClassVar[dict[str, tuple[Callable[[Any, dict], bool], str]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _null_means_absent(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if v is not None}
        for name, (harmless, reason) in cls.refused.items():
            if name in data and not harmless(data[name], data):
                raise ValueError(f"{name} is not supported: {reason}")
        return data

    def ignored_fields(self, prefix: str = "") -> list[str]:
        """The dotted names of the undeclared fields given here and in the parts below."""
        names = [f"{prefix}{name}" for name in self.model_extra or {}]
        for name, value in self:
            for i, part in enumerate(value if isinstance(value, list) else [value]):
                if isinstance(part, _Strict):
                    index = f"[{i}]" if isinstance(value, list) else ""
                    names += part.ignored_fields(f"{prefix}{name}{index}.")
        return names


def _false(value: Any, _: dict) -> bool:
    return value is False


def _empty(value: Any, _: dict) -> bool:
    return value in ("", [], {})


def _never(value: Any, _: dict) -> bool:
    return False


def _same_as_n(value: Any, data: dict) -> bool:
    return value == data.get("n", 1)


def _text_only(value: Any, _: dict) -> bool:
    return value == ["text"]


_STRUCTURED_OUTPUTS_INSTEAD = "vLLM replaced the guided_* fields; send structured_outputs: {json | regex | choice | grammar}"
# Refused by both endpoints: the answer would differ from what the field asks for.
_REFUSED_SAMPLING = {
    "best_of": (_same_as_n, "this server returns every sampled completion, so best_of may only equal n"),
    "use_beam_search": (_false, "beam search is not implemented; sample with n instead"),
    "prompt_logprobs": (_never, "send echo with logprobs on /v1/completions for the prompt's logprobs"),
    "return_tokens_as_token_ids": (_false, "tokens are always returned as text"),
    "truncate_prompt_tokens": (_never, "a prompt is never truncated here; shorten it"),
    "allowed_token_ids": (_never, "use logit_bias or structured_outputs to restrict tokens"),
    "bad_words": (_empty, "use logit_bias to ban tokens"),
    **{name: (_never, _STRUCTURED_OUTPUTS_INSTEAD)
       for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
                    "guided_whitespace_pattern")},
}


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage on every chunk too


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


# Fields of OpenAI's and vLLM's requests known to change nothing here (routing, storage, caching
# and moderation hints, reasoning settings of models that have none): accepted, named in the log.
_HARMLESS_SAMPLING = frozenset({
    "store", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
    "safety_identifier", "moderation", "reasoning_effort", "verbosity", "priority", "request_id", "cache_salt",
    "kv_transfer_params", "vllm_xargs", "mm_processor_kwargs", "spaces_between_special_tokens", "length_penalty",
    "prediction", "web_search_options",
})


class SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    refused = _REFUSED_SAMPLING
    # Documentation, and what the field-coverage test holds the API's field lists to.
    harmless: ClassVar[frozenset[str]] = _HARMLESS_SAMPLING

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
    # nano-vllm's: at most this many drafted tokens a step for this request (0: none), where the
    # server speculates (--speculative-config).
    num_speculative_tokens: int | None = None

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
            structured_outputs=self.constraint(), num_speculative_tokens=self.num_speculative_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def include_continuous_usage(self) -> bool:
        """Usage on every streamed chunk: vLLM's continuous_usage_stats, which needs include_usage."""
        return self.include_usage and self.stream_options.continuous_usage_stats


def check_prompts(field: str, value: Any) -> Any:
    """`value` if it is one prompt or a non-empty list of prompts (a prompt: a string, or a
    non-empty list of token ids); ValueError naming `field` otherwise."""
    def is_ids(item):
        return isinstance(item, list) and bool(item) and all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in item)

    if isinstance(value, str):
        check_text(field, value)
        return value
    if is_ids(value):
        return value
    if isinstance(value, list) and value and all(isinstance(item, str) or is_ids(item) for item in value):
        for i, item in enumerate(value):
            if isinstance(item, str):
                check_text(f"{field}[{i}]", item)
        return value
    raise ValueError(f"{field} must be a string, a list of token ids, or a non-empty list of either (a list "
                     "of token ids is never empty)")


def as_prompt_list(value: str | list) -> list[str | list[int]]:
    """One entry per prompt of a value check_prompts passed: a string or a list of token ids."""
    return [value] if isinstance(value, str) or isinstance(value[0], int) else list(value)


class CompletionRequest(SamplingRequest):
    refused = {**_REFUSED_SAMPLING,
               "suffix": (_empty, "text after an insertion point cannot be given; the completion follows the prompt")}

    prompt: Any  # a string, token ids, or a list of either; checked below
    max_tokens: int = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS etc. around a text prompt

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> Any:
        return check_prompts("prompt", prompt)

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        return as_prompt_list(self.prompt)


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


# Content parts of other modalities, told apart so that the error says what is missing.
_MEDIA_PARTS = ("image_url", "input_audio", "file", "video_url", "audio_url", "input_image")


def _text_parts(content: Any) -> Any:
    """Content parts before validation: a part of another modality is refused by name."""
    if isinstance(content, list):
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _MEDIA_PARTS:
                raise ValueError(f"content[{i}] is an {kind} part, but this model takes text only; send text parts")
    return content


class FunctionCall(_Strict):
    name: Text
    arguments: Text  # a JSON object's text, as OpenAI sends it


class ToolCallItem(_Strict):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[Text | list[TextPart] | None, BeforeValidator(_text_parts)] = None
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
    refused = {**_REFUSED_SAMPLING,
               "functions": (_empty, "functions was replaced by tools; send tools (type function) instead"),
               "function_call": (_never, "function_call was replaced by tool_choice; send tool_choice instead"),
               "audio": (_never, "this model writes text only"),
               "modalities": (_text_only, "this model writes text only; modalities may only be [\"text\"]"),
               "echo": (_false, "echoing the last message is not implemented")}

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the model's context, as in OpenAI's chat API
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool = True
    # vLLM's chat-template options, with its defaults.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template already holds the model's special tokens
    chat_template: Text | None = None  # a Jinja template to use instead of the model's
    chat_template_kwargs: dict | None = None  # more variables for the template (e.g. enable_thinking)
    documents: list[dict] | None = None  # for templates that render retrieved documents

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        # vLLM's rule: top_logprobs 0 without logprobs asks for nothing and is let through.
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _continue_or_open_a_turn(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message continues the last message, so add_generation_prompt "
                             "must be false with it")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
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


class TokenizeCompletionRequest(_Strict):
    """vLLM's /tokenize of a text prompt."""

    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatCompletionRequest):
    """vLLM's /tokenize of chat messages: the prompt a chat request with these messages, tools and
    template options would run (its sampling fields, if given, change nothing)."""

    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: Text | None = None
    tokens: list[int] = Field(min_length=0)


def parse_request(model: type[_Strict], data: Any, endpoint: str = "") -> Any:
    """Validate a decoded JSON body; any problem becomes a 400 naming the field. Fields the
    server ignores are named in one warning line (vLLM's leniency)."""
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        request = model.model_validate(data)
    except ValidationError as e:
        raise _as_api_error(e) from None
    ignored = request.ignored_fields()
    if ignored:
        logger.warning("%s: fields ignored (they change nothing here): %s", endpoint or model.__name__,
                       ", ".join(ignored))
    return request


def _as_api_error(e: ValidationError) -> APIError:
    errors = e.errors(include_url=False)
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


def _location(loc: tuple) -> str:
    """`messages[0].content` from pydantic's ('messages', 0, 'content', 'list[TextPart]', ...):
    the union members' names pydantic inserts are not part of the request's shape."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part in _FIELD_NAMES:
            text += f".{part}" if text else part
    return text


_FIELD_NAMES = {name for model in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, StreamOptions,
                                   ResponseFormat, JSONSchemaFormat, StructuredOutputsRequest, FunctionCall,
                                   ToolCallItem, FunctionDefinition, Tool, FunctionName, NamedToolChoice,
                                   TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest)
                for name in model.model_fields} | {"schema", "json"} | set(ChatCompletionRequest.refused) \
    | set(CompletionRequest.refused)  # the aliases, the refused fields


def add_field_names(*models: type[_Strict]) -> None:
    """Let errors name the fields (and refused fields) of request models defined in other
    modules (responses_protocol)."""
    _FIELD_NAMES.update(name for model in models for name in (*model.model_fields, *model.refused))
