"""What the HTTP server refuses before any route runs: Host and Origin headers that a web page
could have sent (DNS rebinding, cross-site requests), and requests whose headers and body never
finish arriving. The OpenAI server (openai_server/app.py) installs both."""

import asyncio
import ipaddress
import re
from collections.abc import Collection
from urllib.parse import urlsplit

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

from nanovllm.entrypoints.protocol import APIError


class ReadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol (whether or not httptools is installed), with a deadline for
    reading each request.

    uvicorn bounds only the idle time after a response (its keep-alive timeout, which the first
    byte of the next request cancels) and has no header or body timeout: a client that sends
    nothing, half its headers, or part of a declared body would hold its connection, and a route
    waiting for the body, forever. Here a request's headers and body must all arrive within
    `read_timeout` seconds of the server beginning to wait for it (the connection opening, or
    the previous response ending), or the connection is closed. This sits in the protocol, not
    in an ASGI middleware, because the app sees nothing of a request before its headers are in.
    """

    def __init__(self, *args, read_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self._read_deadline: asyncio.TimerHandle | None = None
        self._cycle_before: RequestResponseCycle | None = None  # the cycle before the awaited request

    def connection_made(self, transport: asyncio.Transport):  # type: ignore[override]
        super().connection_made(transport)
        self._arm_read_deadline()

    def handle_events(self):
        super().handle_events()
        # h11 clears more_body at the request's end of message, with headers and body all in.
        if self._read_deadline is not None and self.cycle is not self._cycle_before and not self.cycle.more_body:
            self._read_deadline.cancel()
            self._read_deadline = None

    def on_response_complete(self):
        self._arm_read_deadline()  # first: uvicorn goes on to read a pipelined request, if there is one
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None):
        if self._read_deadline is not None:
            self._read_deadline.cancel()
        super().connection_lost(exc)

    def _arm_read_deadline(self):
        if self._read_deadline is not None:
            self._read_deadline.cancel()
        self._cycle_before = self.cycle
        # A route still waiting for the body then reads a disconnect (ClientDisconnect).
        self._read_deadline = self.loop.call_later(self.read_timeout, self.transport.close)


def parse_origins(text: str) -> list[str]:
    """`--allowed-origins`: comma-separated scheme://host[:port] origins, lowercased as browsers
    send them, or *."""
    origins = [origin.strip().lower().removesuffix("/") for origin in text.split(",") if origin.strip()]
    for origin in origins:
        parts = urlsplit(origin)
        if origin != "*" and not (parts.scheme and parts.netloc and origin == f"{parts.scheme}://{parts.netloc}"):
            raise ValueError(f"--allowed-origins: {origin!r} is not an origin; give scheme://host[:port] "
                             "(e.g. http://localhost:3000), several separated by commas, or * for any")
    return origins


def is_loopback(host: str) -> bool:
    """Whether an address or host name (no port, no brackets) is this machine's loopback."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# A Host header: a name or IPv4 address, or an IPv6 address in brackets; then an optional port.
_HOST_HEADER = re.compile(r"(?:\[(?P<ipv6>[^\]]+)\]|(?P<name>[^:\[\]]+))(?::\d*)?")


def _is_loopback_host_header(host: str) -> bool:
    match = _HOST_HEADER.fullmatch(host)
    return match is not None and is_loopback(match["ipv6"] or match["name"])


class BrowserGuard:
    """Refuses, before any route runs, what a web page may send a server on this machine.

    A page cannot choose the Host header, but with DNS rebinding its own name can resolve to
    127.0.0.1: a server bound to loopback therefore answers only Hosts that name loopback (400
    otherwise); one bound elsewhere is reached by names this server cannot know, and checks no
    Host. A page can send requests, though not read the answers, to any origin: a request whose
    Origin is neither the server's own (the loopback Host it was sent to) nor allowed gets 403
    whatever its method, so that its side effects (a queued generation) never happen either.
    """

    def __init__(self, app: ASGIApp, check_host: bool, allowed_origins: Collection[str]):
        self.app = app
        self.check_host = check_host
        self.allowed_origins = set(allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send):
        if scope["type"] == "http":
            error = self._refusal(scope)
            if error is not None:
                await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> APIError | None:
        headers = Headers(scope=scope)
        host = headers.get("host", "")
        if self.check_host and not _is_loopback_host_header(host):
            return APIError(400, f"The Host header {host!r} does not name this machine's loopback. This server "
                                 "listens on a loopback address and answers requests for localhost, 127.x.x.x and "
                                 "[::1] only (other names can be DNS rebinding).", code="invalid_host")
        origin = headers.get("origin")
        if origin is None or "*" in self.allowed_origins or origin.lower() in self.allowed_origins:
            return None
        if _is_loopback_host_header(host) and origin.lower() == f"{scope['scheme']}://{host.lower()}":
            return None  # the server's own origin: same-origin requests carry one too
        return APIError(403, f"Requests from the origin {origin!r} are not allowed. Start the server with "
                             f"--allowed-origins {origin} to let pages from it call the API.",
                        code="origin_not_allowed")
