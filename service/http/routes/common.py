"""Helpers shared by the routers: awaiting queued work (deadline, disconnect), request metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from service.http.connections import disconnect_signal
from service.pipeline.errors import ClientDisconnected, DeadlineExceeded, ServiceError

if TYPE_CHECKING:
    from service.runtime.batcher import DynamicBatcher
    from service.runtime.metrics import Metrics
    from service.runtime.state import ServiceState


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


class PartsResponse(Response):
    """A body sent as its parts (a JSON header, then tensor bytes viewed straight from the
    batch output) under one Content-Length: nothing is joined or copied."""

    def __init__(
        self, parts: list[bytes | memoryview], media_type: str, headers: dict[str, str]
    ) -> None:
        self.parts = parts
        length = str(sum(len(part) for part in parts))
        super().__init__(None, media_type=media_type, headers={**headers, "content-length": length})

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
    """Whether the client has gone: our server's connection signal (service.http.connections), else
    (another ASGI server, in-process tests) a task watching `receive` for http.disconnect."""

    def __init__(self, request: Request) -> None:
        self.signal = disconnect_signal(request.scope)
        self._task = None if self.signal else asyncio.ensure_future(wait_disconnect(request))

    @property
    def gone(self) -> bool:
        return self.signal.happened if self.signal else self._task.done()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


async def await_queued(
    batcher: DynamicBatcher,
    request: Request,
    result: asyncio.Future,
    items: list,
    timeout: float,
) -> Any:
    """Await `result` of `items` queued on `batcher` (the model's own): 499 if the client
    leaves, 504 if the deadline passes before they ran; either way the items not yet started
    leave the queue."""
    signal = disconnect_signal(request.scope)
    if signal is None:
        return await _await_watching(batcher, request, result, items, timeout)
    # One future, one timer and a callback on the connection: no task per request.
    loop = asyncio.get_running_loop()
    wake = loop.create_future()

    def wake_up(*_: object) -> None:
        if not wake.done():
            wake.set_result(None)

    result.add_done_callback(wake_up)
    timer = loop.call_later(timeout, wake_up)
    signal.add(wake_up)
    try:
        await wake
    except BaseException:  # cancelled (e.g. by the server's shutdown): never compute it
        _cancel(batcher, items)
        raise
    finally:
        timer.cancel()
        signal.discard(wake_up)
        result.remove_done_callback(wake_up)
    if result.done():
        return result.result()
    if signal.happened:
        _cancel(batcher, items)
        raise ClientDisconnected("client disconnected")
    if await batcher.withdraw(items):
        raise DeadlineExceeded(f"request timed out after {timeout:.3f} s in the queue")
    return await result  # everything already running: it finishes within one forward


def _cancel(batcher: DynamicBatcher, items: list) -> None:
    for item in items:
        batcher.cancel(item)


async def _await_watching(
    batcher: DynamicBatcher, request: Request, result: asyncio.Future, items: list, timeout: float
) -> Any:
    """await_queued with a task watching for http.disconnect (servers without the signal)."""
    disconnect = asyncio.ensure_future(wait_disconnect(request))
    try:
        done, _ = await asyncio.wait(
            {result, disconnect}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if result in done:
            return result.result()
        if disconnect in done:
            _cancel(batcher, items)
            raise ClientDisconnected("client disconnected")
        if await batcher.withdraw(items):
            raise DeadlineExceeded(f"request timed out after {timeout:.3f} s in the queue")
        return await result  # everything already running: it finishes within one forward
    finally:
        disconnect.cancel()
        if not result.done():  # cancelled (e.g. by the server's shutdown): never compute it
            _cancel(batcher, items)


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


@contextmanager
def observed(
    state: ServiceState,
    endpoint: str,
    in_flight: bool = True,
    model: str | None = None,
    version: str | None = None,
) -> Iterator[Observation]:
    """Request metrics around a handler: count by status, failure reason, duration, in-flight;
    labelled with `model` and `version` when they name a served model version (no version: its
    highest; else the default model)."""
    started = time.perf_counter()
    status, reason = 200, None
    seen = Observation(state.metrics_for(model, version), in_flight)
    try:
        yield seen
    except ServiceError as exc:
        status, reason = exc.status, exc.reason
        raise
    except Exception:
        status, reason = 500, "inference_error"
        raise
    finally:
        if seen.gauge is not None:
            seen.gauge.dec()
        seen.metrics.request_done(endpoint, status, time.perf_counter() - started, reason)
