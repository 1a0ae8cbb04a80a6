"""The OpenAI-compatible server end to end: a real server process on localhost, driven by the
official `openai` client (and by raw HTTP where the wire format itself is under test).

One server (with an API key) serves the module; a second one is shut down by SIGTERM. Greedy
outputs are compared with the offline engine on the same checkpoint and settings.
"""

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from conftest import make_tiny_checkpoint
from nanovllm import LLM, SamplingParams

MODEL = "tiny"
API_KEY = "test-key"
ENGINE_FLAGS = ["--dtype", "float32", "--num-kvcache-blocks", "128"]
MAX_MODEL_LEN = 256  # the tiny checkpoint's max_position_embeddings
LONG = 240  # max_tokens of a request that is still running when the test acts on it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVE = [sys.executable, "-m", "nanovllm.entrypoints.openai_server"]


class Server:
    """`launcher` (a command line that takes serve's flags) on a free port, served as `name`
    (None: the server's default name)."""

    def __init__(self, checkpoint: Path, log: Path, *flags: str, name: str | None = MODEL,
                 launcher: list[str] = SERVE):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        naming = ["--served-model-name", name] if name is not None else []
        cmd = [*launcher, "--model", str(checkpoint), *naming, "--port", str(self.port), *ENGINE_FLAGS, *flags]
        with open(log, "w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                         cwd=Path(__file__).resolve().parents[1])

    def wait_ready(self, timeout: float = 90):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if requests.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        pytest.fail(f"server not ready after {timeout} s:\n{self.log.read_text()}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("server-ckpt"))


@pytest.fixture(scope="module")
def servers(checkpoint, tmp_path_factory):
    """Both servers start at once (each spends seconds importing); teardown stops them."""
    logs = tmp_path_factory.mktemp("server-logs")
    main = Server(checkpoint, logs / "main.log", "--api-key", API_KEY)
    doomed = Server(checkpoint, logs / "doomed.log", "--shutdown-timeout", "0")
    yield {"main": main, "doomed": doomed}
    main.stop()
    doomed.stop()


@pytest.fixture(scope="module")
def server(servers) -> Server:
    servers["main"].wait_ready()
    return servers["main"]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(checkpoint) -> LLM:
    return LLM(str(checkpoint), dtype="float32", num_kvcache_blocks=128)


def greedy(llm: LLM, prompts, max_tokens: int = 16, chat: bool = False):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.chat(prompts, params, use_tqdm=False) if chat else llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def metrics(server: Server) -> dict[str, float]:
    """Every sample of /metrics by name (labels dropped: each name has one series here, except
    request_success, summed over its finish reasons)."""
    text = requests.get(f"{server.url}/metrics", timeout=10).text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name
            if "finished_reason" in sample.labels:
                key += "{" + sample.labels["finished_reason"] + "}"
            samples[key] = samples.get(key, 0.0) + sample.value
    return samples


def wait_idle(server: Server, timeout: float = 10) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        idle = m["nanovllm:kv_cache_used_blocks"] == 0 and m["vllm:num_requests_running"] == 0 \
            and m["vllm:num_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def sse(response: requests.Response) -> list:
    """The `data:` payloads of a server-sent-event stream, decoded ([DONE] kept as is)."""
    events = []
    for line in response.iter_lines(decode_unicode=True):
        if line:
            assert line.startswith("data: "), line
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def post(server: Server, path: str, body, key: str | None = API_KEY, **kwargs) -> requests.Response:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(f"{server.url}{path}", data=data, headers=headers, timeout=60, **kwargs)


PROMPTS = ["Hello, my name is", "The capital of France", "ab" * 20, "¿Qué tal? 日本語 ✓"]


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_completions_match_offline_greedy(client, offline):
    expected = greedy(offline, PROMPTS)
    out = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=16, temperature=0)
    assert [c.index for c in out.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in out.choices] == [e.text for e in expected]
    assert [c.finish_reason for c in out.choices] == [e.finish_reason for e in expected]
    tokenizer = offline.get_tokenizer()
    assert out.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in PROMPTS)
    assert out.usage.completion_tokens == sum(len(e.token_ids) for e in expected)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    # Token ids are prompts too.
    ids = tokenizer.encode(PROMPTS[0])
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0).choices[0].text \
        == expected[0].text


