"""Triton's model repository extension over HTTP: index, load, unload
(service/runtime/model_control.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from service.http.body import read_json
from service.http.deps import get_state
from service.http.openapi import ERROR_RESPONSES
from service.pipeline.errors import BadInput
from service.runtime.load_config import parse_load_config
from service.runtime.model_control import (
    LOAD_PARAMETERS,
    UNLOAD_PARAMETERS,
    ModelControl,
    check_parameters,
)

router = APIRouter(tags=["model repository"])
# tritonclient sends unload_dependents; with no ensembles there are no dependents to unload.
BODY_LIMIT = 64 * 1024  # these bodies are a few bytes; nothing bigger is read
INDEX_ENTRY = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "version": {"type": "string"},
        "state": {"type": "string", "enum": ["READY", "UNAVAILABLE"]},
        "reason": {"type": "string"},
    },
    "required": ["name", "state"],
}
INDEX_RESPONSES = {
    200: {
        "description": "Every model of the repository and --model-dir, with its state",
        "content": {"application/json": {"schema": {"type": "array", "items": INDEX_ENTRY}}},
    },
    **{code: ERROR_RESPONSES[code] for code in (400, 503)},
}
CONTROL_RESPONSES = {
    200: {"description": "Done", "content": {"application/json": {"schema": {"type": "object"}}}},
    **{code: ERROR_RESPONSES[code] for code in (400, 404, 503)},
}


def control(request: Request) -> ModelControl:
    get_state(request)  # 503 while the server is still loading
    return request.app.state.model_control


async def _body(request: Request) -> dict[str, Any]:
    """The optional JSON object body ({} when empty); 400 for anything else."""
    body = await read_json(request, BODY_LIMIT, empty={})
    if not isinstance(body, dict):
        raise BadInput("body must be a JSON object")
    return body


@router.post(
    "/v2/repository/index",
    summary="Repository index (Triton's model repository extension)",
    responses=INDEX_RESPONSES,
)
async def index(request: Request) -> JSONResponse:
    body = await _body(request)
    ready = body.get("ready", False)
    if not isinstance(ready, bool):
        raise BadInput(f"'ready' must be true or false, got {ready!r}")
    return JSONResponse(control(request).index(ready_only=ready))


async def _parameters(request: Request, allowed: frozenset[str]) -> dict[str, Any]:
    """The body's `parameters`; 400 for any this server cannot honour (model files)."""
    parameters = (await _body(request)).get("parameters") or {}
    if not isinstance(parameters, dict):
        raise BadInput("'parameters' must be a JSON object")
    check_parameters(parameters, allowed)
    return parameters


@router.post(
    "/v2/repository/models/{model_name}/load",
    summary="Load or reload a model (--model-control-mode explicit); parameters.config: its "
    "settings for this load, as a JSON string",
    responses=CONTROL_RESPONSES,
)
async def load(request: Request, model_name: str) -> dict[str, Any]:
    parameters = await _parameters(request, LOAD_PARAMETERS)
    config = parameters.get("config")
    settings = None if config is None else parse_load_config(config, model_name)
    await control(request).load(model_name, settings)
    return {}


@router.post(
    "/v2/repository/models/{model_name}/unload",
    summary="Unload a model (--model-control-mode explicit)",
    responses=CONTROL_RESPONSES,
)
async def unload(request: Request, model_name: str) -> dict[str, Any]:
    await _parameters(request, UNLOAD_PARAMETERS)
    await control(request).unload(model_name)
    return {}
