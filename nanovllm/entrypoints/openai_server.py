"""`nanovllm serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health,
GET /metrics. Every request goes through one AsyncLLMEngine, so all of them share one
continuous batch. Responses follow OpenAI's wire format, streamed ones as server-sent events.

Order of checks for a request: Host (400; only on a server bound to a loopback address, which
answers only Hosts that name loopback, so a DNS-rebinding page cannot reach it), Origin (403
unless it is the server's own or named by --allowed-origins, whose requests and preflights get
CORS headers), API key (401), Content-Type (415 unless application/json, on the POST
endpoints), body size (413), JSON (400), fields (400), model name (404), sampling values and
prompt (400); only then is anything queued. A request whose headers and body have not all
arrived within --request-read-timeout seconds has its connection closed. A client that goes
away, mid-stream or while waiting for a whole response, aborts its requests, which frees their
KV blocks at once. SIGINT/SIGTERM: stop accepting, let in-flight requests run for
--shutdown-timeout seconds, abort what is left (those streams end with finish_reason "abort"),
exit with status 0.
"""

import argparse
import asyncio
import copy
import dataclasses
import functools
import json
import os
import secrets
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection

import jinja2
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from transformers import PreTrainedTokenizerBase

from nanovllm.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from nanovllm.entrypoints.engine_args import add_engine_arguments, engine_kwargs
from nanovllm.entrypoints.metrics import ServerMetrics
from nanovllm.entrypoints.protocol import (APIError, ChatCompletionRequest, CompletionRequest, SamplingRequest,
                                           parse_request)
from nanovllm.entrypoints.server_guards import BrowserGuard, ReadTimeoutH11Protocol, is_loopback, parse_origins
from nanovllm.llm import chat_prompt
from nanovllm.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from nanovllm.sampling_params import SamplingParams


DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_PROMPTS = 64
_SAMPLING_FIELDS = {field.name for field in dataclasses.fields(SamplingParams)}
DEFAULT_REQUEST_READ_TIMEOUT = 30.0
# JSON has no -inf: a logprob that low is reported as this, as vLLM does.
MIN_LOGPROB = -9999.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server options")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default: %(default)s; 0.0.0.0 exposes the server to the network); "
                            "bound to loopback, the server answers only requests whose Host names loopback")
    group.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    group.add_argument("--api-key", default=os.environ.get("NANOVLLM_API_KEY"), metavar="KEY",
                       help="require `Authorization: Bearer KEY` on /v1 endpoints (default: $NANOVLLM_API_KEY; "
                            "none: no key needed)")
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
    group.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                       help="on SIGINT/SIGTERM, how long in-flight requests may run before they are aborted "
                            "(default: %(default)s)")
    group.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn's log level (default: %(default)s)")
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
                    max_prompts=args.max_prompts_per_request)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="off",
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
              allowed_origins: Collection[str] = (), max_prompts: int = DEFAULT_MAX_PROMPTS) -> FastAPI:
    """The routes, behind the browser checks for a server bound to `host`; call it before
    `engine.start()`, while this thread may still read the engine."""
    serving = _Serving(engine, model_name, max_prompts)
    app = FastAPI(title="nano-vllm", docs_url=None, redoc_url=None, openapi_url=None)
    if allowed_origins:  # preflights and CORS headers for them; the refusal of others is BrowserGuard's
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])
    app.add_middleware(BrowserGuard, check_host=is_loopback(host), allowed_origins=allowed_origins)  # outermost

    async def check_api_key(request: Request):
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise APIError(401, "You didn't provide an API key. Send it as `Authorization: Bearer KEY`.",
                           code="invalid_api_key")
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

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(_: Request, e: ClientDisconnect):  # e.g. its body was not read in time
        return Response(status_code=499)  # nobody reads this

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, e: EngineDeadError):
        return JSONResponse(APIError(503, str(e), type="server_error").body(), status_code=503)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code,
                            headers=e.headers)

    @app.exception_handler(Exception)
    async def server_error(_: Request, e: Exception):  # Starlette logs it too
        return JSONResponse(APIError(500, f"internal error: {e!r}", type="server_error").body(), status_code=500)

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
        body = parse_request(CompletionRequest, await read_json(request))
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_api_key)])
    async def chat_completions(request: Request):
        body = parse_request(ChatCompletionRequest, await read_json(request))
        return await serving.chat_completions(body, request)

    return app