def test_completion_stream(client, offline):
    expected = greedy(offline, PROMPTS[3:])[0]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    # Deltas are whole characters (the prompt and output hold multi-byte ones) and add up.
    assert "".join(c.choices[0].text for c in chunks[:-1]) == expected.text
    assert chunks[-2].choices[0].finish_reason == expected.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_chat(client, server, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    expected = greedy(offline, [messages], max_tokens=12, chat=True)[0]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12, temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text
    assert out.usage.completion_tokens == len(expected.token_ids)
    # The wire format: role first, then content, then finish_reason, then usage, then [DONE].
    response = post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}, stream=True)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse(response)
    assert events[-1] == "[DONE]"
    first, *middle, last_choice, usage, _ = events
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"]["content"] for e in middle) == expected.text
    assert all(e["choices"][0]["finish_reason"] is None and e["usage"] is None for e in middle)
    assert last_choice["choices"][0]["finish_reason"] == expected.finish_reason
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(expected.token_ids)
    assert usage["usage"]["prompt_tokens"] == out.usage.prompt_tokens


def test_n_and_seed(client):
    def sample():
        return client.completions.create(model=MODEL, prompt="Once upon a time", n=3, max_tokens=8,
                                         temperature=1.0, seed=7, extra_body={"ignore_eos": True})

    out = sample()
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 3 * 8
    assert [c.text for c in sample().choices] == [c.text for c in out.choices]  # the seed is honoured
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                                 max_tokens=4, temperature=1.0, stream=True))
    finished = [c.choices[0].index for c in chunks if c.choices[0].finish_reason is not None]
    assert sorted(finished) == [0, 1]


def test_stop_strings(client, offline):
    text = greedy(offline, [PROMPTS[0]], max_tokens=24)[0].text
    assert len(text) >= 8, "the greedy output is too short to pick a stop string from"
    stop = text[5:7]
    expected = text[:text.index(stop)]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                    stop=["never-generated", stop])
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_and_echo(client, offline):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    # The top 2 plus the chosen token, keyed by text (two tokens may decode alike, e.g. to "\ufffd").
    assert all(1 <= len(top) <= 3 and token in top for token, top in zip(lp.tokens, lp.top_logprobs))
    assert all(lp <= 0 for lp in lp.token_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    echoed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=1,
                                       echo=True)
    choice = echoed.choices[0]
    assert choice.text == PROMPTS[0] + out.choices[0].text
    num_prompt = echoed.usage.prompt_tokens
    assert len(choice.logprobs.tokens) == num_prompt + 6
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.token_logprobs[1] <= 0
    assert choice.logprobs.token_logprobs[num_prompt:] == pytest.approx(lp.token_logprobs, abs=1e-4)

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content


def test_concurrent_streams_match_offline_greedy(server, offline):
    prompts = [f"Request {i}: " + "xyz " * (i % 7) + PROMPTS[i % len(PROMPTS)] for i in range(32)]
    expected = greedy(offline, prompts)

    async def run() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)

        async def one(prompt: str) -> str:
            stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                      stream=True)
            return "".join([chunk.choices[0].text async for chunk in stream])

        async with aclient:
            return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(run()) == [e.text for e in expected]


