"""Helpers shared by the routers: the service state and the model/version lookup."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Request

from service.errors import ModelNotFound, NotReady

if TYPE_CHECKING:
    from service.app import ServiceState

MODEL_VERSION = "1"


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
