"""The server process and its routes: the command's options and `main` (uvicorn, signals, the
engine's lifetime and exit status), and `build_app`: the browser guards, the API-key check, the
JSON body reader with its limits, the error handlers and the routes, which hand each request to
the completions, chat, responses or messages (Anthropic's API) endpoint."""

import argparse
import functools
import json
import os
import secrets
import signal
import sys
import threading
from collections.abc import Callable, Collection

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from nanovllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from nanovllm.entrypoints.anthropic_protocol import (CountTokensRequest, MessagesRequest, anthropic_error_body,
                                                     parse_anthropic_request)
from nanovllm.entrypoints.engine_args import add_engine_arguments, engine_kwargs
from nanovllm.entrypoints.metrics import ServerMetrics
from nanovllm.entrypoints.openai_server.chat import create_chat_completion
from nanovllm.entrypoints.openai_server.completions import create_completion
from nanovllm.entrypoints.openai_server.embeddings import create_embedding
from nanovllm.entrypoints.openai_server.messages import count_message_tokens, create_message
from nanovllm.entrypoints.openai_server.responses import ResponseStore, create_response
from nanovllm.entrypoints.openai_server.serving import Serving
from nanovllm.entrypoints.openai_server.tokenize import detokenize, tokenize
from nanovllm.entrypoints.pooling_protocol import EmbeddingRequest
from nanovllm.entrypoints.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_request
from nanovllm.entrypoints.responses_protocol import ResponsesRequest
from nanovllm.entrypoints.server_guards import BrowserGuard, ReadTimeoutH11Protocol, is_loopback, parse_origins
from nanovllm.entrypoints.tool_parsers import TOOL_PARSERS


DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_PROMPTS = 64
DEFAULT_REQUEST_READ_TIMEOUT = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server options")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default: %(default)s; 0.0.0.0 exposes the server to the network); "
                            "bound to loopback, the server answers only requests whose Host names loopback")
    group.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    group.add_argument("--api-key", default=os.environ.get("NANOVLLM_API_KEY"), metavar="KEY",
                       help="require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on /v1 endpoints "
                            "(default: $NANOVLLM_API_KEY; none: no key needed)")
    group.add_argument("--served-model-name", metavar="NAME",
                       help="the model's name in the API and in /metrics (default: the base name of --model, "
                            "e.g. Qwen3-0.6B for path/to/Qwen3-0.6B; never the path)")
    group.add_argument("--allowed-origins", default="", metavar="ORIGIN[,ORIGIN...]",
                       help="browser origins (scheme://host[:port]) that may call the server cross-origin; they "
                            "get CORS headers, * allows any (default: none: a request with an Origin header "
                            "other than the server's own gets 403)")
    group.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                       help="larger request bodies get 413 (default: %(default)s)")
    group.add_argument("--max-prompts-per-request", type=int, default=DEFAULT_MAX_PROMPTS, metavar="N",
                       help="a /v1/completions request with more prompts gets 400, so that no one request "
                            "fills the batch for everyone else (default: %(default)s)")
    group.add_argument("--request-read-timeout", type=float, default=DEFAULT_REQUEST_READ_TIMEOUT,
                       metavar="SECONDS",
                       help="close the connection of a request whose headers and body have not all arrived "
                            "this many seconds after the server began waiting for it (default: %(default)s)")
    group.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), metavar="FORMAT",
                       help="the format the model writes tool calls in, for tool_choice auto: "
                            f"{', '.join(sorted(TOOL_PARSERS))} (default: told from the chat template; hermes "
                            "when it shows none)")
    group.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                       help="on SIGINT/SIGTERM, how long in-flight requests may run before they are aborted "
                            "(default: %(default)s)")
    add_engine_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from nanovllm.config import EngineConfig
    from nanovllm.engine.llm_engine import LLMEngine

    if args.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got {args.max_request_body_bytes}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.max_prompts_per_request < 1:
        raise ValueError(f"--max-prompts-per-request must be >= 1, got {args.max_prompts_per_request}")
    if not args.request_read_timeout > 0:
        raise ValueError(f"--request-read-timeout must be > 0, got {args.request_read_timeout}")
    allowed_origins = parse_origins(args.allowed_origins)
    model_name = args.served_model_name or served_name(args.model)
    metrics = ServerMetrics(model_name)
    # An engine that died cannot be revived in this process: stop serving and exit non-zero, so
    # that a supervisor restarts the server rather than it answering 503 for ever.
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(**engine_kwargs(args))), observer=metrics,
                            on_failure=lambda error: server.stop_after_failure())
    metrics.watch(engine)
    app = build_app(engine, model_name, metrics, host=args.host, api_key=args.api_key or None,
                    max_body_bytes=args.max_request_body_bytes, allowed_origins=allowed_origins,
                    max_prompts=args.max_prompts_per_request, tool_call_parser=args.tool_call_parser)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level or "info", lifespan="off",
                            http=functools.partial(ReadTimeoutH11Protocol, read_timeout=args.request_read_timeout),
                            # A backstop: our own timer aborts in-flight requests before this.
                            timeout_graceful_shutdown=args.shutdown_timeout + 5)
    server = _Server(config, on_exit=lambda: _abort_after(engine, args.shutdown_timeout))
    # uvicorn restores the previous handlers when it has shut down and then re-raises the signal
    # it caught; with handlers that do nothing, the process ends with status 0, not by the signal.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    engine.start()
    try:
        server.run()
    finally:
        engine.shutdown()
    if engine.error is not None:
        print(f"error: the engine failed, so the server stopped: {engine.error!r}", file=sys.stderr)
        return 1
    return 0


