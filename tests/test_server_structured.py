"""Structured outputs, tool calling and logit_bias over the OpenAI API, end to end: a real server on
the default model, driven by the official `openai` client (`parse()` with pydantic models,
`tools` / `tool_choice`, streamed and not). Every constrained output is checked against its
schema with jsonschema; bad constraints are 400s naming the field, and no block leaks."""

import enum
import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from conftest import requires_default_model
from nanovllm.loader.checkpoint import open_checkpoint
from nanovllm.loader.default_model import default_model_path
from test_server import Server, wait_idle

pytestmark = requires_default_model

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
       "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather now in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "The sum of two integers", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
NAME = "smollm2"
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now?"}]


class Unit(str, enum.Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)


class Forecast(BaseModel):
    city: City
    unit: Unit
    temperatures: list[int] = Field(max_length=4)


class Book(BaseModel):
    title: str = Field(max_length=40)
    year: int
    genres: list[str] = Field(max_length=3)
    in_print: bool


class Step(BaseModel):
    explanation: str = Field(max_length=60)
    output: str = Field(max_length=20)


class MathAnswer(BaseModel):
    steps: list[Step] = Field(max_length=3)
    final_answer: str = Field(max_length=20)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("structured-server") / "server.log"
    server = Server(default_model_path(), log, "--max-model-len", "1024", "--enforce-eager", name=NAME)
    server.wait_ready(timeout=180)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _assert_idle(server):
    m = wait_idle(server)
    assert m["nanovllm:kv_cache_used_blocks"] == 0 and m["vllm:num_requests_running"] == 0


@pytest.mark.parametrize("model, question", [
    (Forecast, "Give a three-day temperature forecast for Lyon."),
    (Book, "Describe a classic novel."),
    (MathAnswer, "What is 12 plus 30? Show your steps."),
])
def test_parse_returns_the_pydantic_object(client, model, question):
    completion = client.chat.completions.parse(model=NAME, messages=[
        {"role": "user", "content": question}], response_format=model, temperature=0, max_tokens=400)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, model)


def test_json_schema_n3_at_temperature_1(client, server):
    completion = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Report the weather as JSON."}], n=3,
        temperature=1.0, seed=7, max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}})
    assert len(completion.choices) == 3
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), WEATHER)
    _assert_idle(server)


def test_json_object_on_completions(client):
    completion = client.completions.create(model=NAME, prompt="A JSON object describing a dog:",
                                           max_tokens=120, temperature=0, extra_body={"response_format": {
                                               "type": "json_object"}})
    choice = completion.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.text), dict)
    else:
        assert choice.text.startswith("{")


def test_regex_and_choice_hold(client):
    date = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    completion = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "On which date did Apollo 11 land?"}],
        temperature=1.0, n=2, max_tokens=20, extra_body={"structured_outputs": {"regex": date}})
    for choice in completion.choices:
        assert re.fullmatch(date, choice.message.content), choice.message.content
    completion = client.completions.create(
        model=NAME, prompt="Is the sky blue? Answer:", temperature=1.0, n=3, max_tokens=10,
        extra_body={"structured_outputs": {"choice": [" yes", " no"]}})
    assert all(choice.text in (" yes", " no") and choice.finish_reason == "stop" for choice in completion.choices)


def test_logit_bias_steers_and_bans(client):
    tokenizer = open_checkpoint(default_model_path()).tokenizer()

    def first_token(**fields) -> str:
        return client.completions.create(model=NAME, prompt="The capital of France is",
                                         max_tokens=1, temperature=0, **fields).choices[0].text

    greedy = first_token()
    [greedy_id] = tokenizer.encode(greedy, add_special_tokens=False)
    assert first_token(logit_bias={str(greedy_id): -100}) != greedy
    [banana] = tokenizer.encode(" banana", add_special_tokens=False)
    assert first_token(logit_bias={str(banana): 100}) == " banana"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_match_their_schemas(client, tool_choice, stream):
    kwargs = dict(model=NAME, messages=ASK_WEATHER, tools=TOOLS, tool_choice=tool_choice,
                  temperature=0, max_tokens=120)
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            choice = chunk.choices[0]
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
        calls = [calls[i] for i in sorted(calls)]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        finish = choice.finish_reason
        assert choice.message.content is None
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls]
    assert finish == "tool_calls" and calls
    for call in calls:
        assert call["id"].startswith("call_")
        if isinstance(tool_choice, dict):
            assert call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


