"""AsyncLLMEngine: the streaming LLMEngine behind an asyncio front, for the HTTP server.

One background thread owns the LLMEngine and is the only thread that ever touches it. Callers
on any event loop post commands (add, abort) to a thread-safe inbox; the thread runs them
between steps, steps while any request is unfinished, and hands each output to its request's
asyncio queue through that loop's `call_soon_threadsafe`. With nothing to do it sleeps on a
condition variable, so an idle server costs no CPU. Every request, whoever sent it, rides the
same continuous batch.

The thread also times requests (arrival to first token, gaps between tokens, arrival to
finish) for an optional observer, and keeps a snapshot of `get_metrics()` that other threads
may read at any time.
"""

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.outputs import RequestOutput
from nanovllm.pooling_params import PoolingParams
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (a step failed beyond recovery, or the engine shut down); no
    request can run."""


class RequestObserver(Protocol):
    """Latency hooks, called on the engine thread."""

    def first_token(self, seconds: float) -> None: ...  # arrival -> first generated token

    def inter_token(self, seconds: float) -> None: ...  # gap between two outputs that added tokens

    def finished(self, output: RequestOutput, seconds: float) -> None: ...  # arrival -> finish


class RequestStream:
    """The outputs of a group of requests submitted together, in the order the engine made them.

    Iterate it to get each request's cumulative RequestOutput every step it advances; iteration
    ends when all of them have finished. `abort()` stops the unfinished ones; call it when the
    consumer goes away (it is a no-op once everything has finished).
    """

    def __init__(self, engine: "AsyncLLMEngine", request_ids: list[str], loop: asyncio.AbstractEventLoop):
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.unfinished = set(request_ids)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if not self.unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.unfinished.clear()
            raise item
        if item.finished:
            self.unfinished.discard(item.request_id)
        return item

    def abort(self):
        if self.unfinished:
            self._engine.abort(list(self.unfinished))
            self.unfinished.clear()

    def put(self, item: RequestOutput | BaseException):
        """Hand an output (or the error that ends the stream) to the consumer; any thread may call it."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one request."""

    stream: RequestStream
    arrival: float
    num_tokens: int = 0
    last_token_time: float | None = None


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, observer: RequestObserver | None = None,
                 on_failure: Callable[[BaseException], None] | None = None):
        """`on_failure(error)` runs on the engine thread once a step has failed in a way the
        engine does not survive (see LLMEngine.step), after every stream has been told."""
        self.engine = engine
        self.observer = observer
        self.on_failure = on_failure
        self.metrics = engine.get_metrics()  # replaced (never mutated) by the engine thread
        self.error: BaseException | None = None  # why the engine thread died, if it did
        self._cond = threading.Condition()
        # Guarded by _cond: commands for the engine thread; adds not yet run (to fail them if
        # the thread dies first); whether shutdown has begun.
        self._inbox: list[Callable[[], None]] = []
        self._pending_adds: dict[asyncio.Future, asyncio.AbstractEventLoop] = {}
        self._stopping = False
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="nanovllm-engine", daemon=True)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stopping

    def start(self):
        self._thread.start()

    def shutdown(self, timeout: float = 30.0):
        """Abort whatever is still running (streams end with finish_reason "abort") and stop."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ----- called from event loops -----

    async def add_requests(self, request_ids: Sequence[str], prompts: Sequence,
                           params: SamplingParams | PoolingParams) -> RequestStream:
        """Validate and queue one request per prompt, all or none; returns their shared stream.

        Raises what `LLMEngine.make_request` raises (ValueError, TypeError) for a bad prompt, so
        the caller can reject the request before it has answered anything, and EngineDeadError
        when the engine is not running.
        """
        loop = asyncio.get_running_loop()
        arrival = time.monotonic()
        stream = RequestStream(self, list(request_ids), loop)
        accepted: asyncio.Future[None] = loop.create_future()

        def add():
            with self._cond:
                self._pending_adds.pop(accepted, None)
            try:
                requests = [self.engine.make_request(p, params, rid) for rid, p in zip(request_ids, prompts)]
            except Exception as e:  # make_request only validates: nothing was queued
                loop.call_soon_threadsafe(_settle, accepted, e)
                return
            for request in requests:
                self.engine.enqueue(request)
                self._tracked[request.request_id] = _Tracked(stream, arrival)
            loop.call_soon_threadsafe(_settle, accepted, None)

        if not self._post(add, pending=(accepted, loop)):
            raise EngineDeadError(self._dead_reason())
        try:
            await accepted
        except asyncio.CancelledError:  # the client left while we waited: drop whatever was queued
            self.abort(list(request_ids))
            raise
        return stream

    def abort(self, request_ids: list[str]):
        """Stop these requests (unknown or finished ids are ignored); their blocks return to the pool.

        A no-op once the engine has stopped: stopping aborts everything itself."""
        self._post(lambda: self._abort(request_ids))

    def abort_all(self):
        self._post(lambda: self._abort(list(self._tracked)))

    def _post(self, command: Callable[[], None],
              pending: tuple[asyncio.Future, asyncio.AbstractEventLoop] | None = None) -> bool:
        with self._cond:
            if not self.is_alive:
                return False
            self._inbox.append(command)
            if pending is not None:
                self._pending_adds[pending[0]] = pending[1]
            self._cond.notify()
        return True

    def _dead_reason(self) -> str:
        if self.error is not None:
            return f"the engine failed: {self.error!r}"
        return "the engine is not running" if not self._stopping else "the server is shutting down"

    # ----- the engine thread -----

    def _run(self):
        try:
            while True:
                with self._cond:
                    while not (self._inbox or self._stopping or self.engine.has_unfinished()):
                        self._cond.wait()
                    commands, self._inbox = self._inbox, []
                    stopping = self._stopping
                for command in commands:
                    command()
                if stopping:
                    self._abort(list(self._tracked))
                    break
                if self.engine.has_unfinished():
                    self._deliver(self.engine.step())
                self.metrics = self.engine.get_metrics()
        except Exception as e:
            logger.exception("the engine thread failed; no request can run any more")
            self.error = e
            for tracked in self._tracked.values():
                tracked.stream.put(EngineDeadError(self._dead_reason()))
            self._tracked.clear()
            if self.on_failure is not None:
                self.on_failure(e)
        # Adds posted after the thread's last look at the inbox will never run: fail them.
        with self._cond:
            pending, self._pending_adds = self._pending_adds, {}
            self._inbox.clear()
        for future, loop in pending.items():
            try:
                loop.call_soon_threadsafe(_settle, future, EngineDeadError(self._dead_reason()))
            except RuntimeError:  # that loop has closed
                pass

    def _abort(self, request_ids: list[str]):
        self._deliver([out for rid in request_ids if (out := self.engine.abort_request(rid)) is not None])

    def _deliver(self, outputs: list[RequestOutput]):
        # Refreshed first, so that whoever sees an output finished also sees its blocks freed.
        self.metrics = self.engine.get_metrics()
        now = time.monotonic()
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            if self.observer is not None:
                self._observe(tracked, output, now)
            if output.finished:
                del self._tracked[output.request_id]
            tracked.stream.put(output)

    def _observe(self, tracked: _Tracked, output: RequestOutput, now: float):
        # A pooling model's output (EmbeddingRequestOutput) has no tokens to time, only its end.
        num_tokens = sum(len(c.token_ids) for c in output.outputs) if isinstance(output, RequestOutput) else 0
        if num_tokens > tracked.num_tokens:
            if tracked.last_token_time is None:
                self.observer.first_token(now - tracked.arrival)
            else:
                self.observer.inter_token(now - tracked.last_token_time)
            tracked.num_tokens, tracked.last_token_time = num_tokens, now
        if output.finished:
            self.observer.finished(output, now - tracked.arrival)


def _settle(future: asyncio.Future, error: BaseException | None):
    if not future.done():  # it may have been cancelled: its caller then aborts
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
