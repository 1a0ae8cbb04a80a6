"""What a web page or a stalling client can send the server, and where the TP store listens.

One server process (test_server's, bound to 127.0.0.1, but named by default: no
--served-model-name) serves the module, with one allowed origin and a short
--request-read-timeout; after every refused request it must still answer a completion. A
server bound elsewhere is built in-process with `build_app` and called as an ASGI app, since
only its Host policy is under test.
"""

import asyncio
import json
import socket
import struct
import time
from pathlib import Path

import pytest
import requests

from conftest import make_tiny_checkpoint
from nanovllm.config import EngineConfig
from nanovllm.distributed.rendezvous import open_store
from nanovllm.engine.async_engine import AsyncLLMEngine
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.entrypoints.metrics import ServerMetrics
from nanovllm.entrypoints.openai_server import build_app, served_name
from test_server import API_KEY, Server

NAME = "tiny-model"  # the checkpoint directory's name: what the API calls the model by default
ALLOWED = "http://allowed.example:3000"
READ_TIMEOUT = 2.0
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("hardening") / NAME)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    server = Server(checkpoint, tmp_path_factory.mktemp("hardening-logs") / "server.log",
                    "--api-key", API_KEY, "--allowed-origins", ALLOWED, "--request-read-timeout", str(READ_TIMEOUT),
                    name=None)
    server.wait_ready()
    yield server
    server.stop()


def post(server: Server, path: str = "/v1/completions", body: dict | None = None, **headers) -> requests.Response:
    body = body or {"prompt": "Hello", "max_tokens": 2}
    return requests.post(f"{server.url}{path}", data=json.dumps(body), timeout=60,
                         headers={"Authorization": f"Bearer {API_KEY}", **JSON, **headers})


def assert_openai_error(response: requests.Response, status: int, *words: str):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert all(word in error["message"] for word in words), error["message"]


def assert_still_serving(server: Server):
    ok = post(server)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2, ok.text


# ----- Host (DNS rebinding) -----

@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "localhost.evil.example", "127.0.0.1.nip.io",
                                  "0.0.0.0:8000", "[::2]"])
def test_foreign_host_is_refused(server, host):
    assert_openai_error(post(server, Host=host), 400, repr(host), "loopback")
    assert_openai_error(requests.get(f"{server.url}/health", headers={"Host": host}, timeout=10), 400)
    assert_still_serving(server)


def test_loopback_hosts_are_served(server):
    for host in ["localhost", f"localhost:{server.port}", "LocalHost", f"127.0.0.1:{server.port}", "127.1.2.3",
                 "[::1]", f"[::1]:{server.port}"]:
        response = post(server, Host=host)
        assert response.status_code == 200, (host, response.text)