class _Server(uvicorn.Server):
    """uvicorn's server, with a hook on the first SIGINT/SIGTERM, and a stop any thread may ask for."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]):
        super().__init__(config)
        self._on_exit = on_exit
        self._exit_requested = False

    def handle_exit(self, sig, frame):
        super().handle_exit(sig, frame)
        if not self._exit_requested:
            self._exit_requested = True
            self._on_exit()

    def stop_after_failure(self):
        self.should_exit = True  # uvicorn's main loop looks at it ten times a second


def _abort_after(engine: AsyncLLMEngine, seconds: float):
    timer = threading.Timer(seconds, engine.abort_all)
    timer.daemon = True
    timer.start()


def served_name(model: str) -> str:
    """The API's default name for `--model`: its base name, never the path (which would tell
    every client where the server keeps its files); the default model's alias stays as it is."""
    return os.path.basename(os.path.abspath(os.path.expanduser(model)))


def build_app(engine: AsyncLLMEngine, model_name: str, metrics: ServerMetrics, host: str = "127.0.0.1",
              api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              allowed_origins: Collection[str] = (), max_prompts: int = DEFAULT_MAX_PROMPTS,
              tool_call_parser: str | None = None) -> FastAPI:
    """The routes, behind the browser checks for a server bound to `host`; call it before
    `engine.start()`, while this thread may still read the engine.

    Long, as a list of routes and handlers is: each is a short closure over this app's settings,
    and the request handling itself lives in serving, completions, chat and responses."""
    serving = Serving(engine, model_name, max_prompts, tool_call_parser)
    response_store = ResponseStore()
    app = FastAPI(title="nano-vllm", docs_url=None, redoc_url=None, openapi_url=None)
    if allowed_origins:  # preflights and CORS headers for them; the refusal of others is BrowserGuard's
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                           allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["*"])
    app.add_middleware(BrowserGuard, check_host=is_loopback(host), allowed_origins=allowed_origins)  # outermost

    async def check_api_key(request: Request):
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if "x-api-key" in request.headers:  # Anthropic's clients send the key so
            scheme, given = "bearer", request.headers["x-api-key"]
        if scheme.lower() != "bearer" or not given:
            raise APIError(401, "You didn't provide an API key. Send it as `Authorization: Bearer KEY` "
                                "(or `x-api-key: KEY`).", code="invalid_api_key")
        if not secrets.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    async def read_json(request: Request):
        # A page may POST text/plain cross-origin without a preflight; JSON needs one.
        content_type = request.headers.get("content-type")
        if content_type is None or content_type.partition(";")[0].strip().lower() != "application/json":
            given = f"got {content_type!r}" if content_type is not None else "none was given"
            raise APIError(415, f"The request body must be JSON, sent with Content-Type: application/json "
                                f"({given}).", code="unsupported_media_type")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body_bytes:
            raise _too_large(max_body_bytes, int(declared))
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                raise _too_large(max_body_bytes)
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise APIError(400, f"We could not parse the JSON body of your request ({e}). The body must be "
                                "a JSON object, sent with Content-Type: application/json.") from None

    def error_response(request: Request, e: APIError, headers: dict | None = None) -> JSONResponse:
        # Anthropic's clients read errors in Anthropic's shape.
        anthropic = request.url.path.startswith("/v1/messages")
        return JSONResponse(anthropic_error_body(e) if anthropic else e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return error_response(request, e)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(_: Request, e: ClientDisconnect):  # e.g. its body was not read in time
        return Response(status_code=499)  # nobody reads this

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, e: EngineDeadError):
        return error_response(request, APIError(503, str(e), type="server_error"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return error_response(request, APIError(e.status_code, str(e.detail)), headers=e.headers)

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception):  # Starlette logs it too
        return error_response(request, APIError(500, f"internal error: {e!r}", type="server_error"))

    @app.get("/health")
    async def health():
        if not engine.is_alive:
            reason = "the engine is not running" if engine.error is None else f"the engine failed: {engine.error!r}"
            raise APIError(503, reason, type="server_error")
        return Response(status_code=200)

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(check_api_key)])
    async def list_models():
        return {"object": "list", "data": [serving.model_card]}

    @app.get("/v1/models/{model:path}", dependencies=[Depends(check_api_key)])
    async def get_model(model: str):
        serving.check_model(model)
        return serving.model_card

    @app.post("/v1/completions", dependencies=[Depends(check_api_key)])
    async def completions(request: Request):
        body = parse_request(CompletionRequest, await read_json(request), "/v1/completions")
        return await create_completion(serving, body, request)

    @app.post("/tokenize", dependencies=[Depends(check_api_key)])
    async def tokenize_route(request: Request):
        return tokenize(serving, await read_json(request))

    @app.post("/detokenize", dependencies=[Depends(check_api_key)])
    async def detokenize_route(request: Request):
        return detokenize(serving, await read_json(request))

    @app.post("/v1/chat/completions", dependencies=[Depends(check_api_key)])
    async def chat_completions(request: Request):
        body = parse_request(ChatCompletionRequest, await read_json(request), "/v1/chat/completions")
        return await create_chat_completion(serving, body, request)

    @app.post("/v1/embeddings", dependencies=[Depends(check_api_key)])
    async def embeddings(request: Request):
        body = parse_request(EmbeddingRequest, await read_json(request), "/v1/embeddings")
        return await create_embedding(serving, body, request)

    @app.post("/v1/messages", dependencies=[Depends(check_api_key)])
    async def messages(request: Request):
        body = parse_anthropic_request(MessagesRequest, await read_json(request), "/v1/messages")
        return await create_message(serving, body, request)

    @app.post("/v1/messages/count_tokens", dependencies=[Depends(check_api_key)])
    async def count_tokens(request: Request):
        body = parse_anthropic_request(CountTokensRequest, await read_json(request), "/v1/messages/count_tokens")
        return count_message_tokens(serving, body)

    @app.post("/v1/responses", dependencies=[Depends(check_api_key)])
    async def responses(request: Request):
        body = parse_request(ResponsesRequest, await read_json(request), "/v1/responses")
        return await create_response(serving, response_store, body, request)

    @app.get("/v1/responses/{response_id}", dependencies=[Depends(check_api_key)])
    async def get_response(response_id: str):
        return response_store.response(response_id)

    @app.delete("/v1/responses/{response_id}", dependencies=[Depends(check_api_key)])
    async def delete_response(response_id: str):
        return response_store.delete(response_id)

    return app


def _too_large(limit: int, declared: int | None = None) -> APIError:
    size = f" ({declared} bytes)" if declared is not None else ""
    return APIError(413, f"The request body{size} exceeds the limit of {limit} bytes.", code="request_too_large")
