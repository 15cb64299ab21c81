"""Pure-ASGI flow limits: a minimum request-body rate, and bounded memory for unread responses.

uvicorn pauses a response while the socket's send buffer is over its high-water mark, but only
between `send` calls: a response sent as one body message lands in the transport's buffer whole.
`ResponseBackpressure` sends large bodies in slices, so a client that does not read holds at most
the high-water mark in socket buffers plus the one response object, and caps the bytes of
responses being written at once across all connections (503 past it). The connection's write
timeout (`service.http.connections`) frees what a stalled reader holds.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from service.pipeline.errors import BodyTimeout, ResponsesBacklogged, error_body

Scope = dict[str, Any]
ASGIApp = Any

SLICE_BYTES = 256 * 1024


class BodyRate:
    """408 for a request body that arrives slower than `min_rate` bytes/s once `grace_s` has
    passed since the headers: the body must have reached `min_rate * (elapsed - grace_s)` bytes.

    One timer per request checks the rule when it falls due and, if the handler is then waiting
    in `receive`, cancels that wait; so a stalled uploader neither holds a handler (nor
    `mha_requests_in_flight`) open, and a fast body costs one timer.
    """

    def __init__(self, app: ASGIApp, grace_s: float, min_rate: int) -> None:
        self.app = app
        self.grace_s = grace_s
        self.min_rate = min_rate

    def applies(self, scope: Scope) -> bool:
        """Whether the rule watches this request (an HTTP request with a body, a rate set)."""
        return scope["type"] == "http" and self.min_rate > 0 and _has_body(scope)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if not self.applies(scope):
            await self.app(scope, receive, send)
            return
        timed = TimedReceive(receive, self.grace_s, self.min_rate)
        try:
            await self.app(scope, timed, send)
        finally:
            timed.stop()


class TimedReceive:
    """`receive` under BodyRate's rule: one timer checks it when it falls due and cancels a
    wait in `receive` then (the waiter gets BodyTimeout). Call stop() when the handler ends.
    Shared by the BodyRate middleware and the fast path (service.http.fastpath)."""

    __slots__ = (
        "_complete",
        "_expired",
        "_grace_s",
        "_loop",
        "_min_rate",
        "_receive",
        "_received",
        "_started",
        "_timer",
        "_waiter",
    )  # fmt: skip

    def __init__(self, receive: Any, grace_s: float, min_rate: int) -> None:
        self._receive = receive
        self._grace_s = grace_s
        self._min_rate = min_rate
        self._loop = loop = asyncio.get_running_loop()
        self._started = loop.time()
        self._received = 0
        self._complete = self._expired = False
        self._waiter: asyncio.Task | None = None
        # Armed by the first receive that could wait: a body already in (the usual case for a
        # small request, read before the handler first runs) costs no timer at all.
        self._timer: asyncio.TimerHandle | None = None

    def _due(self) -> float:
        return self._started + self._grace_s + self._received / self._min_rate

    def _check(self) -> None:
        if self._complete:
            return
        if self._loop.time() < self._due():
            self._timer = self._loop.call_at(self._due(), self._check)
            return
        self._expired = True
        if self._waiter is not None:
            self._waiter.cancel()

    def _too_slow(self) -> BodyTimeout:
        return BodyTimeout(
            f"request body arrived slower than {self._min_rate} bytes/s after "
            f"{self._grace_s:g} s ({self._received} bytes in "
            f"{self._loop.time() - self._started:.1f} s; --body-min-rate, --body-timeout-s)"
        )

    async def __call__(self) -> dict:
        if self._complete:
            return await self._receive()  # body done: e.g. waiting for a disconnect, untimed
        if self._expired:
            raise self._too_slow()
        if self._timer is None:
            if self._loop.time() >= self._due():  # as the timer would have found meanwhile
                self._expired = True
                raise self._too_slow()
            if _ready(self._receive):
                return self._count(await self._receive())  # returns without waiting
            self._timer = self._loop.call_at(self._due(), self._check)
        self._waiter = asyncio.current_task()
        try:
            message = await self._receive()
        except asyncio.CancelledError:
            if not self._expired or self._waiter is None:
                raise
            self._waiter.uncancel()
            raise self._too_slow() from None
        finally:
            self._waiter = None
        return self._count(message)

    def _count(self, message: dict) -> dict:
        if message["type"] == "http.request":
            self._received += len(message.get("body", b""))
            self._complete = not message.get("more_body", False)
        else:
            self._complete = True
        return message

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def _ready(receive: Any) -> bool:
    """Whether `receive` returns without waiting: uvicorn's RequestResponseCycle.receive with
    its message event already set (the body, or the disconnect, is in). Other servers: False."""
    event = getattr(getattr(receive, "__self__", None), "message_event", None)
    return event is not None and event.is_set()


def _has_body(scope: Scope) -> bool:
    """A request body follows the headers (HTTP/1.1 framing: Content-Length or chunked)."""
    for key, value in scope.get("headers", ()):
        if key == b"transfer-encoding" or (key == b"content-length" and value != b"0"):
            return True
    return False


def _content_length(headers: list[tuple[bytes, bytes]]) -> int:
    for key, value in headers:
        if key.lower() == b"content-length" and value.isdigit():
            return int(value)
    return 0


class ResponseBudget:
    """Bytes of large responses being written to clients, shared by the middleware (which
    counts them) and the routes (which can refuse before encoding a response that won't fit)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pending = 0

    def fits(self, nbytes: int) -> bool:
        return nbytes <= SLICE_BYTES or self.pending + nbytes <= self.limit

    def check(self, nbytes: int) -> None:
        """503 + Retry-After now if a response of at least `nbytes` could not be written."""
        if not self.fits(nbytes):
            raise ResponsesBacklogged(
                f"server is already writing {self.pending} bytes of responses to slow clients; "
                f"a {nbytes}-byte response would pass --max-pending-response-bytes ({self.limit})"
            )


class ResponseBackpressure:
    """Large response bodies go out in SLICE_BYTES slices (each waits for the client to drain
    the socket); at most `budget.limit` bytes of large responses are being written at once, a
    response past that gets 503 + Retry-After instead and its body is dropped at once."""

    def __init__(self, app: ASGIApp, budget: ResponseBudget) -> None:
        self.app = app
        self.budget = budget  # budget.pending: bytes of large responses not yet sent

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held = 0  # this response's share of budget.pending
        refused = False

        async def sliced_send(message: dict) -> None:
            nonlocal held, refused
            if message["type"] == "http.response.start":
                length = _content_length(message.get("headers", []))
                if length > SLICE_BYTES:
                    if not self.budget.fits(length):
                        refused = True
                        pending, limit = self.budget.pending, self.budget.limit
                        await _send_busy(send, scope["path"], length, pending, limit)
                        return
                    held = length
                    self.budget.pending += length
                await send(message)
                return
            if refused:
                return
            body = message.get("body", b"")
            if message["type"] != "http.response.body" or len(body) <= SLICE_BYTES:
                await send(message)
                return
            more = message.get("more_body", False)
            view = memoryview(body)
            for start in range(0, len(view), SLICE_BYTES):
                piece = view[start : start + SLICE_BYTES]
                last = start + SLICE_BYTES >= len(view)
                await send(
                    {"type": "http.response.body", "body": piece, "more_body": more or not last}
                )
                sent = min(len(piece), held)
                held -= sent
                self.budget.pending -= sent

        try:
            await self.app(scope, receive, sliced_send)
        finally:
            self.budget.pending -= held


async def _send_busy(send: Any, path: str, length: int, pending: int, limit: int) -> None:
    message = (
        f"server is already writing {pending} bytes of responses to slow clients; "
        f"this {length}-byte response would pass --max-pending-response-bytes ({limit})"
    )
    body = orjson.dumps(error_body(path, 503, message, ResponsesBacklogged.reason))
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})
