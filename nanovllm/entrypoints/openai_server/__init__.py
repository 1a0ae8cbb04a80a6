"""`nanovllm serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /v1/responses
(and GET / DELETE of stored ones), POST /v1/embeddings (a pooling model's), POST /tokenize and
/detokenize, GET /health, GET /metrics, and Anthropic's POST /v1/messages and
/v1/messages/count_tokens. Every request goes
through one AsyncLLMEngine, so all of them share one continuous batch. Responses follow OpenAI's
wire format (Anthropic's on /v1/messages, errors included), streamed ones as server-sent events.

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

Modules: app (options, main, routes and checks), serving (what the endpoints share), completions
and chat (one endpoint each), responses and messages (OpenAI's Responses and Anthropic's
Messages APIs, around chat's generation path), embeddings, tokenize, tools (tool calling in
chat), streaming (what a streamed choice has been sent so far, and its usage).
"""

from nanovllm.entrypoints.openai_server.app import add_arguments, build_app, main, served_name

__all__ = ["add_arguments", "build_app", "main", "served_name"]