def _too_large(limit: int, declared: int | None = None) -> APIError:
    size = f" ({declared} bytes)" if declared is not None else ""
    return APIError(413, f"The request body{size} exceeds the limit of {limit} bytes.", code="request_too_large")


class _Serving:
    """Turns API requests into engine requests and engine outputs into API responses."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, max_prompts: int):
        self.engine = engine
        self.model_name = model_name
        self.max_prompts = max_prompts
        # The server tokenizes with its own copy: the engine's tokenizer belongs to the engine thread.
        self.tokenizer: PreTrainedTokenizerBase = copy.deepcopy(engine.engine.tokenizer)
        config = engine.engine.config
        self.model_card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "nanovllm",
                           "root": model_name, "max_model_len": config.max_model_len}

    def check_model(self, model: str | None):
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    # ----- /v1/completions -----

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        # With echo, the prompt's logprobs come back too (OpenAI's legacy scoring idiom).
        params = _sampling_params(body, body.max_tokens, body.logprobs, body.logprobs if body.echo else None)
        if len(body.prompts()) > self.max_prompts:
            raise APIError(400, f"A request may hold at most {self.max_prompts} prompts, got {len(body.prompts())} "
                                "(the server's --max-prompts-per-request); send the rest in other requests.",
                           param="prompt")
        prompts = [self._encode(p) for p in body.prompts()]
        response_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await self._submit(response_id, prompts, params)
        echoes = [p.get("prompt") or self.tokenizer.decode(p["prompt_token_ids"]) for p in prompts] \
            if body.echo else None
        builder = _CompletionChoices(self, body, echoes)
        if body.stream:
            return _sse(stream, builder.stream_chunks(stream, response_id))
        finals = await _collect_unless_disconnected(stream, request)
        if finals is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        outputs = [finals[f"{response_id}-{i}"] for i in range(len(prompts))]
        for output in outputs:
            _raise_if_failed(output)
        choices = [builder.whole_choice(i, out, completion) for i, out in enumerate(outputs)
                   for completion in out.outputs]
        return JSONResponse({"id": response_id, "object": "text_completion", "created": int(time.time()),
                             "model": self.model_name, "choices": choices, "usage": _usage(outputs)})

    def _encode(self, prompt: str | list[int]) -> dict:
        if isinstance(prompt, str):
            return {"prompt": prompt, "prompt_token_ids": self.tokenizer.encode(prompt)}
        return {"prompt_token_ids": prompt}

    # ----- /v1/chat/completions -----

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = _sampling_params(body, max_tokens, top_logprobs)
        prompt = self._apply_chat_template(body)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await self._submit(response_id, [prompt], params)
        builder = _ChatChoices(self, body)
        if body.stream:
            return _sse(stream, builder.stream_chunks(stream, response_id))
        finals = await _collect_unless_disconnected(stream, request)
        if finals is None:
            return Response(status_code=499)
        output = finals[f"{response_id}-0"]
        _raise_if_failed(output)
        return JSONResponse({"id": response_id, "object": "chat.completion", "created": int(time.time()),
                             "model": self.model_name,
                             "choices": [builder.whole_choice(c) for c in output.outputs],
                             "usage": _usage([output])})

    def _apply_chat_template(self, body: ChatCompletionRequest) -> dict:
        if self.tokenizer.chat_template is None:
            raise APIError(400, "This model has no chat template; use /v1/completions.", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            return chat_prompt(self.tokenizer, messages)
        except (jinja2.TemplateError, ValueError) as e:
            raise APIError(400, f"The model's chat template rejected the messages: {e}", param="messages") from None

    # ----- shared -----

    async def _submit(self, response_id: str, prompts: list[dict], params: SamplingParams) -> RequestStream:
        request_ids = [f"{response_id}-{i}" for i in range(len(prompts))]
        try:
            return await self.engine.add_requests(request_ids, prompts, params)
        except (ValueError, TypeError) as e:  # a prompt, or a value for this model, the engine will not take
            # Messages about a sampling value start with its name ("stop_token_ids must be ...").
            field = str(e).split(" ", 1)[0]
            raise APIError(400, str(e), param=field if field in _SAMPLING_FIELDS else "prompt") from None

    def chunk(self, response_id: str, kind: str, choices: list[dict], **extra) -> dict:
        return {"id": response_id, "object": kind, "created": int(time.time()), "model": self.model_name,
                "choices": choices, **extra}


def _sampling_params(body: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                     prompt_logprobs: int | None = None) -> SamplingParams:
    try:
        return body.sampling_params(max_tokens, logprobs, prompt_logprobs)
    except ValueError as e:  # SamplingParams names the field first: "temperature must be ..."
        raise APIError(400, str(e), param=str(e).split(" ", 1)[0]) from None


class _CompletionChoices:
    """Choices of one /v1/completions response: index = prompt number * n + completion index."""

    def __init__(self, serving: _Serving, body: CompletionRequest, echoes: list[str] | None):
        self.serving = serving
        self.body = body
        self.echoes = echoes

    def whole_choice(self, prompt_index: int, output: RequestOutput, completion: CompletionOutput) -> dict:
        text, logprobs = completion.text, None
        token_ids, positions = completion.token_ids, completion.logprobs
        if self.echoes is not None:
            text = self.echoes[prompt_index] + text
            if self.body.logprobs is not None:
                token_ids = output.prompt_token_ids + token_ids
                positions = output.prompt_logprobs + positions
        if self.body.logprobs is not None:
            logprobs = self._legacy_logprobs(token_ids, positions, 0)
        return {"index": prompt_index * self.body.n + completion.index, "text": text, "logprobs": logprobs,
                "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}

    async def stream_chunks(self, stream: RequestStream, response_id: str) -> AsyncIterator[dict]:
        body = self.body
        usage_extra = {"usage": None} if body.include_usage else {}
        # Per choice index: characters and tokens of the completion sent so far.
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        finished: set[int] = set()
        finals: list[RequestOutput] = []

        def chunk(choice: dict) -> dict:
            return self.serving.chunk(response_id, "text_completion", [choice], **usage_extra)

        async for output in stream:
            _raise_if_failed(output)
            p = _prompt_number(output.request_id)
            echo = self.echoes[p] if self.echoes is not None else ""
            for completion in output.outputs:
                index = p * body.n + completion.index
                if index in finished:
                    continue
                if index not in sent_text:
                    sent_text[index] = sent_tokens[index] = 0
                    if self.echoes is not None:  # the echoed prompt comes first, in its own chunk
                        logprobs = None
                        if body.logprobs is not None:
                            logprobs = self._legacy_logprobs(output.prompt_token_ids, output.prompt_logprobs, 0)
                        yield chunk({"index": index, "text": echo, "logprobs": logprobs, "finish_reason": None})
                new_text = completion.text[sent_text[index]:]
                new_tokens = completion.token_ids[sent_tokens[index]:]
                if new_text or (new_tokens and body.logprobs is not None):
                    logprobs = None
                    if body.logprobs is not None:
                        logprobs = self._legacy_logprobs(new_tokens, completion.logprobs[sent_tokens[index]:],
                                                         len(echo) + sent_text[index])
                    yield chunk({"index": index, "text": new_text, "logprobs": logprobs, "finish_reason": None})
                    sent_text[index] += len(new_text)
                    sent_tokens[index] = len(completion.token_ids)
                if completion.finish_reason is not None:
                    finished.add(index)
                    yield chunk({"index": index, "text": "", "logprobs": None,
                                 "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason})
            if output.finished:
                finals.append(output)
        if body.include_usage:
            yield self.serving.chunk(response_id, "text_completion", [], usage=_usage(finals))

    def _legacy_logprobs(self, token_ids: list[int], positions: list[PositionLogprobs | None],
                         text_offset: int) -> dict:
        """OpenAI's legacy completions logprobs; text_offset indexes the choice's whole text."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, position in zip(token_ids, positions):
            if position is None:  # a prompt's first token has no logprob
                token, logprob, top = self.serving.tokenizer.decode([token_id]), None, None
            else:
                token, logprob = position[token_id].decoded_token, _finite(position[token_id].logprob)
                top = {entry.decoded_token: _finite(entry.logprob) for entry in position.values()}
            tokens.append(token)
            token_logprobs.append(logprob)
            top_logprobs.append(top)
            offsets.append(text_offset)
            text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}


