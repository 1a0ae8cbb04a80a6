"""OpenAI's Responses API (/v1/responses) end to end: a real server on a tiny random checkpoint,
driven by the official `openai` client and by raw HTTP where the wire format is under test.

A random model writes junk, so greedy text is compared with /v1/chat/completions on the same
conversation (one generation path, two wire formats), and calls are forced with tool_choice for
shapes that do not depend on what the model writes. Every response object and stream event is
validated against the `openai` package's own types.
"""

import json
import typing
from pathlib import Path

import jsonschema
import openai
import pytest
import requests
from openai.types.responses import Response, ResponseStreamEvent, response_create_params
from pydantic import TypeAdapter

from conftest import make_tiny_checkpoint
from nanovllm.entrypoints.openai_server.responses import ResponseStore
from nanovllm.entrypoints.protocol import APIError
from nanovllm.entrypoints.responses_protocol import ResponsesRequest
from test_server import API_KEY, MODEL, Server, faulty_server, post, wait_idle

# The tools prompt of the hermes format alone is ~500 tokens of the tiny byte-level vocabulary.
MAX_MODEL_LEN = 2048
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER},
         {"type": "function", "name": "add", "description": "The sum of two integers", "parameters": ADD}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}} for tool in TOOLS]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
GREEDY = {"temperature": 0, "max_output_tokens": 12}
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("responses-ckpt"), max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("responses-server") / "server.log"
    server = Server(checkpoint, log, "--api-key", API_KEY, "--num-kvcache-blocks", "512")
    server.wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def create(server: Server, **body) -> dict:
    """A response as the server sent it, checked against the openai package's type."""
    response = post(server, "/v1/responses", {"model": MODEL, **body})
    assert response.status_code == 200, response.text
    data = response.json()
    Response.model_validate(data)
    assert "output_text" not in data  # the client's property, not a field
    return data


def chat(client: openai.OpenAI, messages: list[dict], max_tokens: int = 12, **extra):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                          **extra)


def text_of(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


def stream_events(server: Server, **body) -> list[dict]:
    """The events of a streamed response, each checked: its `event:` line names its type, its
    sequence number is the next one, and it parses as the openai package's event type."""
    response = post(server, "/v1/responses", {"model": MODEL, **body, "stream": True}, stream=True)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events, name = [], None
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            event = json.loads(line[len("data: "):])
            assert event["type"] == name and event["sequence_number"] == len(events)
            EVENTS.validate_python(event)
            events.append(event)
        else:
            assert line == "", line
    return events


def without_ids(response: dict) -> dict:
    """A response with the parts that differ between two identical generations left out."""
    output = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in response["output"]]
    return {**{k: v for k, v in response.items() if k not in ("id", "created_at")}, "output": output}


def test_a_string_and_items_give_chats_greedy_text(client, server):
    expected = chat(client, [{"role": "user", "content": "Hi there!"}])
    response = create(server, input="Hi there!", **GREEDY)
    assert response["object"] == "response" and response["id"].startswith("resp_")
    assert response["model"] == MODEL and response["store"] is True
    [message] = response["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["id"].startswith("msg_")
    assert message["content"][0]["type"] == "output_text" and message["content"][0]["annotations"] == []
    assert text_of(response) == expected.choices[0].message.content
    usage = response["usage"]
    assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == \
        (expected.usage.prompt_tokens, expected.usage.completion_tokens, expected.usage.total_tokens)
    # Items, with instructions, as the chat conversation they stand for.
    expected = chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"},
                             {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again?"}])
    response = client.responses.create(model=MODEL, instructions="Be brief.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Hi there!"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"type": "message", "role": "user", "content": "Again?"}], **GREEDY)
    assert response.output_text == expected.choices[0].message.content
    assert response.instructions == "Be brief."


def test_max_output_tokens_makes_an_incomplete_response(client, server):
    assert chat(client, [{"role": "user", "content": "Hi there!"}], max_tokens=3).choices[0].finish_reason == "length"
    response = create(server, input="Hi there!", temperature=0, max_output_tokens=3)
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete" and response["usage"]["output_tokens"] == 3
    assert response["max_output_tokens"] == 3


def test_streamed_events_in_order_end_with_the_whole_response(client, server):
    whole = create(server, input="Hi there!", **GREEDY)
    events = stream_events(server, input="Hi there!", **GREEDY)
    types = [event["type"] for event in events]
    deltas = types.count("response.output_text.delta")
    assert deltas >= 1
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     f"response.{whole['status']}"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == text_of(whole)
    final = events[-1]["response"]
    assert without_ids(final) == without_ids(whole)
    assert {e["response"]["id"] for e in (events[0], events[1], events[-1])} == {final["id"]}
    assert events[-2]["item"] == final["output"][0]
    # The client parses every event.
    parsed = list(client.responses.create(model=MODEL, input="Hi there!", stream=True, **GREEDY))
    assert [event.type for event in parsed] == types and parsed[-1].response.output_text == text_of(whole)


