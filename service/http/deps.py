"""FastAPI dependencies and helpers that give routes the service state: routes import these,
never service.app."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from service.http.flow import ResponseBudget
from service.pipeline.errors import NotReady
from service.runtime.state import ModelEntry, ServiceState


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
