"""FastAPI dependencies and helpers that give routes the service state: routes import these,
never service.app."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request

from service.http.flow import ResponseBudget
from service.pipeline.errors import NotReady
from service.runtime.state import ModelEntry, ServiceState
from service.runtime.tracing import CURRENT, describe


def get_state(request: Request) -> ServiceState:
    """The lifespan-created state; 503 while the model is still loading."""
    state = getattr(request.app.state, "service", None)
    if state is None:
        raise NotReady("model is still loading")
    return state


def loaded_state(request: Request) -> ServiceState | None:
    """The state, or None while loading (for probes that answer either way)."""
    return getattr(request.app.state, "service", None)


async def _state(request: Request) -> ServiceState:
    # async: FastAPI runs a plain `def` dependency on a worker thread, for every request.
    return get_state(request)


State = Annotated[ServiceState, Depends(_state)]


async def path_model(state: State, model_name: str, model_version: str | None = None) -> ModelEntry:
    """The model named by the path (`/v2/models/{model_name}[/versions/{model_version}]`)."""
    return state.find(model_name, model_version or None)


PathModel = Annotated[ModelEntry, Depends(path_model)]


def response_budget(request: Request) -> ResponseBudget:
    """The bound on response bytes being written at once (--max-pending-response-bytes)."""
    return request.app.state.response_budget


def trace_context(scope: dict[str, Any]) -> tuple[str | None, str | None, float | None]:
    """W3C Trace Context (traceparent, tracestate) of the HTTP request and the time it arrived
    (perf_counter; RequestContext or the fast path wrote it): what tracing needs of it."""
    traceparent = tracestate = None
    for key, value in scope["headers"]:
        if key == b"traceparent":
            traceparent = value.decode("latin-1")
        elif key == b"tracestate":
            tracestate = value.decode("latin-1")
    return traceparent, tracestate, scope.get("state", {}).get("started")


class traced:  # named for its use: `with traced(...)`
    """Traces a text request of `entry` (TEI's routes, /v1/embeddings, /v1/rerank) when tracing
    picks it: its span starts when the request arrived; service.text.work adds the tokenize,
    queue and compute steps through tracing.CURRENT. Costs one check when tracing is off."""

    __slots__ = ("token", "trace")

    def __init__(self, state: ServiceState, scope: dict[str, Any], entry: ModelEntry, op: str):
        self.trace = self.token = None
        tracing = state.trace_control
        if tracing.active:
            traceparent, tracestate, started = trace_context(scope)
            self.trace = tracing.begin(entry.name, op, traceparent, tracestate, started)
            if self.trace is not None:
                rid = scope.get("state", {}).get("request_id", "")
                describe(self.trace, entry, "http", rid)

    def __enter__(self) -> None:
        if self.trace is not None:
            self.token = CURRENT.set(self.trace)

    def __exit__(self, kind: Any, exc: BaseException | None, _: Any) -> None:
        trace = self.trace
        if trace is None:
            return
        try:
            CURRENT.reset(self.token)
        finally:
            if exc is not None:
                trace.fail(exc)
            trace.end()