class UserDetail(BaseModel):  # instructor's example: pydantic's schema says nothing of other keys
    name: str = Field(max_length=20)
    age: int


def _object_keys(value) -> list[set]:
    """The key sets of every object in a JSON value."""
    if isinstance(value, dict):
        return [set(value)] + [keys for v in value.values() for keys in _object_keys(v)]
    if isinstance(value, list):
        return [keys for v in value for keys in _object_keys(v)]
    return []


def test_no_undeclared_properties_over_20_samples(client):
    schema = UserDetail.model_json_schema()
    assert "additionalProperties" not in schema
    tools = [{"type": "function", "function": {"name": "UserDetail", "parameters": schema}}]
    completion = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Extract: Jason is 25 years old and likes hiking."}],
        tools=tools, tool_choice={"type": "function", "function": {"name": "UserDetail"}}, n=20, seed=0,
        temperature=1.0, max_tokens=60)
    complete = [c for c in completion.choices if c.finish_reason == "tool_calls"]
    assert len(complete) >= 15
    for choice in complete:
        arguments = json.loads(choice.message.tool_calls[0].function.arguments)
        assert all(keys <= {"name", "age"} for keys in _object_keys(arguments)), arguments


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice, max_tokens, stop, finish", [
    ("required", 12, None, "length"), ({"type": "function", "function": {"name": "get_weather"}}, 4, None, "length"),
    ({"type": "function", "function": {"name": "get_weather"}}, 120, [","], "stop")])
def test_a_forced_call_cut_short(client, tool_choice, max_tokens, stop, finish, stream):
    """One rule, streamed or not, for a call cut by max_tokens or a stop string: no partial call,
    nothing of it as content."""
    kwargs = dict(model=NAME, messages=ASK_WEATHER, tools=TOOLS, tool_choice=tool_choice, temperature=0,
                  max_tokens=max_tokens, stop=stop)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        got_finish = chunks[-1].choices[0].finish_reason
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        content, calls, got_finish = choice.message.content or "", choice.message.tool_calls or [], choice.finish_reason
    assert (content, calls, got_finish) == ("", [], finish)


def test_conversation_with_a_tool_result_continues(client):
    first = client.chat.completions.create(model=NAME, messages=ASK_WEATHER, tools=TOOLS,
                                           tool_choice="required", parallel_tool_calls=False, temperature=0,
                                           max_tokens=120).choices[0].message
    assert len(first.tool_calls) == 1
    messages = ASK_WEATHER + [first.model_dump(exclude_none=True),
                              {"role": "tool", "tool_call_id": first.tool_calls[0].id,
                               "content": json.dumps({"temperature": 21, "unit": "C", "sky": "sunny"})}]
    reply = client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS,
                                           temperature=0, max_tokens=40).choices[0]
    assert reply.finish_reason in ("stop", "length") and reply.message.content


@pytest.mark.parametrize("request_fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "no_such_tool"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, "tools"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"),
    ({"logit_bias": {"12": 101}}, "logit_bias[12]"),
    ({"logit_bias": {"twelve": 1}}, "logit_bias"),
])
def test_bad_constraints_are_400s_naming_the_field(client, server, request_fields, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, extra_body=request_fields)
    assert error.value.body["param"] == param, error.value.body
    _assert_idle(server)
    ok = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")