class _ChatChoices:
    def __init__(self, serving: _Serving, body: ChatCompletionRequest):
        self.serving = serving
        self.body = body

    def whole_choice(self, completion: CompletionOutput) -> dict:
        return {"index": completion.index, "message": {"role": "assistant", "content": completion.text},
                "logprobs": self._logprobs(completion.token_ids, completion.logprobs) if self.body.logprobs else None,
                "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}

    async def stream_chunks(self, stream: RequestStream, response_id: str) -> AsyncIterator[dict]:
        body = self.body
        usage_extra = {"usage": None} if body.include_usage else {}

        def chunk(choice: dict) -> dict:
            return self.serving.chunk(response_id, "chat.completion.chunk", [choice], **usage_extra)

        # OpenAI opens every choice with the role, before any content.
        for index in range(body.n):
            yield chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None})
        sent_text, sent_tokens, finished = [0] * body.n, [0] * body.n, set()
        final = None
        async for output in stream:
            _raise_if_failed(output)
            for completion in output.outputs:
                index = completion.index
                if index in finished:
                    continue
                new_text = completion.text[sent_text[index]:]
                new_tokens = completion.token_ids[sent_tokens[index]:]
                if new_text or (new_tokens and body.logprobs):
                    logprobs = self._logprobs(new_tokens, completion.logprobs[sent_tokens[index]:]) \
                        if body.logprobs else None
                    yield chunk({"index": index, "delta": {"content": new_text}, "logprobs": logprobs,
                                 "finish_reason": None})
                    sent_text[index] += len(new_text)
                    sent_tokens[index] = len(completion.token_ids)
                if completion.finish_reason is not None:
                    finished.add(index)
                    yield chunk({"index": index, "delta": {}, "logprobs": None,
                                 "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason})
            final = output
        if body.include_usage:
            yield self.serving.chunk(response_id, "chat.completion.chunk", [], usage=_usage([final]))

    def _logprobs(self, token_ids: list[int], positions: list[PositionLogprobs]) -> dict:
        top_n = self.body.top_logprobs or 0
        content = []
        for token_id, position in zip(token_ids, positions):
            # The engine's dict lists the top-N by rank, then the chosen token if it is not among them.
            top = [_chat_logprob(entry.decoded_token, entry.logprob) for entry in list(position.values())[:top_n]]
            chosen = position[token_id]
            content.append({**_chat_logprob(chosen.decoded_token, chosen.logprob), "top_logprobs": top})
        return {"content": content}


def _chat_logprob(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _raise_if_failed(output: RequestOutput) -> None:
    """A request whose step failed (the engine logged why and went on) is answered as a 500."""
    if any(completion.finish_reason == "error" for completion in output.outputs):
        raise APIError(500, "The engine failed while running this request; the server log says why.",
                       type="server_error")


def _prompt_number(request_id: str) -> int:
    return int(request_id.rsplit("-", 1)[1])  # request ids are f"{response_id}-{prompt number}"


def _usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(stream: RequestStream, chunks: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events as OpenAI sends them: `data: {json}` per chunk, then `data: [DONE]`."""

    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except EngineDeadError as e:  # the status line is long gone: the error travels as an event
            yield f"data: {json.dumps(APIError(503, str(e), type='server_error').body())}\n\n"
        except APIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            # Runs also when the client disconnects (Starlette cancels this generator).
            stream.abort()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _collect_unless_disconnected(stream: RequestStream, request: Request) -> dict[str, RequestOutput] | None:
    """Each request's final output, or None if the client disconnected first (then all are aborted)."""

    async def collect() -> dict[str, RequestOutput]:
        return {output.request_id: output async for output in stream}

    async def disconnected():
        # The body has been read: the next message can only be the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    collecting, watching = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not collecting.done():
            collecting.cancel()
            stream.abort()
    return collecting.result() if collecting in done else None


if __name__ == "__main__":
    from nanovllm.entrypoints.cli import main as cli_main

    sys.exit(cli_main(["serve", *sys.argv[1:]]))
