"""Helpers shared by the routers: state and model lookup, awaiting queued work, request metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from fastapi import Request

from service.errors import (
    ClientDisconnected,
    DeadlineExceeded,
    ModelNotFound,
    NotReady,
    ServiceError,
)
from service.model_config import MODEL_VERSION

if TYPE_CHECKING:
    from service.app import ServiceState


def get_state(request: Request) -> ServiceState:
    """The lifespan-created state; 503 while the model is still loading."""
    state = getattr(request.app.state, "service", None)
    if state is None:
        raise NotReady("model is still loading")
    return state


def check_model(state: ServiceState, model_name: str, model_version: str | None) -> None:
    """404 unless the path names the served model (and, if given, its version)."""
    if model_name != state.model_name:
        raise ModelNotFound(
            f"unknown model '{model_name}'; this server serves '{state.model_name}'"
        )
    if model_version not in (None, "", MODEL_VERSION):
        raise ModelNotFound(
            f"model '{model_name}' has no version '{model_version}' (versions: {MODEL_VERSION})"
        )


def ensure_serving(state: ServiceState) -> None:
    """503 while warming up or draining: work is accepted only by a ready server."""
    if state.draining or not state.ready:
        raise NotReady(
            "server is draining; retry on another replica"
            if state.draining
            else "model is warming up",
            headers={"Retry-After": "1"},
        )


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