def test_requests_do_not_wait_for_each_other(client, server):
    stream = client.completions.create(model=MODEL, prompt="a long one", max_tokens=LONG, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    short = client.completions.create(model=MODEL, prompt="a short one", max_tokens=2, temperature=0)
    assert short.choices[0].finish_reason == "length"
    assert metrics(server)["vllm:num_requests_running"] == 1  # the long one runs on
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"


def test_closing_a_stream_aborts_it(client, server):
    idle = wait_idle(server)
    assert idle["nanovllm:kv_cache_used_blocks"] == 0
    stream = client.completions.create(model=MODEL, prompt="abort me", max_tokens=LONG, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    assert metrics(server)["nanovllm:kv_cache_used_blocks"] > 0
    stream.close()
    after = wait_idle(server)
    assert after["nanovllm:kv_cache_used_blocks"] == 0
    assert after["vllm:request_success_total{abort}"] == idle.get("vllm:request_success_total{abort}", 0) + 1
    assert after["vllm:generation_tokens_total"] - idle["vllm:generation_tokens_total"] < LONG


def test_disconnecting_client_aborts_a_whole_response(server):
    before = wait_idle(server)
    body = json.dumps({"model": MODEL, "prompt": "abort me too", "max_tokens": LONG, "temperature": 0,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 10
        while metrics(server)["vllm:num_requests_running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    after = wait_idle(server)
    assert after["nanovllm:kv_cache_used_blocks"] == 0
    assert after["vllm:request_success_total{abort}"] == before.get("vllm:request_success_total{abort}", 0) + 1


def _error_cases():
    too_long = {"model": MODEL, "prompt": "x" * 300, "max_tokens": 1}
    return [
        ("malformed json", b'{"prompt": "x",', API_KEY, 400, None, "parse the JSON"),
        ("not an object", b'["x"]', API_KEY, 400, None, "JSON object"),
        ("wrong type", {"prompt": "x", "temperature": "hot"}, API_KEY, 400, "temperature", "valid number"),
        ("bool is no int", {"prompt": "x", "max_tokens": True}, API_KEY, 400, "max_tokens", "valid integer"),
        ("refused field", {"prompt": "x", "suffix": "!"}, API_KEY, 400, "suffix", "suffix is not supported"),
        ("bad prompt", {"prompt": [1.5]}, API_KEY, 400, "prompt", "prompt must be"),
        ("out of range", {"prompt": "x", "top_p": 0}, API_KEY, 400, "top_p", "top_p must be"),
        ("too many logprobs", {"prompt": "x", "logprobs": 21}, API_KEY, 400, "logprobs", "20"),
        ("unknown model", {"model": "gpt-4", "prompt": "x"}, API_KEY, 404, "model", "gpt-4"),
        ("missing key", {"prompt": "x"}, None, 401, None, "API key"),
        ("wrong key", {"prompt": "x"}, "not-the-key", 401, None, "API key"),
        ("prompt too long", too_long, API_KEY, 400, "prompt", f"max_model_len={MAX_MODEL_LEN}"),
        ("body too large", {"prompt": "x" * (2 << 20)}, API_KEY, 413, None, "1048576"),
        # Bodies that once killed the engine for good (a NaN or out-of-range id inside a step).
        ("infinite temperature", b'{"prompt":"Hello","max_tokens":8,"min_tokens":4,"temperature":Infinity}',
         API_KEY, 400, "temperature", "finite"),
        ("temperature past float32", {"prompt": "Hello", "max_tokens": 8, "min_tokens": 4, "temperature": 1e39},
         API_KEY, 400, "temperature", "float32"),
        ("stop id past the vocabulary", {"prompt": "Hello", "max_tokens": 8, "min_tokens": 1, "stop_token_ids": [49152]},
         API_KEY, 400, "stop_token_ids", "[0, 320)"),
        ("stop id past int64", {"prompt": "Hello", "max_tokens": 8, "stop_token_ids": [18446744073709551616]},
         API_KEY, 400, "stop_token_ids", "non-negative token ids"),
        ("top_k past int64", {"prompt": "Hello", "max_tokens": 8, "top_k": 9223372036854775808, "temperature": 1.0},
         API_KEY, 400, "top_k", "top_k must be"),
        ("too many prompts", {"prompt": ["x"] * 65}, API_KEY, 400, "prompt", "at most 64 prompts"),
        ("lone surrogate in the prompt", {"prompt": "abc\ud800"}, API_KEY, 400, "prompt", "lone surrogate"),
        ("lone surrogate in the model", {"model": "abc\ud800", "prompt": "x"}, API_KEY, 400, "model", "surrogate"),
    ]


@pytest.mark.parametrize("case", _error_cases(), ids=lambda case: case[0])
def test_bad_requests_get_openai_errors(server, case):
    _, body, key, status, param, message = case
    response = post(server, "/v1/completions", body, key=key)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and message in error["message"]
    # ...and the server keeps serving.
    ok = post(server, "/v1/completions", {"model": MODEL, "prompt": "still there?", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_bad_chat_requests(client):
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="top_logprobs requires logprobs"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "xml"})
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0).models.list()
    # Null means "not given", for known and unknown fields alike.
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                         extra_body={"logit_bias": None, "temperature": None})
    assert out.usage.completion_tokens == 2


def test_metrics_parse_and_move(server):
    long_prompt = "The same long prompt, long enough to fill a few KV-cache blocks. " * 2
    before = wait_idle(server)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "nanovllm:kv_cache_used_blocks", "nanovllm:prefix_cache_hit_rate", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count"):
        assert name in before
    for _ in range(2):  # the second run hits the prefix cache
        assert post(server, "/v1/completions", {"prompt": long_prompt, "max_tokens": 4}).status_code == 200
    after = metrics(server)
    assert after["vllm:prompt_tokens_total"] > before["vllm:prompt_tokens_total"]
    assert after["vllm:generation_tokens_total"] == before["vllm:generation_tokens_total"] + 8
    assert after["vllm:prefix_cache_hits_total"] > before["vllm:prefix_cache_hits_total"]
    assert after["vllm:time_to_first_token_seconds_count"] == before["vllm:time_to_first_token_seconds_count"] + 2
    assert after["vllm:inter_token_latency_seconds_count"] == before["vllm:inter_token_latency_seconds_count"] + 6
    assert after["vllm:e2e_request_latency_seconds_count"] == before["vllm:e2e_request_latency_seconds_count"] + 2


def test_health_and_unknown_routes(server):
    assert requests.get(f"{server.url}/health", timeout=10).status_code == 200
    response = requests.get(f"{server.url}/v1/nothing-here", timeout=10)
    assert response.status_code == 404 and "error" in response.json()


def test_sigterm_finishes_streams_and_exits_cleanly(servers):
    server = servers["doomed"]
    server.wait_ready()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    stream = client.completions.create(model=MODEL, prompt="interrupted", max_tokens=LONG, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    reasons = []
    for i, chunk in enumerate(stream):
        if i == 1:
            server.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
        reasons.append(chunk.choices[0].finish_reason)
    # With --shutdown-timeout 0 the stream is aborted at once, and ends properly.
    assert reasons[-1] == "abort"
    assert server.proc.wait(timeout=15) == 0
    assert time.monotonic() - signalled < 10
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{server.url}/health", timeout=2)
    assert "Traceback" not in server.log.read_text()


# Runs the server with a fault injected into its engine: `step` makes every step that samples a
# row at temperature 1.5 raise (a fault of those requests), `device` makes every step raise a
# device error (the engine cannot go on).
FAULTY_SERVER = """
import sys, torch
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.sampler import Sampler
mode = sys.argv.pop(1)
if mode == "step":
    forward = Sampler.forward
    def faulty(self, logits, batch, generator):
        if bool((batch.temperatures == 1.5).any()):
            raise RuntimeError("injected fault")
        return forward(self, logits, batch, generator)
    Sampler.forward = faulty
else:
    def faulty(self, batch):
        raise torch.AcceleratorError("injected device fault")
    ModelRunner.execute = faulty
from nanovllm.entrypoints.cli import main
sys.exit(main(["serve", *sys.argv[1:]]))
"""


def faulty_server(checkpoint: Path, tmp: Path, mode: str) -> Server:
    script = tmp / "faulty_server.py"
    script.write_text(FAULTY_SERVER)
    return Server(checkpoint, tmp / "server.log", launcher=[sys.executable, str(script), mode])


def test_a_failing_step_answers_500_and_the_server_goes_on(checkpoint, tmp_path):
    server = faulty_server(checkpoint, tmp_path, "step")
    try:
        server.wait_ready()
        failed = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4, "temperature": 1.5}, key=None)
        assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
        events = sse(post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                             "temperature": 1.5, "stream": True}, key=None))
        assert events[-2]["error"]["type"] == "server_error" and events[-1] == "[DONE]"
        ok = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4, "temperature": 0}, key=None)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        assert wait_idle(server)["nanovllm:kv_cache_used_blocks"] == 0
        assert requests.get(f"{server.url}/health", timeout=10).status_code == 200
    finally:
        server.stop()


def test_a_dead_engine_stops_the_server_with_an_error(checkpoint, tmp_path):
    server = faulty_server(checkpoint, tmp_path, "device")
    try:
        server.wait_ready()
        response = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4}, key=None)
        assert response.status_code == 503 and "injected device fault" in response.json()["error"]["message"]
        assert server.proc.wait(30) == 1
        assert "error: the engine failed, so the server stopped" in server.log.read_text()
    finally:
        server.stop()
