"""Fuzzing both endpoints of a real server with bodies drawn from the request schema: every
field the protocol declares, each given a hostile value (huge and negative integers, NaN and
infinities, wrong types, lone surrogates, out-of-vocabulary ids) or a plausible one. No body
may get a 5xx or a failed stream, and afterwards the engine is idle and still gives the
reference greedy answer. The number of examples is bounded (and derandomized) for CI."""

import json
import math

import pytest
import requests
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from nanovllm.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from test_server import API_KEY, MODEL, Server, checkpoint, greedy, offline, wait_idle  # noqa: F401

EXAMPLES = 60

hostile_scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-2**70, max_value=2**70),
    st.sampled_from([0, 1, -1, 2, 20, 21, 319, 320, 321, 2**31, 2**63 - 1, 2**63, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e39, -1e39, 3.4e38, 1e-45, 0.5, 2.0]),
    st.text(max_size=12),
    st.sampled_from(["\ud800", "a\udfff", "", "true", "5", "<|im_end|>"]),
)
hostile = st.one_of(
    hostile_scalars,
    st.lists(hostile_scalars, max_size=4),
    st.lists(st.integers(min_value=-3, max_value=400), max_size=6),
    st.dictionaries(st.sampled_from(["include_usage", "type", "text", "x"]), hostile_scalars, max_size=2),
)
# Valid values, so that a body with one or two hostile fields gets past the other checks and
# into the engine.
plausible = {
    "max_tokens": st.integers(min_value=1, max_value=8), "n": st.integers(min_value=1, max_value=3),
    "temperature": st.floats(min_value=0, max_value=2), "top_p": st.floats(min_value=0.1, max_value=1),
    "top_k": st.integers(min_value=-1, max_value=320), "min_p": st.floats(min_value=0, max_value=1),
    "stream": st.booleans(), "min_tokens": st.integers(min_value=0, max_value=4),
    "stop_token_ids": st.lists(st.integers(min_value=0, max_value=319), max_size=3),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "seed": st.integers(min_value=-2**63, max_value=2**63 - 1),
    "repetition_penalty": st.floats(min_value=0.5, max_value=2),
    "presence_penalty": st.floats(min_value=-2, max_value=2),
}
completion_plausible = {**plausible, "logprobs": st.integers(min_value=0, max_value=5), "echo": st.booleans(),
                        "prompt": st.one_of(st.text(min_size=1, max_size=30),
                                            st.lists(st.integers(min_value=0, max_value=319), min_size=1, max_size=8))}
chat_plausible = {**plausible, "logprobs": st.booleans(),
                  "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                              "content": st.text(max_size=20)}),
                                       min_size=1, max_size=3)}


@st.composite
def bodies(draw, model, valid: dict, required: str) -> dict:
    """A valid body of `model` with one or two of its declared fields (any of them) hostile."""
    optional = {name: strategy for name, strategy in valid.items() if name != required}
    body = draw(st.fixed_dictionaries({required: valid[required]}, optional=optional))
    for name in draw(st.lists(st.sampled_from(sorted(model.model_fields)), min_size=1, max_size=2, unique=True)):
        body[name] = draw(hostile)
    return body


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):  # noqa: F811
    server = Server(checkpoint, tmp_path_factory.mktemp("fuzz-logs") / "server.log", "--api-key", API_KEY)
    server.wait_ready()
    yield server
    server.stop()


def send(server: Server, path: str, body: dict) -> None:
    data = json.dumps(body, allow_nan=True)  # NaN and Infinity, which Python's JSON reader accepts
    response = requests.post(f"{server.url}{path}", data=data, timeout=60,
                             headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    assert response.status_code < 500, (body, response.text)
    if response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream"):
        assert '"server_error"' not in response.text, (body, response.text)


def fuzz_settings():
    return settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@fuzz_settings()
@given(body=bodies(CompletionRequest, completion_plausible, "prompt"))
# Bodies that once killed the engine for good.
@example(body={"prompt": "Hello", "max_tokens": 8, "min_tokens": 4, "temperature": math.inf})
@example(body={"prompt": "Hello", "max_tokens": 8, "min_tokens": 4, "temperature": 1e39})
@example(body={"prompt": "Hello", "max_tokens": 8, "min_tokens": 1, "stop_token_ids": [49152]})
@example(body={"prompt": "Hello", "max_tokens": 8, "stop_token_ids": [2**64]})
@example(body={"prompt": "Hello", "max_tokens": 8, "top_k": 2**63, "temperature": 1.0})
def test_completions_survive_hostile_bodies(server, body):
    send(server, "/v1/completions", body)


@fuzz_settings()
@given(body=bodies(ChatCompletionRequest, chat_plausible, "messages"))
def test_chat_survives_hostile_bodies(server, body):
    send(server, "/v1/chat/completions", body)


def test_engine_is_idle_and_unchanged_after_fuzzing(server, offline):  # noqa: F811
    m = wait_idle(server)
    assert m["nanovllm:kv_cache_used_blocks"] == 0 and m["vllm:num_requests_running"] == 0
    assert m["vllm:num_requests_waiting"] == 0
    body = {"model": MODEL, "prompt": "Hello, my name is", "max_tokens": 16, "temperature": 0}
    response = requests.post(f"{server.url}/v1/completions", json=body, timeout=60,
                             headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == greedy(offline, ["Hello, my name is"])[0].text
