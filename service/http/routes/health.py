"""Health and metadata routes of the Open Inference Protocol."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from service import __version__
from service.http.deps import PathModel, State, loaded_state
from service.http.openapi import ERROR_RESPONSES
from service.oip.model_config import extensions
from service.oip.model_config import model_metadata as metadata_of

router = APIRouter(tags=["health and metadata"])
MODEL_ERRORS = {code: ERROR_RESPONSES[code] for code in (404, 503)}


@router.get("/v2/health/live", summary="Server live")
async def live() -> dict[str, bool]:
    return {"live": True}


@router.get(
    "/v2/health/ready",
    summary="Server ready (all models loaded and warmed up)",
    responses={503: {"description": "Loading, warming up or draining"}},
)
async def ready(request: Request) -> JSONResponse:
    state = loaded_state(request)
    is_ready = bool(state and state.serving)
    return JSONResponse({"ready": is_ready}, status_code=200 if is_ready else 503)


@router.get("/v2", summary="Server metadata")
async def server_metadata(request: Request) -> dict[str, Any]:
    offered = extensions(request.app.state.settings)
    return {"name": "mha-serve", "version": __version__, "extensions": offered}


@router.get("/v2/models/{model_name}", summary="Model metadata", responses=MODEL_ERRORS)
@router.get(
    "/v2/models/{model_name}/versions/{model_version}",
    summary="Model metadata",
    responses=MODEL_ERRORS,
)
async def model_metadata(state: State, entry: PathModel) -> dict[str, Any]:
    return metadata_of(entry, state.served_versions(entry.name))


@router.get(
    "/v2/models/{model_name}/ready",
    summary="Model ready (its highest served version warmed up, not unloading)",
    responses=MODEL_ERRORS,
)
@router.get(
    "/v2/models/{model_name}/versions/{model_version}/ready",
    summary="Model version ready (warmed up, not unloading)",
    responses=MODEL_ERRORS,
)
async def model_ready(state: State, entry: PathModel) -> JSONResponse:
    is_ready = state.model_ready(entry)
    return JSONResponse(
        {"name": entry.name, "ready": is_ready}, status_code=200 if is_ready else 503
    )