def test_a_forced_call_then_its_output_by_items_and_by_previous_response_id(client, server):
    first = create(server, input="What is the weather in Paris?", tools=TOOLS,
                   tool_choice={"type": "function", "name": "get_weather"}, temperature=0, max_output_tokens=80)
    assert first["status"] == "completed"
    [call] = first["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["status"] == "completed"
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    jsonschema.validate(json.loads(call["arguments"]), WEATHER)
    assert first["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert [tool["name"] for tool in first["tools"]] == ["get_weather", "add"]
    # The chat conversation the next request stands for.
    expected = chat(client, [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": call["call_id"], "type": "function", "function": {
            "name": "get_weather", "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["call_id"], "content": "Sunny, 21 C"}], tools=CHAT_TOOLS)
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny, 21 C"}
    by_items = create(server, input=[{"role": "user", "content": "What is the weather in Paris?"}, call, result],
                      tools=TOOLS, **GREEDY)
    by_id = create(server, previous_response_id=first["id"], input=[result], tools=TOOLS, **GREEDY)
    assert text_of(by_items) == text_of(by_id) == expected.choices[0].message.content
    assert by_id["previous_response_id"] == first["id"]
    assert by_id["usage"]["input_tokens"] == expected.usage.prompt_tokens


def test_instructions_are_not_carried_over(client, server):
    first = create(server, instructions="Be brief.", input="Hi there!", **GREEDY)
    second = create(server, previous_response_id=first["id"], input="And then?", **GREEDY)
    expected = chat(client, [{"role": "user", "content": "Hi there!"},
                             {"role": "assistant", "content": text_of(first)},
                             {"role": "user", "content": "And then?"}])
    assert text_of(second) == expected.choices[0].message.content and second["instructions"] is None


def test_streamed_calls(client, server):
    # A named function's arguments stream as they are written.
    events = stream_events(server, input="Weather?", tools=TOOLS, tool_choice={"type": "function", "name": "add"},
                           temperature=0, max_output_tokens=40)
    types = [event["type"] for event in events]
    assert types[2] == "response.output_item.added" and events[2]["item"]["type"] == "function_call"
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    [call] = events[-1]["response"]["output"]
    assert "".join(deltas) == events[-3]["arguments"] == call["arguments"]
    jsonschema.validate(json.loads(call["arguments"]), ADD)
    assert events[-2]["item"] == call
    # required: every call whole, each an item of its own; the same as the whole response's.
    body = {"input": "Weather?", "tools": TOOLS, "tool_choice": "required", "temperature": 0,
            "max_output_tokens": 120}
    events = stream_events(server, **body)
    whole = create(server, **body)
    assert without_ids(events[-1]["response"]) == without_ids(whole)
    for item in whole["output"]:
        assert item["type"] == "function_call"
        jsonschema.validate(json.loads(item["arguments"]), SCHEMAS[item["name"]])
    # The client's stream helper accumulates the same response.
    with client.responses.stream(model=MODEL, **body) as stream:
        final = stream.get_final_response()
    assert final.status == "completed"
    assert [(item.name, item.arguments) for item in final.output] == \
        [(item["name"], item["arguments"]) for item in whole["output"]]


def test_text_format_json_schema(client, server):
    response = client.responses.create(model=MODEL, input="The sum as JSON.", temperature=0, max_output_tokens=60,
                                       text={"format": {"type": "json_schema", "name": "sum", "schema": ADD,
                                                        "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), ADD)
    assert response.text.format.type == "json_schema" and response.text.format.name == "sum"
    # It holds messages' text: a forced call writes none (the Agents SDK sends both with an output type).
    called = create(server, input="Add 2 and 3.", tools=TOOLS, tool_choice={"type": "function", "name": "add"},
                    text={"format": {"type": "json_schema", "name": "sum", "schema": WEATHER}}, temperature=0,
                    max_output_tokens=40)
    [call] = called["output"]
    assert call["type"] == "function_call"
    jsonschema.validate(json.loads(call["arguments"]), ADD)


def test_get_and_delete_stored_responses(client, server):
    stored = create(server, input="Hi there!", **GREEDY)
    got = requests.get(f"{server.url}/v1/responses/{stored['id']}", timeout=10,
                       headers={"Authorization": f"Bearer {API_KEY}"})
    assert got.status_code == 200 and got.json() == stored
    deleted = requests.delete(f"{server.url}/v1/responses/{stored['id']}", timeout=10,
                              headers={"Authorization": f"Bearer {API_KEY}"})
    assert deleted.status_code == 200
    assert deleted.json() == {"id": stored["id"], "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stored["id"])
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.create(model=MODEL, previous_response_id=stored["id"], input="x", max_output_tokens=2)
    assert error.value.body["param"] == "previous_response_id"
    # store false keeps nothing; the streamed response is stored too.
    unstored = create(server, input="Hi there!", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored["id"])
    streamed = stream_events(server, input="Hi there!", max_output_tokens=2)[-1]["response"]
    assert client.responses.retrieve(streamed["id"]).to_dict() == streamed


def test_every_field_of_openais_request_is_honoured_ignored_or_refused():
    fields = set(typing.get_type_hints(response_create_params.ResponseCreateParamsBase)) | {"stream"}
    known = set(ResponsesRequest.model_fields) | ResponsesRequest.harmless | set(ResponsesRequest.refused)
    assert fields - known == set()


def test_the_store_evicts_the_oldest():
    store = ResponseStore(capacity=2)
    for i in range(3):
        store.put({"id": f"resp_{i}"}, [])
    with pytest.raises(APIError) as error:
        store.conversation("resp_0")
    assert error.value.status == 404 and error.value.param == "previous_response_id"
    assert store.response("resp_1") == {"id": "resp_1"} and store.response("resp_2") == {"id": "resp_2"}


@pytest.mark.parametrize("body, status, param, message", [
    ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input", "'reasoning'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]}, 400,
     "input", "text only"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]}]}, 400,
     "input", "text only"),
    ({"input": "x", "previous_response_id": "resp_unknown"}, 404, "previous_response_id", "resp_unknown"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools", "function tools only"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "sub"}}, 400, "tool_choice",
     "'sub'"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "nonsense"}}}}, 400,
     "text.format.schema", "text.format.schema"),
    ({"input": "x", "background": True}, 400, "background", "background"),
    ({"input": "x" * 3000}, 400, "input", f"max_model_len={MAX_MODEL_LEN}"),
    ({"input": []}, 400, "input", "non-empty"),
], ids=["unknown item", "image part", "file output", "unknown previous", "other tool", "unknown function",
        "bad schema", "background", "too long", "no input"])
