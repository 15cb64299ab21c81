"""Connection-level limits uvicorn lacks: header timeout, write timeout and a connection cap.

uvicorn already closes idle keep-alive connections (`timeout_keep_alive`) and pauses a response
while the socket's send buffer is over its high-water mark. This protocol adds, per connection:

- a header timeout: the request line and headers must arrive within `header_timeout_s` of the
  connection opening (or of the first byte of the next request on a keep-alive connection);
- a write timeout: a response paused on a client that does not read for `write_timeout_s` is
  aborted, which frees its buffers (nginx's `send_timeout` does the same);
- a cap on open connections: at the cap, a new connection closes the longest-idle one (no
  request in progress: idle keep-alive or still sending headers), as nginx reuses keep-alive
  connections when it runs out; if every connection is busy the newcomer gets 503. So health
  probes still get through while slow or idle clients hold sockets.

It also tells the app, without a watcher task per request, when a client goes away before its
response is complete: each request's scope carries a `Disconnect` under
`scope["extensions"]["mha.disconnect"]` that the connection fires when it is lost.

The body-rate timeout lives in `service.http.flow.BodyRate` (pure ASGI: it wraps `receive`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
from collections.abc import Callable, MutableMapping
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("service.http.connections")

# File descriptors kept free for the model, logs, threads and the listening socket.
RESERVED_FDS = 64


def _raw_response(status: str, message: str) -> bytes:
    body = b'{"error":"' + message.encode() + b'"}'
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


TIMED_OUT = _raw_response(
    "408 Request Timeout", "request headers not received in time (--header-timeout-s)"
)
FULL = _raw_response("503 Service Unavailable", "too many open connections (--max-connections)")


DISCONNECT = "mha.disconnect"


class Disconnect:
    """Fired once by the connection when the client goes away before the response is complete;
    callbacks added before (or after) that run then (or at once)."""

    __slots__ = ("_callbacks", "happened")

    def __init__(self) -> None:
        self.happened = False
        self._callbacks: list[Callable[[], None]] = []

    def add(self, callback: Callable[[], None]) -> None:
        if self.happened:
            callback()
        else:
            self._callbacks.append(callback)

    def discard(self, callback: Callable[[], None]) -> None:
        with contextlib.suppress(ValueError):
            self._callbacks.remove(callback)

    def fire(self) -> None:
        self.happened = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


def disconnect_signal(scope: MutableMapping[str, Any]) -> Disconnect | None:
    """The request's Disconnect, or None when the server is not ours (e.g. in-process tests)."""
    extensions = scope.get("extensions")
    return None if extensions is None else extensions.get(DISCONNECT)


def connection_cap(wanted: int) -> int:
    """`wanted`, lowered so the process keeps RESERVED_FDS descriptors free under RLIMIT_NOFILE."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or wanted <= soft - RESERVED_FDS:
        return wanted
    capped = max(1, soft - RESERVED_FDS)
    log.warning(
        "--max-connections %d is over the open-file limit %d less %d reserved; using %d",
        wanted, soft, RESERVED_FDS, capped,
    )  # fmt: skip
    return capped


def protocol_class(
    header_timeout_s: float, write_timeout_s: float, max_connections: int
) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with the limits above, for `uvicorn.Config(http=...)`."""

    class LimitedProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._header_timer: asyncio.TimerHandle | None = None
            self._write_timer: asyncio.TimerHandle | None = None
            self.idle_since = 0.0
            self.busy = False  # a request's headers are in and its response is not done
            self._started = False  # some bytes of a request have arrived
            self._heading = False  # a request has begun and its headers are not complete

        # -- connection cap -----------------------------------------------------------------
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= max_connections and not self._evict_idle():
                transport.write(FULL)
                transport.close()
                return
            super().connection_made(transport)
            self.idle_since = self.loop.time()
            self._arm_header_timer()

        def _evict_idle(self) -> bool:
            idle = [c for c in self.connections if not getattr(c, "busy", True)]
            if not idle:
                return False
            oldest = min(idle, key=lambda c: c.idle_since)
            oldest.busy = True  # not picked twice before it is gone
            oldest.transport.close()
            return True

        def connection_lost(self, exc: Exception | None) -> None:
            if self.transport is None:  # refused in connection_made: never set up
                return
            self._cancel_timers()
            super().connection_lost(exc)
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                signal = disconnect_signal(cycle.scope)
                if signal is not None:
                    signal.fire()

        # -- header timeout -----------------------------------------------------------------
        def _arm_header_timer(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _header_timeout(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                if self._started:  # some of a request arrived: say why it is cut off
                    self.transport.write(TIMED_OUT)
                self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._started = self._heading = True

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            # A request begun in these bytes whose headers are not all in yet: time them from
            # now (the same turn of the loop as its first byte). A request whose headers came
            # whole, the usual case, costs no timer.
            if self._heading and not self.transport.is_closing():
                self._arm_header_timer()

        def on_headers_complete(self) -> None:
            self._heading = False
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            self.busy = True
            # Before the app's task first runs (it starts on the loop's next turn).
            self.scope.setdefault("extensions", {})[DISCONNECT] = Disconnect()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            self.busy = self._started = False
            self.idle_since = self.loop.time()
            super().on_response_complete()

        # -- write timeout ------------------------------------------------------------------
        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(write_timeout_s, self._write_timeout)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _write_timeout(self) -> None:
            self._write_timer = None
            log.info("client %s read nothing for %.1f s; connection aborted", self.client,
                     write_timeout_s)  # fmt: skip
            self.transport.abort()  # drops the unsent buffer; connection_lost wakes the sender

        def _cancel_timers(self) -> None:
            for timer in (self._header_timer, self._write_timer):
                if timer is not None:
                    timer.cancel()
            self._header_timer = self._write_timer = None

    return LimitedProtocol
