"""Anthropic's Messages API end to end: a real server process on a tiny random checkpoint, driven by
the official `anthropic` client (and by raw HTTP where the wire format itself is under test).

A random model writes junk, so greedy texts are compared with the offline engine, or with the chat
endpoint on the same conversation, and tool calls are forced (tool_choice tool / any) so that their
shapes are deterministic. This `anthropic` client has no sampling arguments: temperature travels
in extra_body.
"""

import json

import anthropic
import jsonschema
import openai
import pytest
import requests

from conftest import make_tiny_checkpoint
from nanovllm import LLM, SamplingParams
from test_server import Server, faulty_server, wait_idle

MODEL = "tiny"
API_KEY = "test-key"
GREEDY = {"temperature": 0}
SYSTEM = "Be brief."
HI = [{"role": "user", "content": "Hi there!"}]
# Every value bounded, so that even a random model's forced call completes in a few tokens.
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 9}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The weather now in a city", "input_schema": WEATHER},
         {"name": "add", "description": "The sum of two digits", "input_schema": ADD}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # A long context: the tools' description, in the tiny byte-level vocabulary, is hundreds of tokens.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("messages-ckpt"), max_position_embeddings=2048)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("messages-server") / "server.log"
    server = Server(checkpoint, log, "--api-key", API_KEY, "--num-kvcache-blocks", "512", name=MODEL)
    server.wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def chat_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(checkpoint) -> LLM:
    return LLM(str(checkpoint), dtype="float32", num_kvcache_blocks=512)


def offline_greedy(llm: LLM, conversation: list[dict], max_tokens: int, **template_kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return llm.chat(conversation, params, use_tqdm=False, chat_template_kwargs=template_kwargs)[0].outputs[0]


def post(server: Server, path: str, body, headers: dict | None = None, **kwargs) -> requests.Response:
    headers = {"Content-Type": "application/json", "x-api-key": API_KEY} if headers is None else headers
    data = body if isinstance(body, bytes) else json.dumps(body)
    return requests.post(f"{server.url}{path}", data=data, headers=headers, timeout=60, **kwargs)


def events(response: requests.Response) -> list[tuple[str, dict]]:
    """(name, data) of each server-sent event; every event has both lines."""
    lines = [line for line in response.iter_lines(decode_unicode=True) if line]
    assert len(lines) % 2 == 0, lines
    parsed = []
    for name_line, data_line in zip(lines[::2], lines[1::2]):
        assert name_line.startswith("event: ") and data_line.startswith("data: "), (name_line, data_line)
        parsed.append((name_line[len("event: "):], json.loads(data_line[len("data: "):])))
    return parsed


def assert_anthropic_error(response: requests.Response, status: int, error_type: str, message: str):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == error_type
    assert message in body["error"]["message"], body


def test_text_matches_offline_and_chat(client, chat_client, offline):
    expected = offline_greedy(offline, [{"role": "system", "content": SYSTEM}, *HI], max_tokens=12)
    message = client.messages.create(model=MODEL, max_tokens=12, system=SYSTEM, messages=HI, extra_body=GREEDY)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == expected.text
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[expected.finish_reason]
    assert message.stop_sequence is None
    assert message.usage.output_tokens == len(expected.token_ids)
    chat = chat_client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0,
                                               messages=[{"role": "system", "content": SYSTEM}, *HI])
    assert chat.choices[0].message.content == expected.text
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    # The system prompt as text blocks (cache_control accepted), and count_tokens, agree.
    blocks = client.messages.create(model=MODEL, max_tokens=12, messages=HI, extra_body=GREEDY,
                                    system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}])
    assert blocks.content == message.content and blocks.usage == message.usage
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=HI)
    assert counted.input_tokens == message.usage.input_tokens