def test_bad_requests_get_openai_errors(server, body, status, param, message):
    response = post(server, "/v1/responses", {"model": MODEL, **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and message in error["message"], error
    # ...and the server keeps serving.
    assert create(server, input="still there?", max_output_tokens=2)["usage"]["output_tokens"] == 2
    assert wait_idle(server)["nanovllm:kv_cache_used_blocks"] == 0


def test_a_failing_step_is_an_error_event_and_the_server_goes_on(checkpoint, tmp_path):
    server = faulty_server(checkpoint, tmp_path, "step")  # fails the steps of requests at temperature 1.5
    try:
        server.wait_ready()
        events = stream_events(server, input="x", temperature=1.5, max_output_tokens=4)
        assert [event["type"] for event in events] == ["response.created", "response.in_progress", "error"]
        assert events[-1]["code"] == "server_error" and "server log" in events[-1]["message"]
        failed = post(server, "/v1/responses", {"input": "x", "temperature": 1.5, "max_output_tokens": 4})
        assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
        assert create(server, input="x", max_output_tokens=4, temperature=0)["usage"]["output_tokens"] == 4
    finally:
        server.stop()


def test_the_agents_sdks_default_model_runs_a_tool_loop(server):
    """Optional: runs where `openai-agents` is installed. Turn one is forced to call the tool; turn
    two sends its output back and is held to the agent's output type, which ends the run."""
    agents = pytest.importorskip("agents")
    from pydantic import BaseModel, Field

    class Answer(BaseModel):
        total: int = Field(ge=0, le=999)

    calls = []

    @agents.function_tool
    def add(a: typing.Annotated[int, Field(ge=0, le=99)], b: typing.Annotated[int, Field(ge=0, le=99)]) -> str:
        """The sum of two integers."""
        calls.append((a, b))
        return str(a + b)

    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY,
                                                        max_retries=0), use_for_tracing=False)
    agents.set_default_openai_api("responses")
    agent = agents.Agent(name="adder", instructions="Add.", tools=[add], model=MODEL, output_type=Answer,
                         model_settings=agents.ModelSettings(tool_choice="add", temperature=0, max_tokens=60))
    result = agents.Runner.run_sync(agent, "What is 2 plus 3?", max_turns=3)
    assert len(calls) == 1 and isinstance(result.final_output, Answer)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"


def test_langchains_chat_openai_on_the_responses_api_runs_a_tool_loop(server):
    """Optional: runs where `langchain-openai` is installed."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, model=MODEL,
                                      use_responses_api=True, temperature=0, max_tokens=40, max_retries=0)
    question = [HumanMessage("What is 2 plus 3?")]
    reply = llm.bind_tools(CHAT_TOOLS, tool_choice="add").invoke(question)
    [call] = reply.tool_calls
    assert call["name"] == "add"
    jsonschema.validate(call["args"], ADD)
    answer = llm.bind_tools(CHAT_TOOLS, tool_choice="none").invoke(
        [*question, reply, ToolMessage(content="5", tool_call_id=call["id"])])
    assert answer.tool_calls == [] and answer.text
