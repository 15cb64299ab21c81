"""Helpers shared by the routers: awaiting queued work (deadline, disconnect), request metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from fastapi import Request

from service.errors import ClientDisconnected, DeadlineExceeded, ServiceError

if TYPE_CHECKING:
    from service.state import ServiceState


async def wait_disconnect(request: Request) -> None:
    """Return when the client has gone (call only once the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def await_queued(
    state: ServiceState, request: Request, result: asyncio.Future, items: list, timeout: float
) -> Any:
    """Await `result` of queued batcher `items`: 499 if the client leaves, 504 if the deadline
    passes before they ran; either way the items not yet started leave the queue."""
    disconnect = asyncio.ensure_future(wait_disconnect(request))
    try:
        done, _ = await asyncio.wait(
            {result, disconnect}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if result in done:
            return result.result()
        if disconnect in done:
            for item in items:
                state.batcher.cancel(item)
            raise ClientDisconnected("client disconnected")
        if any([state.batcher.cancel(item) for item in items]):
            raise DeadlineExceeded(f"request timed out after {timeout:.3f} s in the queue")
        return await result  # everything already running: it finishes within one forward
    finally:
        disconnect.cancel()
        if not result.done():  # cancelled (e.g. by the server's shutdown): never compute it
            for item in items:
                state.batcher.cancel(item)


@contextmanager
def observed(state: ServiceState, endpoint: str, in_flight: bool = True) -> Iterator[None]:
    """Request metrics around a handler: count by status, failure reason, duration, in-flight."""
    started = time.perf_counter()
    status, reason = 200, None
    gauge = state.metrics.in_flight.labels(state.model_name) if in_flight else None
    if gauge is not None:
        gauge.inc()
    try:
        yield
    except ServiceError as exc:
        status, reason = exc.status, exc.reason
        raise
    except Exception:
        status, reason = 500, "inference_error"
        raise
    finally:
        if gauge is not None:
            gauge.dec()
        state.metrics.request_done(endpoint, status, time.perf_counter() - started, reason)