def test_max_tokens(client, offline):
    expected = offline_greedy(offline, HI, max_tokens=3)
    assert expected.finish_reason == "length", "the greedy reply ends too soon to be cut"
    message = client.messages.create(model=MODEL, max_tokens=3, messages=HI, extra_body=GREEDY)
    assert message.content[0].text == expected.text
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3


def test_stop_sequences(client, offline):
    question = [{"role": "user", "content": "What is 2+2?"}]
    text = offline_greedy(offline, question, max_tokens=24).text
    # Two printable ASCII characters from the middle of the reply.
    stop = next(pair for pair in (text[i:i + 2] for i in range(4, len(text) - 1))
                if pair.isascii() and pair.isprintable())
    expected = text[:text.index(stop)]
    message = client.messages.create(model=MODEL, max_tokens=24, messages=question, extra_body=GREEDY,
                                     stop_sequences=["never-written", stop])
    assert message.content == ([anthropic.types.TextBlock(type="text", text=expected)] if expected else [])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop


def test_unknown_fields_are_ignored(client):
    plain = client.messages.create(model=MODEL, max_tokens=6, messages=HI, extra_body=GREEDY)
    lenient = client.messages.create(model=MODEL, max_tokens=6, messages=HI, service_tier="auto",
                                     thinking={"type": "enabled", "budget_tokens": 1024},
                                     metadata={"user_id": "someone"}, extra_body=GREEDY)
    assert lenient.content == plain.content and lenient.usage == plain.usage