def _asgi_get(app, path: str, headers: dict[str, str]) -> int:
    """The status of GET `path`, the app called directly as uvicorn would call it."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
             "client": ("10.0.0.2", 40000), "server": ("10.0.0.1", 8000)}
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent[0]["status"]


def test_server_bound_elsewhere_does_not_check_host(checkpoint):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=str(checkpoint), dtype="float32", num_kvcache_blocks=16,
                                                   enforce_eager=True)))
    for bind, status in [("0.0.0.0", 200), ("10.0.0.1", 200), ("::", 200), ("127.0.0.1", 400), ("::1", 400)]:
        app = build_app(engine, NAME, ServerMetrics(NAME), host=bind)
        assert _asgi_get(app, "/v1/models", {"Host": "inference.example:8000"}) == status, bind
        assert _asgi_get(app, "/v1/models", {"Host": "localhost:8000"}) == 200, bind


# ----- Origin (cross-site requests) -----

def test_foreign_origin_is_refused(server):
    for origin in ["http://evil.example", "http://localhost:3000", "null", ALLOWED + "0"]:
        response = post(server, Origin=origin)
        assert_openai_error(response, 403, origin, "--allowed-origins")
        assert "access-control-allow-origin" not in response.headers
        preflight = requests.options(f"{server.url}/v1/completions", timeout=10, headers={
            "Origin": origin, "Access-Control-Request-Method": "POST"})
        assert_openai_error(preflight, 403, origin)
        assert "access-control-allow-origin" not in preflight.headers
    # The refusal comes before the API key's check.
    assert_openai_error(post(server, Origin="http://evil.example", Authorization="Bearer wrong"), 403)
    assert_still_serving(server)


def test_allowed_origin_gets_cors_headers(server):
    preflight = requests.options(f"{server.url}/v1/chat/completions", timeout=10, headers={
        "Origin": ALLOWED, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "authorization, content-type"
    response = post(server, Origin=ALLOWED)
    assert response.status_code == 200, response.text
    assert response.headers["access-control-allow-origin"] == ALLOWED
    # Errors carry the header too, so that the page can read them.
    refused = post(server, Origin=ALLOWED, Authorization="Bearer wrong")
    assert_openai_error(refused, 401)
    assert refused.headers["access-control-allow-origin"] == ALLOWED


def test_own_origin_and_no_origin_are_served(server):
    for origin in [f"http://127.0.0.1:{server.port}", f"http://LOCALHOST:{server.port}"]:
        host = origin.removeprefix("http://")
        assert post(server, Origin=origin, Host=host).status_code == 200, origin
    assert post(server).status_code == 200  # curl and the openai client send no Origin


# ----- Content-Type (text/plain is what a page may POST without a preflight) -----

@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonp", None])
def test_non_json_bodies_get_415(server, path, content_type):
    body = {"prompt": "Hello", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    if content_type is not None:
        headers["Content-Type"] = content_type
    response = requests.post(f"{server.url}{path}", data=json.dumps(body), headers=headers, timeout=60)
    assert_openai_error(response, 415, "Content-Type: application/json",
                        repr(content_type) if content_type else "none was given")
    # The API key is checked first.
    headers["Authorization"] = "Bearer wrong"
    assert requests.post(f"{server.url}{path}", data=json.dumps(body), headers=headers, timeout=60).status_code \
        == 401
    assert_still_serving(server)


def test_json_content_type_with_parameters_is_served(server):
    for content_type in ["application/json; charset=utf-8", "Application/JSON"]:
        assert post(server, **{"Content-Type": content_type}).status_code == 200, content_type


# ----- the served name, never the checkpoint's path -----

def test_models_and_metrics_show_the_name_not_the_path(server, checkpoint):
    models = requests.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    [card] = models.json()["data"]
    assert card["id"] == card["root"] == NAME
    post(server)  # so that the per-request metrics have samples too
    metrics = requests.get(f"{server.url}/metrics", timeout=10).text
    assert f'model_name="{NAME}"' in metrics
    for text in (models.text, metrics):
        assert str(checkpoint.parent) not in text


def test_served_name_is_the_base_name():
    assert served_name("/models/Qwen3-0.6B/") == "Qwen3-0.6B"
    assert served_name("~/models/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert served_name("smollm2-135m-instruct") == "smollm2-135m-instruct"  # the default model's alias


# ----- read timeouts -----

def test_stalled_requests_are_disconnected(server):
    body = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
    headers = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
               f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode()
    stalls = {"nothing sent": b"", "half the headers": headers[:40], "half the body": headers + body[:5]}
    sockets = {}
    for name, sent in stalls.items():
        sockets[name] = socket.create_connection(("127.0.0.1", server.port))
        sockets[name].sendall(sent)
    opened = time.monotonic()
    for name, sock in sockets.items():
        with sock:
            sock.settimeout(READ_TIMEOUT + 10)
            try:
                assert sock.recv(1024) == b"", name  # closed, with nothing answered
            except ConnectionResetError:
                pass
    assert time.monotonic() - opened < READ_TIMEOUT + 5
    # A whole request, even sent in pieces, is answered.
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(headers)
        time.sleep(READ_TIMEOUT / 4)
        sock.sendall(body)
        assert sock.recv(1024).startswith(b"HTTP/1.1 200")
    assert "Traceback" not in server.log.read_text()
    assert_still_serving(server)


# ----- the TP rendezvous store -----

def _listening(port: int) -> set[str]:
    """The addresses with a socket listening on TCP `port`, read from /proc/net/tcp and tcp6."""
    addresses = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table) as f:
            for line in list(f)[1:]:
                local, state = line.split()[1], line.split()[3]
                address, port_hex = local.split(":")
                if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                    # The kernel prints each 32-bit word of the address in host byte order.
                    words = [int(address[i:i + 8], 16) for i in range(0, len(address), 8)]
                    addresses.add(socket.inet_ntop(family, struct.pack(f"={len(words)}I", *words)))
    return addresses


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_store_listens_on_its_host_only():
    master = open_store("127.0.0.1", 0, 2, is_master=True)
    assert master.port > 0
    assert _listening(master.port) == {"127.0.0.1"}
    client = open_store("127.0.0.1", master.port, 2, is_master=False)
    client.set("key", "value")
    assert master.get("key") == b"value"
