"""Helpers shared by the routers: the lean route class, parts responses, the client-gone watch,
awaiting queued work (deadline, disconnect), request metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute

from service.http.connections import disconnect_signal
from service.http.middleware import log_safe
from service.pipeline.errors import ServiceError, error_body
from service.pipeline.waiting import Gone
from service.pipeline.waiting import await_queued as pipeline_await
from service.runtime.tracing import TRACED

log = logging.getLogger("service")  # the app's logger: the same lines from every path

if TYPE_CHECKING:
    from service.runtime.metrics import Metrics
    from service.runtime.state import ServiceState
    from service.runtime.work import Batcher


class LeanRoute(APIRoute):
    """A route whose handler is the endpoint itself, called with the Request and the path's
    parameters as strings: no dependency solving or parameter validation per request (the
    endpoint checks what it reads). FastAPI still documents it from the endpoint's signature.
    For the hot routes (/infer, /v1/embeddings)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint = self.endpoint

        async def handler(request: Request) -> Response:
            return await endpoint(request, **request.path_params)

        return handler


def error_response(path: str, exc: ServiceError) -> JSONResponse:
    """A ServiceError as the answer of route `path`, in its protocol's error shape."""
    body = error_body(path, exc.status, exc.message, exc.reason, exc.param)
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


JOIN_BYTES = 64 * 1024  # a body this small is joined: one copy costs less than a socket write


def internal_error_response(path: str) -> JSONResponse:
    """An unexpected exception (being handled) logged with its traceback, answered 500."""
    log.exception("unhandled error on %s", log_safe(path))
    body = error_body(path, 500, "internal server error", "inference_error")
    return JSONResponse(body, status_code=500)


class PartsResponse(Response):
    """A body sent as its parts (a JSON header, then tensor bytes viewed straight from the
    batch output) under one Content-Length: nothing is joined or copied, unless the whole body
    is under JOIN_BYTES (then one part: one write to the socket instead of one per part)."""

    def __init__(
        self, parts: list[bytes | memoryview], media_type: str, headers: dict[str, str]
    ) -> None:
        size = sum(len(part) for part in parts)
        self.parts = [b"".join(parts)] if len(parts) > 1 and size <= JOIN_BYTES else parts
        self.size = size
        # What Response.__init__(None, media_type=..., headers={**headers, "content-length":
        # ...}) sets, in its order, without its generic header handling (it runs per request)
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.body = b""
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        raw.append((b"content-length", str(size).encode("latin-1")))
        raw.append((b"content-type", media_type.encode("latin-1")))
        self.raw_headers = raw

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        last = len(self.parts) - 1
        for i, part in enumerate(self.parts):
            await send({"type": "http.response.body", "body": part, "more_body": i < last})


async def wait_disconnect(request: Request) -> None:
    """Return when the client has gone (call only once the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientWatch:
    """Whether the client has gone (the pipeline's `Gone`): our server's connection signal
    (service.http.connections), else (another ASGI server, in-process tests) a task watching
    `receive` for http.disconnect. Create it once the body has been read; close() after."""

    def __init__(self, request: Request) -> None:
        self.signal = disconnect_signal(request.scope)
        self._task: asyncio.Future | None = None
        self._callbacks: list[Callable[[], None]] = []
        if self.signal is None:
            self._task = asyncio.ensure_future(wait_disconnect(request))
            self._task.add_done_callback(self._fire)

    @property
    def happened(self) -> bool:
        if self.signal is not None:
            return self.signal.happened
        return self._task.done() and not self._task.cancelled()

    gone = happened

    def add(self, callback: Callable[[], None]) -> None:
        if self.signal is not None:
            self.signal.add(callback)
        elif self.happened:
            callback()
        else:
            self._callbacks.append(callback)

    def discard(self, callback: Callable[[], None]) -> None:
        if self.signal is not None:
            self.signal.discard(callback)
        elif callback in self._callbacks:
            self._callbacks.remove(callback)

    def _fire(self, task: asyncio.Future) -> None:
        if task.cancelled():
            return
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


class client_gone:  # named as the generator it replaced: `with client_gone(request) as gone`
    """What tells the pipeline that the client of `request` (its body read) has gone: our
    server's connection signal as it is, else a ClientWatch, closed after. A class, not a
    generator: it runs on every request."""

    __slots__ = ("request", "watch")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.watch: ClientWatch | None = None

    def __enter__(self) -> Gone:
        signal = disconnect_signal(self.request.scope)
        if signal is not None:
            return signal
        self.watch = ClientWatch(self.request)
        return self.watch

    def __exit__(self, *_: object) -> None:
        if self.watch is not None:
            self.watch.close()


async def await_queued(
    batcher: Batcher,
    request: Request,
    result: asyncio.Future,
    items: list,
    timeout: float,
) -> Any:
    """service.pipeline.waiting.await_queued for an HTTP request: 499 if the client leaves,
    504 if the deadline passes before the items ran."""
    watch = ClientWatch(request)
    try:
        return await pipeline_await(batcher, result, items, timeout, watch)
    finally:
        watch.close()


class Observation:
    """The metrics one request is counted in; a handler that learns its model from the body
    moves it there with label()."""

    def __init__(self, metrics: Metrics, in_flight: bool) -> None:
        self.metrics = metrics
        self.gauge = metrics.in_flight_child if in_flight else None
        if self.gauge is not None:
            self.gauge.inc()

    def label(self, metrics: Metrics) -> None:
        """Count the request (and its in-flight gauge) under `metrics` from now on."""
        if self.gauge is not None:
            self.gauge.dec()
            self.gauge = metrics.in_flight_child
            self.gauge.inc()
        self.metrics = metrics


class observed:  # named as the function it replaces: `with observed(...) as seen`
    """Request metrics around a handler: count by status, failure reason, duration, in-flight;
    labelled with `model` and `version` when they name a served model version (no version: its
    highest; else the default model). A class, not a generator: it runs on every request."""

    __slots__ = ("endpoint", "seen", "started")

    def __init__(
        self,
        state: ServiceState,
        endpoint: str,
        in_flight: bool = True,
        model: str | None = None,
        version: str | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.started = time.perf_counter()
        self.seen = Observation(state.metrics_for(model, version), in_flight)
        TRACED.set(None)  # a trace begun for this request (tracing.begin) sets it

    def __enter__(self) -> Observation:
        return self.seen

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _: Any) -> None:
        status, reason = 200, None
        if isinstance(exc, ServiceError):
            status, reason = exc.status, exc.reason
        elif isinstance(exc, Exception):
            status, reason = 500, "inference_error"
        seen = self.seen
        if seen.gauge is not None:
            seen.gauge.dec()
        trace = TRACED.get()
        seen.metrics.request_done(
            self.endpoint, status, time.perf_counter() - self.started, reason, "http",
            None if trace is None else trace.hex_id,
        )  # fmt: skip


def json_response(content: object) -> Response:
    """`content` (lists and dicts of plain values) as JSON, written by orjson: the same text a
    response model would give, without validating every item on the way out."""
    return Response(orjson.dumps(content), media_type="application/json")