def test_streaming_events_in_order_and_the_final_message(client, server):
    whole = client.messages.create(model=MODEL, max_tokens=12, system=SYSTEM, messages=HI, extra_body=GREEDY)
    response = post(server, "/v1/messages", {"model": MODEL, "max_tokens": 12, "system": SYSTEM, "messages": HI,
                                             "temperature": 0, "stream": True}, stream=True)
    assert response.headers["content-type"].startswith("text/event-stream")
    streamed = events(response)
    names = [name for name, _ in streamed]
    assert all(data["type"] == name for name, data in streamed)
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[3:-3] == ["content_block_delta"] * (len(names) - 6)
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = streamed[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"] == {"input_tokens": whole.usage.input_tokens, "output_tokens": 0}
    assert streamed[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert "".join(data["delta"]["text"] for _, data in streamed[3:-3]) == whole.content[0].text
    assert streamed[-2][1]["delta"] == {"stop_reason": whole.stop_reason, "stop_sequence": None}
    assert streamed[-2][1]["usage"] == {"output_tokens": whole.usage.output_tokens}
    # The client's stream helpers build the same message.
    with client.messages.stream(model=MODEL, max_tokens=12, system=SYSTEM, messages=HI, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text
    assert final.model_dump(exclude={"id"}, exclude_none=True) == whole.model_dump(exclude={"id"}, exclude_none=True)


def test_a_forced_tool_use_then_its_tool_result(client, chat_client):
    first = client.messages.create(model=MODEL, max_tokens=60, tools=TOOLS, messages=ASK_WEATHER, extra_body=GREEDY,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use" and first.stop_sequence is None
    [call] = first.content
    assert call.type == "tool_use" and call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER)
    assert client.messages.count_tokens(model=MODEL, tools=TOOLS, messages=ASK_WEATHER).input_tokens \
        == first.usage.input_tokens
    # The result goes back (a failed call's too) and the model answers: the same reply the chat
    # endpoint gives to the same conversation in OpenAI's shapes.
    conversation = [*ASK_WEATHER, {"role": "assistant", "content": [block.model_dump() for block in first.content]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": call.id, "content": "21 C, sunny"},
                        {"type": "tool_result", "tool_use_id": call.id, "is_error": True,
                         "content": [{"type": "text", "text": "timed out"}]},
                        {"type": "text", "text": "And tomorrow?"}]}]
    reply = client.messages.create(model=MODEL, max_tokens=10, tools=TOOLS, messages=conversation, extra_body=GREEDY)
    chat_conversation = [*ASK_WEATHER,
                         {"role": "assistant", "tool_calls": [{"id": call.id, "type": "function", "function": {
                             "name": call.name, "arguments": json.dumps(call.input)}}]},
                         {"role": "tool", "tool_call_id": call.id, "content": "21 C, sunny"},
                         {"role": "tool", "tool_call_id": call.id, "content": "Error: timed out"},
                         {"role": "user", "content": "And tomorrow?"}]
    chat = chat_client.chat.completions.create(
        model=MODEL, max_tokens=10, temperature=0, messages=chat_conversation,
        tools=[{"type": "function", "function": {"name": tool["name"], "description": tool["description"],
                                                 "parameters": tool["input_schema"]}} for tool in TOOLS])
    assert chat.choices[0].message.tool_calls is None
    assert [block.text for block in reply.content] == [chat.choices[0].message.content]
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]


def test_tool_choice_any_without_parallel_calls(client):
    message = client.messages.create(model=MODEL, max_tokens=80, tools=TOOLS, messages=ASK_WEATHER, extra_body=GREEDY,
                                     tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert message.stop_reason == "tool_use"
    [call] = message.content
    assert call.type == "tool_use" and call.name in SCHEMAS
    jsonschema.validate(call.input, SCHEMAS[call.name])


def test_streamed_tool_use(client, server):
    request = dict(model=MODEL, max_tokens=60, tools=TOOLS, messages=ASK_WEATHER,
                   tool_choice={"type": "tool", "name": "get_weather"})
    whole = client.messages.create(**request, extra_body=GREEDY)
    streamed = events(post(server, "/v1/messages", {**request, **GREEDY, "stream": True}, stream=True))
    names = [name for name, _ in streamed]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    block = streamed[2][1]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {}
    deltas = [data["delta"] for _, data in streamed[3:-3]]
    assert deltas and all(delta["type"] == "input_json_delta" for delta in deltas)
    assert json.loads("".join(delta["partial_json"] for delta in deltas)) == whole.content[0].input
    with client.messages.stream(**request, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", whole.content[0].input)]
    assert final.stop_reason == "tool_use" and final.usage == whole.usage


def test_a_prefill_is_continued(client, offline):
    conversation = [*HI, {"role": "assistant", "content": "Hello"}]
    expected = offline_greedy(offline, conversation, max_tokens=8, continue_final_message=True,
                              add_generation_prompt=False)
    message = client.messages.create(model=MODEL, max_tokens=8, messages=conversation, extra_body=GREEDY)
    assert message.content[0].text == expected.text


def test_output_config_holds_the_text_to_a_schema(client):
    message = client.messages.create(model=MODEL, max_tokens=60, messages=ASK_WEATHER, extra_body=GREEDY,
                                     output_config={"format": {"type": "json_schema", "schema": WEATHER}})
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), WEATHER)


def test_api_keys(client, server):
    with pytest.raises(anthropic.AuthenticationError) as error:
        anthropic.Anthropic(base_url=server.url, api_key="not-the-key", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=HI)
    assert error.value.body["type"] == "error" and error.value.body["error"]["type"] == "authentication_error"
    body = {"model": MODEL, "max_tokens": 2, "messages": HI}
    assert_anthropic_error(post(server, "/v1/messages", body, headers={"Content-Type": "application/json"}),
                           401, "authentication_error", "x-api-key")
    # Either header works on every endpoint; OpenAI's endpoints keep OpenAI's error shape.
    bearer = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    assert post(server, "/v1/messages", body, headers=bearer).status_code == 200
    assert requests.get(f"{server.url}/v1/models", headers={"x-api-key": API_KEY}, timeout=10).status_code == 200
    refused = requests.get(f"{server.url}/v1/models", headers={"x-api-key": "not-the-key"}, timeout=10)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def _bad_requests():
    ok = {"model": MODEL, "max_tokens": 4, "messages": HI}

    def user(*blocks):
        return {**ok, "messages": [{"role": "user", "content": list(blocks)}]}

    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    return [
        ("no max_tokens", {"model": MODEL, "messages": HI}, 400, "invalid_request_error", "max_tokens: Field required"),
        ("an image block", user({"type": "text", "text": "What is this?"}, image), 400, "invalid_request_error",
         "takes text only"),
        ("a document in a tool result", user({"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}),
         400, "invalid_request_error", "takes text only"),
        ("an unknown block type", user({"type": "hologram", "text": "x"}), 400, "invalid_request_error", "'hologram'"),
        ("a tool_use in a user turn", user({"type": "tool_use", "id": "toolu_1", "name": "add", "input": {}}), 400,
         "invalid_request_error", "tool_use blocks belong in assistant turns"),
        ("an unknown model", {**ok, "model": "claude-sonnet-4-5"}, 404, "not_found_error", "claude-sonnet-4-5"),
        ("a server tool", {**ok, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
         "invalid_request_error", "only custom tools"),
        ("a tool_choice naming no tool", {**ok, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
         400, "invalid_request_error", "'nope'"),
        ("tool_choice any without tools", {**ok, "tool_choice": {"type": "any"}}, 400, "invalid_request_error",
         "requires tools"),
        ("a system role in messages", {**ok, "messages": [{"role": "system", "content": "x"}]}, 400,
         "invalid_request_error", "messages.0.role"),
        ("a negative temperature", {**ok, "temperature": -1.0}, 400, "invalid_request_error", "temperature"),
        # Errors of the chat pipeline name the field as this request sent it.
        ("an empty stop sequence", {**ok, "stop_sequences": ["a", ""]}, 400, "invalid_request_error",
         "stop_sequences must be"),
        ("a bad output schema", {**ok, "output_config": {"format": {"type": "json_schema", "schema": {
            "type": "objekt"}}}}, 400, "invalid_request_error", "output_config.format.schema is not valid"),
        ("a prompt past the context", {**ok, "messages": [{"role": "user", "content": "x" * 3000}]}, 400,
         "invalid_request_error", "max_model_len"),
        ("malformed JSON", b'{"model": ', 400, "invalid_request_error", "parse the JSON"),
    ]


@pytest.mark.parametrize("case", _bad_requests(), ids=lambda case: case[0])
def test_bad_requests_get_anthropic_errors(client, server, case):
    _, body, status, error_type, message = case
    assert_anthropic_error(post(server, "/v1/messages", body), status, error_type, message)
    # ...and the server keeps serving, with nothing left behind.
    assert wait_idle(server)["nanovllm:kv_cache_used_blocks"] == 0
    assert client.messages.create(model=MODEL, max_tokens=2, messages=HI).usage.output_tokens >= 1


def test_unknown_routes_under_messages_are_anthropic_404s(server):
    assert_anthropic_error(post(server, "/v1/messages/batches", {}), 404, "not_found_error", "Not Found")


def test_a_failing_step_is_an_error_event_and_the_server_goes_on(checkpoint, tmp_path):
    server = faulty_server(checkpoint, tmp_path, "step")  # fails the steps of requests at temperature 1.5
    try:
        server.wait_ready()
        body = {"model": "tiny", "max_tokens": 4, "messages": HI, "temperature": 1.5}
        headers = {"Content-Type": "application/json"}
        assert_anthropic_error(post(server, "/v1/messages", body, headers=headers), 500, "api_error", "server log")
        streamed = events(post(server, "/v1/messages", {**body, "stream": True}, headers=headers, stream=True))
        assert [name for name, _ in streamed] == ["message_start", "ping", "error"]
        assert streamed[-1][1]["error"]["type"] == "api_error"
        ok = post(server, "/v1/messages", {**body, "temperature": 0}, headers=headers)
        assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] >= 1
    finally:
        server.stop()
